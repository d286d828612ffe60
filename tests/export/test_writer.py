"""export.writer: staging, checksums, the content-derived id, the atomic rename."""

import hashlib
import json
from pathlib import Path

import pytest

from bundle import CARD_FILES
from bundle.manifest import (
    MANIFEST_FILE,
    Counts,
    HnswParams,
    Manifest,
    RaeParams,
    SourceInfo,
    TokenizerInfo,
)
from export.writer import content_id, write_bundle


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
    served = {name: digest for name, digest in manifest.files.items() if name not in CARD_FILES}
    assert served == {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}
    assert set(manifest.files) == set(FILES) | set(CARD_FILES)  # the card too, written by the writer
    on_disk = json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())
    assert on_disk["files"] == manifest.files and on_disk["bundle_id"] == manifest.bundle_id
    assert {p.name for p in (tmp_path / "b").iterdir()} == set(FILES) | set(CARD_FILES) | {MANIFEST_FILE}
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
    assert all(first.files[name] == other_tau.files[name] for name in FILES) and first.bundle_id != other_tau.bundle_id
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


def test_of_two_writers_racing_to_one_target_without_force_the_second_is_refused_at_the_rename(tmp_path):
    """Issue 43, case 3: both found the target missing at the start; the one finishing last
    replaced the other's bundle. Now the final rename refuses an existing target."""
    first: list = []

    def slow(stage: Path) -> dict:
        first.append(write_bundle(tmp_path / "b", writing(FILES)))  # the other writer finishes meanwhile
        return writing({"encoder.onnx": b"the slower writer's"})(stage)

    with pytest.raises(FileExistsError, match="created by another writer"):
        write_bundle(tmp_path / "b", slow)
    assert json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())["bundle_id"] == first[0].bundle_id
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # the refused writer's staging dir is gone


def test_without_renameat2_the_rename_still_refuses_an_existing_bundle(tmp_path, monkeypatch):
    from export import writer

    monkeypatch.setattr(writer, "_renameat2", lambda a, b, flags: False)  # a file system without it
    write_bundle(tmp_path / "b", writing(FILES))
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "x").write_text("x")
    with pytest.raises(FileExistsError, match="no renameat2"):
        writer.rename_no_replace(stage, tmp_path / "b")


def test_force_replaces_a_bundle_and_a_failed_replacement_keeps_the_old_one(tmp_path):
    write_bundle(tmp_path / "b", writing(FILES))
    with pytest.raises(RuntimeError, match="killed"):
        write_bundle(tmp_path / "b", crash, force=True)
    assert (tmp_path / "b" / "index.hnsw").read_bytes() == b"idx"
    new = write_bundle(tmp_path / "b", writing({"encoder.onnx": b"other"}), force=True)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(["encoder.onnx", MANIFEST_FILE, *CARD_FILES])
    assert json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())["bundle_id"] == new.bundle_id
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # the replaced bundle was removed


def test_the_bundle_dir_is_readable_by_other_users(tmp_path):
    write_bundle(tmp_path / "b", writing(FILES))
    assert (tmp_path / "b").stat().st_mode & 0o755 == 0o755


# A writer process that SIGKILLs itself right after its ``kill_at``-th file system step (a rename,
# an exchange, an fsync) while replacing the bundle at argv[1]; ``kill_at`` 0: it runs to the end
# and prints how many steps it took. ``two-renames``: as on a file system that cannot exchange.
CRASHING_WRITER = """
import os, signal, sys
from pathlib import Path
import export.writer as writer
from tests.export.test_writer import FILES, writing

out, kill_at, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
steps = 0

def step(function):
    def wrapped(*args, **kwargs):
        global steps
        result = function(*args, **kwargs)
        steps += 1
        if steps == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    return wrapped

os.rename, os.fsync = step(os.rename), step(os.fsync)
writer.exchange = step(writer.exchange if mode == "exchange" else lambda a, b: False)
writer.write_bundle(out, writing(FILES | {"encoder.onnx": b"new"}), force=True)
print(steps)
"""


def run_crashing_writer(out: Path, kill_at: int, mode: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-c", CRASHING_WRITER, str(out), str(kill_at), mode]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def served_encoder(out: Path) -> bytes:
    """The bundle at ``out``, checked complete (every file its manifest lists, checksum matching)."""
    from bundle.manifest import sha256_file

    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert {name: sha256_file(out / name) for name in manifest["files"]} == manifest["files"]
    return (out / "encoder.onnx").read_bytes()


@pytest.mark.parametrize("mode", ["exchange", "two-renames"])
def test_a_writer_killed_at_any_step_of_force_leaves_the_old_or_the_new_bundle(tmp_path, mode):
    """SIGKILL after each rename, exchange and fsync of a --force replacement: the target holds
    the old bundle or the new one, complete (with the exchange, at once; without one, once the
    next write has put the old one back), and the next write removes what the dead writer left."""
    from export.writer import remove_stale

    out = tmp_path / "b"
    finished = run_crashing_writer(out, 0, mode)  # no bundle there yet: a plain write, counting its steps
    assert finished.returncode == 0, finished.stderr
    steps = int(finished.stdout)
    write_bundle(out, writing(FILES), force=True)
    assert served_encoder(out) == b"graph"
    seen = set()
    for kill_at in range(1, steps + 3):
        killed = run_crashing_writer(out, kill_at, mode)
        assert killed.returncode in (-9, 0), killed.stderr
        if mode == "exchange":
            seen.add(served_encoder(out))
        remove_stale(out)
        seen.add(served_encoder(out))
        assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no staging or replaced dir left
        write_bundle(out, writing(FILES), force=True)  # the old bundle again for the next round
    assert seen == {b"graph", b"new"}


def test_staging_dirs_of_a_dead_writer_are_removed_and_a_live_ones_kept(tmp_path):
    import os

    from export.writer import remove_stale

    host = __import__("socket").gethostname().replace("-", "_")
    dead = tmp_path / f".b.staging-{host}-{2**22 + 7}-x"  # above pid_max's default: no such process
    alive = tmp_path / f".b.staging-{host}-{os.getpid()}-y"
    other_bundle = tmp_path / f".c.staging-{host}-{2**22 + 7}-z"
    for directory in (dead, alive, other_bundle):
        directory.mkdir()
    write_bundle(tmp_path / "b", writing(FILES))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["b", alive.name, other_bundle.name])
    remove_stale(tmp_path / "b")
    assert alive.exists()
