"""Export: DistilBERT (small random config) and trained-head checkpoints to bundles, parity checks."""

import json
import shutil

import numpy as np
import pytest
import torch

from export.build import ExportParams, build_bundle
from export.model import ServingEncoder, load_encoder, load_fast_tokenizer
from export.onnx_export import ParityError, check_parity, export_onnx, random_texts
from service.engine.bundle import load_bundle
from service.engine.manifest import MANIFEST_FILE, sha256_file
from service.engine.search import Predictor
from training.checkpoint import HeadBlock, ServingHead, fit_pca_head
from training.data import LabelSpace, load_jsonl_split


@pytest.fixture(scope="module")
def small_labels(sample_dir):
    labels = load_jsonl_split(sample_dir, "dev").labels
    return LabelSpace(uids=labels.uids[:300], texts=labels.texts[:300])


def test_distilbert_exports_passes_parity_and_serves(distilbert_dir, small_labels, tmp_path):
    params = ExportParams(index_kind="labels", dim=16, max_length=64)
    manifest = build_bundle(tmp_path / "b", small_labels, None, distilbert_dir, params)
    assert manifest.source.architecture == "distilbert"
    assert manifest.params["parity"]["max_abs_diff"] <= 1e-4
    assert manifest.params["fusions"].get("Attention") == 2  # the graph was fused, then parity-checked
    assert manifest.counts.memory_rows == 300 and manifest.dim == 16

    bundle = load_bundle(tmp_path / "b")
    ranking = Predictor(bundle).predict([small_labels.texts[7]], k=3).rankings[0]
    assert ranking.ids[0] == 7  # a label's own text finds that label first
    assert ranking.scores[0] == pytest.approx(1.0, abs=1e-4)


def test_int8_bundle_records_its_drift_and_serves(distilbert_dir, small_labels, tmp_path):
    params = ExportParams(index_kind="labels", dim=16, quantize="int8")
    manifest = build_bundle(tmp_path / "q", small_labels, None, distilbert_dir, params)
    assert manifest.params["parity"]["max_abs_diff"] <= 1e-4  # the float graph, before quantization
    assert 0.85 <= manifest.params["int8_min_cosine"] < 1.0
    assert not any(p.name.startswith("encoder.") and p.name != "encoder.onnx" for p in (tmp_path / "q").iterdir())
    ranking = Predictor(load_bundle(tmp_path / "q")).predict([small_labels.texts[3]], k=1).rankings[0]
    assert ranking.ids[0] == 3


def test_int8_drift_beyond_the_bound_is_refused(distilbert_dir, small_labels, tmp_path):
    params = ExportParams(index_kind="labels", dim=16, quantize="int8", int8_min_cosine=0.99999)
    with pytest.raises(ParityError, match="int8 graph drifts too far"):
        build_bundle(tmp_path / "q", small_labels, None, distilbert_dir, params)
    assert not (tmp_path / "q").exists()


def test_bundle_manifest_lists_every_file_with_its_checksum(distilbert_dir, small_labels, tmp_path):
    build_bundle(tmp_path / "b", small_labels, None, distilbert_dir, ExportParams(index_kind="labels", dim=8))
    manifest = json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())
    on_disk = {p.name for p in (tmp_path / "b").iterdir()} - {MANIFEST_FILE}
    assert set(manifest["files"]) == on_disk
    for name, digest in manifest["files"].items():
        assert sha256_file(tmp_path / "b" / name) == digest
    assert manifest["schema_version"] == 1 and manifest["tokenizer"]["lowercase"] is True


def test_same_inputs_give_the_same_bundle(distilbert_dir, small_labels, tmp_path):
    params = ExportParams(index_kind="labels", dim=8)
    first = build_bundle(tmp_path / "a", small_labels, None, distilbert_dir, params)
    second = build_bundle(tmp_path / "b", small_labels, None, distilbert_dir, params)
    assert first.files == second.files and first.bundle_id == second.bundle_id


def test_bundles_are_immutable(distilbert_dir, small_labels, tmp_path):
    params = ExportParams(index_kind="labels", dim=8)
    build_bundle(tmp_path / "b", small_labels, None, distilbert_dir, params)
    with pytest.raises(FileExistsError, match="immutable"):
        build_bundle(tmp_path / "b", small_labels, None, distilbert_dir, params)


