"""Writing a bundle directory: the one code path every bundle, built or derived, goes through.

Bundles are immutable and served while others are written beside them, so a bundle is written
in full into a hidden staging sibling of its target, then sealed — the sha256 of every file and
an id derived from that content go into ``manifest.json`` — and only then renamed into place. A
reader sees no bundle or a complete one; a failure at any step removes the staging dir and leaves
the target as it was.

The id depends on the files and on the RAE parameters (τ and b live only in the manifest, yet
change what the bundle serves), not on timestamps: the same inputs give the same id.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import scipy.sparse as sp

from service.engine.manifest import MANIFEST_FILE, VALUES_FILE, Manifest, Shard, bundle_id_from, sha256_file
from service.engine.rae import build_values

# Writes the payload files into the staging dir it is given; returns the manifest's fields
# except ``bundle_id`` and ``files``, which the writer derives from what was written.
Populate = Callable[[Path], dict[str, Any]]


def write_bundle(out: Path, populate: Populate, force: bool = False) -> Manifest:
    """Write the bundle ``out`` with the files ``populate`` writes; return its manifest.

    Raises ``FileExistsError`` when ``out`` exists, unless ``force`` (then it is replaced).
    """
    refuse_existing(out, force)
    with _staging_dir(out) as stage:
        manifest = _seal(stage, populate(stage))
    return manifest


def refuse_existing(out: Path, force: bool) -> None:
    """Raise ``FileExistsError`` when ``out`` exists and may not be replaced. Callers with costly
    work before :func:`write_bundle` call this first too, so they fail before that work."""
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; bundles are immutable (pass --force / force=True to replace)")


def file_checksums(directory: Path) -> dict[str, str]:
    """``{file name: sha256}`` of every file in ``directory`` (bundles are flat)."""
    return {path.name: sha256_file(path) for path in sorted(directory.iterdir())}


def content_id(manifest: Manifest) -> str:
    """The bundle id that ``manifest``'s files and RAE parameters give, e.g. ``labels-64d-<12 hex>``."""
    rae = {"rae": manifest.rae.model_dump_json()} if manifest.rae else {}
    return bundle_id_from(manifest.files | rae, prefix=f"{manifest.index_kind.replace('_', '-')}-{manifest.dim}d")


def write_values(directory: Path, train_Y: sp.csr_matrix, lam: float, shards: list[Shard] | None = None) -> None:
    """``values.npz`` (or each shard's ``values-<i>.npz``: its rows), the RAE value matrix for
    ``lam``. Built, derived and compacted bundles all write it here, so the same λ and labels
    give the same bytes, and so the same bundle id."""
    values = build_values(train_Y, lam)
    if not shards:
        sp.save_npz(directory / VALUES_FILE, values, compressed=True)
    for shard in shards or []:
        sp.save_npz(directory / shard.values, values[shard.first_key : shard.first_key + shard.keys], compressed=True)


def _seal(stage: Path, fields: dict[str, Any]) -> Manifest:
    """Checksum the staged files, derive the id and write ``manifest.json`` (not itself listed)."""
    # Validated first with a blank id: the id is a function of the validated content.
    draft = Manifest(bundle_id="", files=file_checksums(stage), **fields)
    manifest = draft.model_copy(update={"bundle_id": content_id(draft)})
    (stage / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    return manifest


@contextmanager
def _staging_dir(out: Path) -> Iterator[Path]:
    """A hidden sibling of ``out`` (same file system, so the final rename is atomic) that replaces
    ``out`` when the block succeeds and is removed when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    stage.chmod(0o755)  # mkdtemp makes it private; a serving container runs as another user
    try:
        yield stage
        _move_into_place(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _move_into_place(stage: Path, out: Path) -> None:
    if not out.exists():
        stage.rename(out)
        return
    # Replacing: move the old bundle aside by a rename rather than deleting it in place, so no
    # reader ever sees a half-deleted bundle at ``out``; it is deleted once the new one is there.
    retired = out.with_name(f".{out.name}.replaced-{uuid.uuid4().hex[:8]}")
    out.rename(retired)
    try:
        stage.rename(out)
    except BaseException:
        retired.rename(out)
        raise
    shutil.rmtree(retired, ignore_errors=True)
