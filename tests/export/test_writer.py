"""export.writer: staging, checksums, the content-derived id, the atomic rename."""

import hashlib
import json
from pathlib import Path

import pytest

from export.writer import content_id, write_bundle
from service.engine.manifest import (
    MANIFEST_FILE,
    Counts,
    HnswParams,
    Manifest,
    RaeParams,
    SourceInfo,
    TokenizerInfo,
)


def fields(rae: RaeParams | None = None, created_at: str = "2026-01-01T00:00:00+00:00") -> dict:
    """Manifest fields of a small fake bundle (the writer does not look inside the files)."""
    return {
        "created_at": created_at,
        "source": SourceInfo(encoder="enc", architecture="bert", head="pca"),
        "tokenizer": TokenizerInfo(max_length=16, lowercase=True),
        "dim": 4,
        "index_kind": "rae_memory" if rae else "labels",
        "hnsw": HnswParams(M=8, ef_construction=10, ef_search=10),
        "rae": rae,
        "counts": Counts(labels=2, memory_rows=2),
        "params": {"seed": 0},
    }


def writing(files: dict[str, bytes], **manifest):
    """A ``populate`` that writes ``files`` and returns :func:`fields` (``manifest`` passed on)."""

    def populate(stage: Path) -> dict:
        for name, data in files.items():
            (stage / name).write_bytes(data)
        return fields(**manifest)

    return populate


FILES = {"encoder.onnx": b"graph", "labels.jsonl": b'{"uid": "a", "text": "x"}\n', "index.hnsw": b"idx"}


def test_manifest_lists_a_sha256_for_every_file(tmp_path):
    manifest = write_bundle(tmp_path / "b", writing(FILES))
    assert manifest.files == {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}
    on_disk = json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())
    assert on_disk["files"] == manifest.files and on_disk["bundle_id"] == manifest.bundle_id
    assert {p.name for p in (tmp_path / "b").iterdir()} == set(FILES) | {MANIFEST_FILE}
    assert Manifest.model_validate(on_disk) == manifest


def test_the_id_comes_from_the_content_not_the_time(tmp_path):
    first = write_bundle(tmp_path / "a", writing(FILES))
    again = write_bundle(tmp_path / "b", writing(FILES, created_at="2027-05-05T00:00:00+00:00"))
    assert first.bundle_id == again.bundle_id == content_id(first)
    assert first.bundle_id.startswith("labels-4d-") and len(first.bundle_id) == len("labels-4d-") + 12


def test_the_id_changes_when_a_file_changes(tmp_path):
    first = write_bundle(tmp_path / "a", writing(FILES))
    changed = write_bundle(tmp_path / "b", writing(FILES | {"index.hnsw": b"idy"}))
    added = write_bundle(tmp_path / "c", writing(FILES | {"values.npz": b"v"}))
    assert len({first.bundle_id, changed.bundle_id, added.bundle_id}) == 3


def test_the_id_changes_with_the_rae_parameters_alone(tmp_path):
    rae = RaeParams(lam=0.5, tau=0.04, top_b=10)
    first = write_bundle(tmp_path / "a", writing(FILES, rae=rae))
    other_tau = write_bundle(tmp_path / "b", writing(FILES, rae=rae.model_copy(update={"tau": 0.1})))
    assert first.files == other_tau.files and first.bundle_id != other_tau.bundle_id
    assert first.bundle_id.startswith("rae-memory-4d-")


def crash(stage: Path) -> dict:
    (stage / "encoder.onnx").write_bytes(b"half")
    raise RuntimeError("killed while writing")


def test_a_crash_before_the_rename_leaves_no_partial_bundle(tmp_path):
    with pytest.raises(RuntimeError, match="killed"):
        write_bundle(tmp_path / "b", crash)
    assert list(tmp_path.iterdir()) == []  # no bundle, and no staging dir left behind


def test_invalid_manifest_fields_leave_no_partial_bundle(tmp_path):
    def bad_manifest(stage: Path) -> dict:
        (stage / "encoder.onnx").write_bytes(b"graph")
        return fields() | {"dim": 0}

    with pytest.raises(ValueError, match="dim"):
        write_bundle(tmp_path / "b", bad_manifest)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_bundle_is_refused_before_anything_is_written(tmp_path):
    old = write_bundle(tmp_path / "b", writing(FILES))

    def must_not_run(stage: Path) -> dict:
        raise AssertionError("populate called for an existing bundle")

    with pytest.raises(FileExistsError, match="immutable"):
        write_bundle(tmp_path / "b", must_not_run)
    assert json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())["bundle_id"] == old.bundle_id


def test_force_replaces_a_bundle_and_a_failed_replacement_keeps_the_old_one(tmp_path):
    write_bundle(tmp_path / "b", writing(FILES))
    with pytest.raises(RuntimeError, match="killed"):
        write_bundle(tmp_path / "b", crash, force=True)
    assert (tmp_path / "b" / "index.hnsw").read_bytes() == b"idx"
    new = write_bundle(tmp_path / "b", writing({"encoder.onnx": b"other"}), force=True)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["encoder.onnx", MANIFEST_FILE]
    assert json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())["bundle_id"] == new.bundle_id
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # the replaced bundle was removed


def test_the_bundle_dir_is_readable_by_other_users(tmp_path):
    write_bundle(tmp_path / "b", writing(FILES))
    assert (tmp_path / "b").stat().st_mode & 0o755 == 0o755