def test_trained_head_checkpoint_uses_label_table_on_the_label_side(distilbert_dir, small_labels, tmp_path):
    rng = np.random.default_rng(0)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(distilbert_dir, ckpt / "encoder")
    psi = rng.normal(size=(len(small_labels), 8)).astype(np.float32)
    head = ServingHead(
        blocks=[
            HeadBlock("g1", rng.normal(size=(8, 32)).astype(np.float32), np.zeros(8, np.float32)),
            HeadBlock("g2", rng.normal(size=(8, 32)).astype(np.float32), np.zeros(8, np.float32)),
        ],
        label_table=psi,
        label_table_block=1,
    )
    head.save(ckpt)
    manifest = build_bundle(tmp_path / "b", small_labels, None, ckpt, ExportParams(index_kind="labels"))
    assert manifest.dim == 16 and manifest.source.head == "trained"
    bundle = load_bundle(tmp_path / "b")
    stored = np.asarray(bundle.index.get_items([0, 1, 2]))
    half = 1 / np.sqrt(2)  # two unit blocks, scaled so the whole vector is unit-norm
    expected = psi[:3] / np.linalg.norm(psi[:3], axis=1, keepdims=True) * half
    np.testing.assert_allclose(stored[:, 8:], expected, atol=1e-5)  # N(Ψ_l) half
    np.testing.assert_allclose(np.linalg.norm(stored[:, :8], axis=1), half, atol=1e-5)  # N(g1) half


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


def test_one_half_of_a_trained_head_can_be_served_alone(distilbert_dir, small_labels, tmp_path):
    rng = np.random.default_rng(1)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(distilbert_dir, ckpt / "encoder")
    psi = rng.normal(size=(len(small_labels), 8)).astype(np.float32)
    ServingHead(
        blocks=[
            HeadBlock("g1_de", rng.normal(size=(8, 32)).astype(np.float32), np.zeros(8, np.float32)),
            HeadBlock("g2_clf", rng.normal(size=(8, 32)).astype(np.float32), np.zeros(8, np.float32)),
        ],
        label_table=psi,
        label_table_block=1,
        kind="unidec",
    ).save(ckpt)
    params = ExportParams(index_kind="labels", head_blocks="g2_clf")
    manifest = build_bundle(tmp_path / "clf", small_labels, None, ckpt, params)
    assert manifest.dim == 8 and manifest.source.head == "unidec[g2_clf]"
    stored = np.asarray(load_bundle(tmp_path / "clf").index.get_items([0, 1]))
    np.testing.assert_allclose(stored, psi[:2] / np.linalg.norm(psi[:2], axis=1, keepdims=True), atol=1e-5)
    with pytest.raises(ValueError, match="head blocks"):
        build_bundle(tmp_path / "bad", small_labels, None, ckpt, ExportParams(index_kind="labels", head_blocks="g3"))


def test_derived_rae_bundle_changes_only_the_rae_parameters(tiny_rae_bundle, sample_dir, tmp_path):
    import scipy.sparse as sp

    from export.build import derive_rae_bundle

    train = load_jsonl_split(sample_dir, "trn").subset(np.arange(300))
    source = load_bundle(tiny_rae_bundle)
    derived_manifest = derive_rae_bundle(tiny_rae_bundle, tmp_path / "d", train.Y, lam=0.8, tau=0.1)
    derived = load_bundle(tmp_path / "d")  # checksums verified
    assert derived.manifest.rae.lam == 0.8 and derived.manifest.rae.tau == 0.1
    assert derived.manifest.rae.top_b == source.manifest.rae.top_b
    assert derived_manifest.bundle_id != source.bundle_id
    assert derived.manifest.files["encoder.onnx"] == source.manifest.files["encoder.onnx"]
    expected = sp.vstack([0.8 * (train.Y > 0), 0.2 * sp.identity(train.num_labels)]).toarray()
    np.testing.assert_allclose(derived.values.toarray(), expected, atol=1e-6)
    # only τ changes: same files, still a different bundle (τ is part of what it serves)
    only_tau = derive_rae_bundle(tiny_rae_bundle, tmp_path / "t", train.Y, tau=0.2)
    assert only_tau.files == source.manifest.files and only_tau.bundle_id != source.bundle_id
    with pytest.raises(ValueError, match="does not match"):
        derive_rae_bundle(tiny_rae_bundle, tmp_path / "x", train.Y[:10], lam=0.3)
    with pytest.raises(FileExistsError):
        derive_rae_bundle(tiny_rae_bundle, tmp_path / "d", train.Y, lam=0.3)


def test_boolean_flags_parse_false():
    from export.build import main
    from training.params import parse_bool

    assert parse_bool("False") is False and parse_bool("true") is True

    with pytest.raises(SystemExit):
        main(["--data", "x", "--out", "y", "--optimize", "maybe"])
