"""Export encodes on the fastest device: ONNX on CPU, torch (fp16) on CUDA, checked against ONNX."""

import numpy as np
import pytest
import torch

from export.export_params import ExportParams
from export.onnx_export import ParityError
from export.pooled_vectors import encode_pooled, resolve_device, torch_pooled
from export.serving_graph import load_encoder, load_fast_tokenizer

TEXTS = ["libc6: GNU C Library", "python3-numpy: fast arrays for Python 3", "x", "vim " * 30] * 5


@pytest.fixture(scope="module")
def tiny(distilbert_dir):
    return load_encoder(distilbert_dir), load_fast_tokenizer(distilbert_dir, 64)


def test_cpu_export_encodes_with_onnx_and_reports_its_pace(tiny):
    encoder, tokenizer = tiny
    pooled, report = encode_pooled(encoder, tokenizer, TEXTS, ExportParams(encode_device="cpu", max_length=64))
    assert pooled.shape == (len(TEXTS), encoder.config.hidden_size)
    summary = report.as_dict()
    assert summary["encode_device"] == "cpu" and summary["encode_texts_per_s"] > 0
    assert summary["encode_parity_max_abs_diff"] is None  # the ONNX graph itself was checked against torch


def test_the_torch_path_matches_onnx_in_length_sorted_batches(tiny):
    """The GPU path's code on the CPU: sorted batches, rows put back in input order."""
    encoder, tokenizer = tiny
    onnx, _ = encode_pooled(encoder, tokenizer, TEXTS, ExportParams(encode_device="cpu", max_length=64))
    torch_vectors = torch_pooled(encoder, tokenizer, TEXTS, "cpu", batch_size=3)
    np.testing.assert_allclose(torch_vectors, onnx, atol=1e-4)


def test_cuda_asked_for_without_a_gpu_fails_before_encoding(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        resolve_device("cuda")


def test_device_vectors_that_drift_fail_the_export(tiny, monkeypatch):
    import export.pooled_vectors as encode

    encoder, tokenizer = tiny
    monkeypatch.setattr(encode, "resolve_device", lambda requested: "cpu-torch")
    monkeypatch.setattr(encode, "torch_pooled", lambda enc, tok, texts, device, batch: np.ones((len(texts), 32)))
    with pytest.raises(ParityError, match="differ from the ONNX graph"):
        encode_pooled(encoder, tokenizer, TEXTS, ExportParams(max_length=64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_encoding_matches_the_onnx_graph_within_fp16(tiny):
    encoder, tokenizer = tiny
    pooled, report = encode_pooled(encoder, tokenizer, TEXTS * 20, ExportParams(encode_device="cuda", max_length=64))
    assert report.device == "cuda" and report.parity_max_abs_diff <= 0.05
