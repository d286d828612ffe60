"""export.onnx_export: graph export, fusion fallback, the parity check."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from export.onnx_export import ParityError, attention_shape, check_parity, export_onnx, fuse_or_keep, random_texts
from export.serving_graph import ServingEncoder, load_encoder, load_fast_tokenizer
from xmc.checkpoint import fit_pca_head


def test_parity_check_fails_when_onnx_and_torch_disagree(distilbert_dir, tmp_path):
    tokenizer = load_fast_tokenizer(distilbert_dir, 32)
    encoder = load_encoder(distilbert_dir)
    head = fit_pca_head(np.random.default_rng(0).normal(size=(64, 32)), 8, pre_normalize=False)
    model = ServingEncoder(encoder, head).eval()
    export_onnx(model, tokenizer, tmp_path / "m.onnx")
    texts = random_texts(tokenizer, 16)
    assert check_parity(model, tokenizer, tmp_path / "m.onnx", texts).max_abs_diff <= 1e-4
    with torch.no_grad():
        # torch now differs from the exported graph (a random change: a constant one would be
        # invisible, LayerNorm outputs sum to ~0)
        model.blocks[0].weight.add_(0.1 * torch.randn_like(model.blocks[0].weight))
    with pytest.raises(ParityError, match="ONNX parity failed"):
        check_parity(model, tokenizer, tmp_path / "m.onnx", texts)


def test_random_texts_vary_in_length_and_hit_truncation(distilbert_dir):
    tokenizer = load_fast_tokenizer(distilbert_dir, 32)
    lengths = {len(tokenizer.encode(t).ids) for t in random_texts(tokenizer, 64)}
    assert min(lengths) <= 5 and max(lengths) == 32


def test_attention_shape_reads_bert_and_distilbert_configs(distilbert_dir):
    assert attention_shape(AutoConfig.from_pretrained(distilbert_dir)) == (2, 32)
    bert = AutoConfig.for_model("bert", num_attention_heads=4, hidden_size=64)
    assert attention_shape(bert) == (4, 64)


@pytest.mark.parametrize("fuse", [True, False])
def test_a_graph_that_cannot_be_fused_is_kept_as_it_is(tmp_path, fuse):
    plain, final = tmp_path / "m.plain.onnx", tmp_path / "m.onnx"
    plain.write_bytes(b"graph")
    gpt2 = AutoConfig.for_model("gpt2")  # no transformer fusions known: kept unfused, not an error
    assert fuse_or_keep(plain, final, gpt2, fuse) == {}
    assert final.read_bytes() == b"graph" and not plain.exists()
