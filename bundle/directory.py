"""A bundle directory as a whole: its manifest read and checked against the schema version, every
file name it gives kept inside the directory, and the files' sha256 against the manifest's.

Checksums say a file is the one the exporter wrote, not that the exporter wrote a sound one: what
each file holds is checked where it is read (:mod:`bundle.labels`, :mod:`bundle.csr_file`,
:mod:`bundle.hnsw_file`, :mod:`bundle.ivfpq_file`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from bundle.errors import BundleError
from bundle.manifest import MANIFEST_FILE, SCHEMA_VERSION, Manifest, required_files, sha256_file


def read_manifest(path: Path) -> Manifest:
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise BundleError(f"{path}: no {MANIFEST_FILE} (not a bundle directory?)")
    try:
        manifest = Manifest.model_validate_json(manifest_path.read_text())
    except (ValidationError, ValueError) as exc:
        raise BundleError(f"{manifest_path}: invalid manifest: {exc}") from None
    if manifest.schema_version != SCHEMA_VERSION:
        raise BundleError(
            f"{manifest_path}: schema version {manifest.schema_version}, this service reads {SCHEMA_VERSION}"
        )
    check_confined(path, [*manifest.files, *required_files(manifest)])
    return manifest


def check_confined(path: Path, names: list[str]) -> None:
    """Every file a bundle names stays inside its directory: no absolute paths, no ``..``, no
    symlink that leads out (a manifest could otherwise make the server read any file)."""
    root = path.resolve()
    for name in names:
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts or not (root / relative).resolve().is_relative_to(root):
            raise BundleError(f"{path}: file name {name!r} leads outside the bundle directory")


def verify_checksums(path: Path, manifest: Manifest, names: list[str] | None = None) -> None:
    """The sha256 of every file the manifest lists (or of ``names``: the files one process of a
    distributed deployment reads), and none of the required files unlisted."""
    for name in required_files(manifest):
        if name not in manifest.files:
            raise BundleError(f"{path}: manifest lists no checksum for required file {name}")
    for name in names if names is not None else manifest.files:
        expected = manifest.files[name]
        file = path / name
        if not file.is_file():
            raise BundleError(f"{path}: missing file {name}")
        actual = sha256_file(file)
        if actual != expected:
            raise BundleError(f"{path}: checksum mismatch for {name} (manifest {expected[:12]}…, file {actual[:12]}…)")
