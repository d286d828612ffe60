"""export.build: DistilBERT (small random config) and trained-head checkpoints to bundles; the CLI."""

import json
import re
import shutil
from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from bundle.labels import DuplicateUids
from bundle.manifest import MANIFEST_FILE, IndexKind, sha256_file
from engine.bundle import load_bundle
from engine.search import Predictor
from export.build import ExportParams, build_bundle, build_parser, write_label_files
from export.onnx_export import ParityError
from xmc.checkpoint import HeadBlock, ServingHead
from xmc.data import LabelSpace, load_jsonl_split


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
    assert manifest["schema_version"] == 2 and manifest["tokenizer"]["lowercase"] is True


def test_same_inputs_give_the_same_bundle(distilbert_dir, small_labels, tmp_path):
    params = ExportParams(index_kind="labels", dim=8)
    first = build_bundle(tmp_path / "a", small_labels, None, distilbert_dir, params)
    second = build_bundle(tmp_path / "b", small_labels, None, distilbert_dir, params)
    assert first.served_files == second.served_files and first.bundle_id == second.bundle_id


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
    stored = np.asarray(bundle.index.vectors([0, 1, 2]))
    half = 1 / np.sqrt(2)  # two unit blocks, scaled so the whole vector is unit-norm
    expected = psi[:3] / np.linalg.norm(psi[:3], axis=1, keepdims=True) * half
    np.testing.assert_allclose(stored[:, 8:], expected, atol=1e-5)  # N(Ψ_l) half
    np.testing.assert_allclose(np.linalg.norm(stored[:, :8], axis=1), half, atol=1e-5)  # N(g1) half


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
    stored = np.asarray(load_bundle(tmp_path / "clf").index.vectors([0, 1]))
    np.testing.assert_allclose(stored, psi[:2] / np.linalg.norm(psi[:2], axis=1, keepdims=True), atol=1e-5)
    with pytest.raises(ValueError, match="head blocks"):
        build_bundle(tmp_path / "bad", small_labels, None, ckpt, ExportParams(index_kind="labels", head_blocks="g3"))


def options(parser) -> list:
    return [action for action in parser._actions if action.option_strings]


def test_label_files_naming_a_uid_twice_are_refused_before_encoding(tmp_path):
    """An XMC-repository label file whose uid repeats (line 18 repeats line 4's) is refused by the
    build with both rows named, before any model is loaded (the checkpoint here does not exist)."""
    import gzip

    data = tmp_path / "data"
    data.mkdir()
    labels = [{"uid": f"pkg-{i}", "title": f"package {i}"} for i in range(20)]
    labels[17]["uid"] = "pkg-3"
    with gzip.open(data / "lbl.json.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(label) + "\n" for label in labels)
    with gzip.open(data / "trn.json.gz", "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"uid": "i0", "title": "an instance", "target_ind": [3, 17]}) + "\n")
    train = load_jsonl_split(data, "trn")
    with pytest.raises(DuplicateUids, match="label uid 'pkg-3' at rows 3 and 17"):
        build_bundle(tmp_path / "b", train.labels, train, tmp_path / "no-checkpoint", ExportParams())
    assert not (tmp_path / "b").exists()


def test_the_label_writer_refuses_a_uid_twice_in_either_format(tmp_path):
    """Every bundle writer's labels (build, compaction) go through write_label_files."""
    for labels_format in ("jsonl", "arrays"):
        with pytest.raises(DuplicateUids, match="label uid 'b' at rows 1 and 2"):
            write_label_files(tmp_path, LabelSpace(uids=["a", "b", "b"], texts=["x", "y", "z"]), labels_format)
    assert not any(tmp_path.iterdir())


def test_every_cli_option_has_a_help():
    undocumented = [a.option_strings for a in options(build_parser()) if not (a.help or "").strip()]
    assert undocumented == []


def test_cli_choices_come_from_the_params_types():
    by_flag = {a.option_strings[0]: a for a in options(build_parser())}
    assert tuple(by_flag["--index-kind"].choices) == get_args(IndexKind)
    assert tuple(by_flag["--quantize"].choices) == ("none", "int8", "int8-static")
    assert tuple(by_flag["--rae-mode"].choices) == ("joint", "split")
    for bad in (["--quantize", "int4"], ["--index-kind", "ivf"], ["--optimize", "maybe"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--data", "x", "--out", "y", *bad])


def export_commands(text: str) -> list[str]:
    """The ``export.build`` command lines in ``text``, backslash continuations joined."""
    joined = re.sub(r"\\\n", " ", text)
    return [line[line.index("export.build") :] for line in joined.splitlines() if "export.build" in line]


def test_every_flag_the_repo_passes_to_export_build_exists():
    root = Path(__file__).resolve().parents[2]
    sources = [root / "Makefile", root / "README.md", root / "docker-compose.yml"]
    sources += [p for folder in ("deploy", "docs", "bench") for p in (root / folder).rglob("*") if p.is_file()]
    used = set()
    for path in sources:
        for command in export_commands(path.read_text(errors="ignore")):
            used |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command))
    known = {flag for action in options(build_parser()) for flag in action.option_strings}
    assert {"--data", "--out", "--quantize", "--index-kind"} <= used  # the scan found the call sites
    assert used <= known, used - known


# Every option `python -m export.build` had before export/ was restructured: scripts call them by name.
FLAGS = [
    "--data",
    "--out",
    "--checkpoint",
    "--split",
    "--force",
    "--index-kind",
    "--dim",
    "--max-length",
    "--hnsw-m",
    "--ef-construction",
    "--ef-search",
    "--rae-lambda",
    "--rae-tau",
    "--rae-top-b",
    "--rae-mode",
    "--batch-size",
    "--optimize",
    "--quantize",
    "--int8-min-cosine",
    "--parity-texts",
    "--parity-tolerance",
    "--max-train",
    "--head-blocks",
    "--build-threads",
    "--seed",
]


def test_no_flag_name_was_lost():
    known = {flag for action in options(build_parser()) for flag in action.option_strings}
    assert set(FLAGS) <= known, set(FLAGS) - known
