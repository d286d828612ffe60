"""Writing a bundle directory: the one code path every bundle, built or derived, goes through.

Bundles are immutable and served while others are written beside them, so a bundle is written
in full into a hidden staging sibling of its target, then sealed — the sha256 of every file and
an id derived from that content go into ``manifest.json`` — and only then renamed into place. A
reader sees no bundle or a complete one; a failure at any step removes the staging dir and leaves
the target as it was.

Durable, not only atomic: every file and the staging directory are fsynced before the rename and
the parent directory after it, so a power loss after :func:`write_bundle` returns cannot leave a
bundle whose name exists but whose files are empty (ext4 and XFS may otherwise commit the rename
before the data). Without ``force`` the final rename is ``renameat2(RENAME_NOREPLACE)``, so of two
writers racing to one target exactly one wins and the other gets ``FileExistsError`` (checking at
the start only is not enough: both may find the target missing). ``force`` swaps the new bundle
and the old in one ``renameat2(RENAME_EXCHANGE)``
(Linux ≥ 3.15), so a process killed at any point leaves the old bundle or the new one at the
target, never neither; where the file system cannot exchange, the old one is renamed aside first
and put back by the next write if the writer died in between. Staging and replaced directories a
dead writer left behind are removed by the next write beside them.

The id depends on the files and on the RAE parameters (τ and b live only in the manifest, yet
change what the bundle serves), not on timestamps: the same inputs give the same id.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import scipy.sparse as sp

from bundle import CARD_FILES, MANIFEST_FILE, VALUES_FILE, Manifest, Shard, build_values, content_id, sha256_file
from engine.offline import sync_directory
from export.card import CardFacts, card_for, write_card

# Writes the payload files into the staging dir it is given; returns the manifest's fields
# except ``bundle_id`` and ``files``, which the writer derives from what was written.
Populate = Callable[[Path], dict[str, Any]]


def write_bundle(out: Path, populate: Populate, force: bool = False, card: CardFacts | None = None) -> Manifest:
    """Write the bundle ``out`` with the files ``populate`` writes and its card (``card``: what
    the writing command knows beyond the manifest); return its manifest.

    Raises ``FileExistsError`` when ``out`` exists, unless ``force`` (then it is replaced).
    """
    refuse_existing(out, force)
    remove_stale(out)
    with _staging_dir(out, force) as stage:
        manifest = _seal(stage, populate(stage), card)
    return manifest


def refuse_existing(out: Path, force: bool) -> None:
    """Raise ``FileExistsError`` when ``out`` exists and may not be replaced. Callers with costly
    work before :func:`write_bundle` call this first too, so they fail before that work."""
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; bundles are immutable (pass --force / force=True to replace)")


def file_checksums(directory: Path) -> dict[str, str]:
    """``{file name: sha256}`` of every file in ``directory`` (bundles are flat)."""
    return {path.name: sha256_file(path) for path in sorted(directory.iterdir())}


def write_values(directory: Path, train_Y: sp.csr_matrix, lam: float, shards: list[Shard] | None = None) -> None:
    """``values.npz`` (or each shard's ``values-<i>.npz``: its rows), the RAE value matrix for
    ``lam``. Built, derived and compacted bundles all write it here, so the same λ and labels
    give the same bytes, and so the same bundle id."""
    values = build_values(train_Y, lam)
    if not shards:
        sp.save_npz(directory / VALUES_FILE, values, compressed=True)
    for shard in shards or []:
        sp.save_npz(directory / shard.values, values[shard.first_key : shard.first_key + shard.keys], compressed=True)


def _seal(stage: Path, fields: dict[str, Any], card: CardFacts | None = None) -> Manifest:
    """Checksum the staged files, derive the id, write the card and ``manifest.json`` (not itself
    listed)."""
    for name in CARD_FILES:  # a parent's card copied along describes the parent: this one gets its own
        (stage / name).unlink(missing_ok=True)
    # Validated first with a blank id: the id is a function of the validated content.
    draft = Manifest(bundle_id="", files=file_checksums(stage), **fields)
    manifest = draft.model_copy(update={"bundle_id": content_id(draft)})
    write_card(stage, card_for(manifest, card))
    # only the card is new since the files were hashed: a 10^7-label bundle's files are not read twice
    files = draft.files | {name: sha256_file(stage / name) for name in CARD_FILES}
    manifest = manifest.model_copy(update={"files": dict(sorted(files.items()))})
    (stage / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    return manifest


# Leftovers of a writer that died: ``.<name>.staging-<host>-<pid>-<random>`` and
# ``.<name>.replaced-<host>-<pid>-<random>``, removed by the next write of ``<name>`` once their
# writer is gone (its pid dead on this host; on another host sharing the volume, after a day).
STAGING, REPLACED = "staging", "replaced"
FOREIGN_STALE_AFTER_S = 24 * 3600


def _leftover_prefix(out: Path, kind: str) -> str:
    return f".{out.name}.{kind}-"


def _owner_tag() -> str:
    return f"{socket.gethostname().replace('-', '_')}-{os.getpid()}-"


def _writer_is_gone(leftover: Path, prefix: str) -> bool:
    host, _, rest = leftover.name.removeprefix(prefix).partition("-")
    pid = rest.partition("-")[0]
    if host != socket.gethostname().replace("-", "_") or not pid.isdigit():
        return time.time() - leftover.stat().st_mtime > FOREIGN_STALE_AFTER_S
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


def remove_stale(out: Path) -> None:
    """Clean up after writers of ``out`` that died: put a replaced bundle back when ``out`` is
    missing (the fallback replacement was cut between its renames), then remove their staging
    and replaced directories."""
    if not out.parent.is_dir():
        return
    for kind in (REPLACED, STAGING):
        prefix = _leftover_prefix(out, kind)
        for leftover in sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix)):
            with contextlib.suppress(FileNotFoundError):
                if not _writer_is_gone(leftover, prefix):
                    continue
                if kind == REPLACED and not out.exists() and (leftover / out.name).is_dir():
                    (leftover / out.name).rename(out)
                    sync_directory(out.parent)
                shutil.rmtree(leftover, ignore_errors=True)


def fsync_tree(directory: Path) -> None:
    """Make every file under ``directory`` and the directories themselves durable."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_directory(Path(root))


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """``renameat2(a, b, flags)``; False where the C library or the file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    if code == errno.EEXIST:
        raise FileExistsError(code, os.strerror(code), str(b))
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``); False where
    the C library or the file system cannot (the caller falls back to two renames)."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def rename_no_replace(a: Path, b: Path) -> None:
    """Rename ``a`` to ``b`` unless ``b`` exists (``FileExistsError``), atomically:
    ``renameat2(RENAME_NOREPLACE)``. Where that is not supported, ``rename(2)``, which refuses a
    non-empty directory at ``b`` as well (every bundle holds its manifest) but would replace an
    empty one: the error says which."""
    try:
        if _renameat2(a, b, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise FileExistsError(
            f"{b} was created by another writer while this one wrote; bundles are immutable "
            "(pass --force / force=True to replace)"
        ) from None
    try:
        os.rename(a, b)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(
                f"{b} was created by another writer while this one wrote (this file system has no "
                "renameat2(RENAME_NOREPLACE); rename(2) refused the non-empty target)"
            ) from None
        raise


@contextmanager
def _staging_dir(out: Path, force: bool) -> Iterator[Path]:
    """A hidden sibling of ``out`` (same file system, so the final rename is atomic) that becomes
    ``out`` when the block succeeds (replacing one only with ``force``) and is removed when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=_leftover_prefix(out, STAGING) + _owner_tag(), dir=out.parent))
    stage.chmod(0o755)  # mkdtemp makes it private; a serving container runs as another user
    try:
        yield stage
        fsync_tree(stage)
        _move_into_place(stage, out, force)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _move_into_place(stage: Path, out: Path, force: bool) -> None:
    if not force or not out.exists():
        rename_no_replace(stage, out)  # another writer may have put one there since we checked
        sync_directory(out.parent)
        return
    if exchange(stage, out):  # the new bundle at ``out``, the old one at ``stage``: delete it
        sync_directory(out.parent)
        shutil.rmtree(stage, ignore_errors=True)
        return
    # No exchange: the old bundle moves aside first (a reader never sees it half-deleted); a
    # writer killed before the second rename leaves it aside, and the next write puts it back.
    retired = Path(tempfile.mkdtemp(prefix=_leftover_prefix(out, REPLACED) + _owner_tag(), dir=out.parent))
    out.rename(retired / out.name)
    try:
        stage.rename(out)
    except BaseException:
        (retired / out.name).rename(out)
        raise
    sync_directory(out.parent)
    shutil.rmtree(retired, ignore_errors=True)
