"""Load a bundle directory and verify it (checksums, shapes, a warm-up encode) before use.

Checksums say a file is the one the exporter wrote, not that the exporter wrote a sound one: every
array a search reads by index is checked before it is used (the HNSW file's links, labels and
vectors, every CSR matrix's ``indptr``/``indices``), since an out-of-range index reaches native
code (hnswlib, scipy's C++ products) as an out-of-bounds read, a crash or a silent wrong answer,
on whichever row a query happens to touch. A bundle that fails is refused with the file and the
reason. Servers vet a bundle in a child process (:func:`~service.engine.search.vet_in_child`),
so these checks run there.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from pydantic import ValidationError

from service.engine.encoder import EncoderOptions, OnnxEncoder
from service.engine.fusion import FEATURE_GROUPS, ScoreFusion, groups_of
from service.engine.hnsw_file import HnswFileRefused, check_index_body, check_index_header
from service.engine.index import HnswIndex, IvfPqIndex, KeyIndex, ShardedIndex
from service.engine.ivfpq import IndexRefused
from service.engine.labels import (
    DuplicateUids,
    LabelsRefused,
    StringColumn,
    UidLookup,
    check_unique_uids,
    load_label_arrays,
)
from service.engine.lexical import KeyTerms, key_terms_of
from service.engine.manifest import (
    ENCODER_FILE,
    LABELS_FILE,
    MANIFEST_FILE,
    SCHEMA_VERSION,
    TOKENIZER_FILE,
    Manifest,
    Shard,
    label_files,
    required_files,
    sha256_file,
    shard_list,
)
from service.engine.shards import ShardSearcher

log = logging.getLogger(__name__)


class BundleError(RuntimeError):
    """The bundle is missing, corrupt or inconsistent; the message says which part."""


@dataclass
class Bundle:
    path: Path
    manifest: Manifest
    encoder: OnnxEncoder
    index: KeyIndex
    label_uids: StringColumn
    label_texts: StringColumn
    values: sp.csr_matrix | None
    fusion: ScoreFusion | None = None
    key_terms: KeyTerms | None = None  # the keys' term vectors, for a lexical fusion
    uid_lookup: UidLookup | None = None  # uid → label id (None: made from label_uids)

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id


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


def read_labels(path: Path, manifest: Manifest) -> tuple[StringColumn, StringColumn, UidLookup]:
    """Label uids and texts, as many as the manifest counts, and the uid → id lookup: the
    bundle's memory-mapped label arrays, checked (:mod:`service.engine.labels`), or ``labels.jsonl``
    read into the same arrays."""
    if manifest.labels_format == "arrays":
        try:
            return load_label_arrays(path, manifest.counts.labels)
        except LabelsRefused as exc:
            raise BundleError(f"{path}: label arrays refused: {exc}") from None
    uids, texts = [], []
    with open(path / LABELS_FILE, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            try:
                obj = json.loads(line)
                uids.append(str(obj["uid"]))
                texts.append(str(obj["text"]))
            except (ValueError, KeyError) as exc:
                raise BundleError(f"{path / LABELS_FILE}:{lineno}: bad label line ({exc})") from None
    if len(uids) != manifest.counts.labels:
        raise BundleError(f"{path}: {len(uids)} labels in {LABELS_FILE}, manifest says {manifest.counts.labels}")
    uid_column = StringColumn.of(uids)
    try:
        check_unique_uids(uid_column)
    except DuplicateUids as exc:
        raise BundleError(f"{path / LABELS_FILE}: {exc}") from None
    return uid_column, StringColumn.of(texts), UidLookup.of(uid_column)


def load_shard_index(path: Path, manifest: Manifest, shard: Shard) -> HnswIndex | IvfPqIndex:
    """One shard's HNSW index, its header and body checked before hnswlib reads them; or its
    compressed index (``ann`` ivfpq), the inverted lists and re-rank vectors checked before faiss
    reads them (:mod:`service.engine.ivfpq`)."""
    file = path / shard.index
    if manifest.ann == "ivfpq":
        try:
            return IvfPqIndex.load(file, path / shard.rerank, manifest.dim, manifest.ivfpq, shard.first_key, shard.keys)
        except IndexRefused as exc:
            raise BundleError(f"{file}: IVF-PQ index refused: {exc}") from None
    try:
        check_index_header(file, manifest.dim, manifest.hnsw.M, shard.keys)
        check_index_body(file, shard.first_key, shard.keys)
    except HnswFileRefused as exc:
        raise BundleError(str(exc)) from None
    try:
        return HnswIndex.load(file, manifest.dim, manifest.hnsw.space)
    except RuntimeError as exc:
        raise BundleError(f"{file}: cannot load HNSW index ({exc})") from None


def load_index(path: Path, manifest: Manifest) -> KeyIndex:
    """The bundle's key index; a sharded bundle's shards behind one :class:`ShardedIndex`."""
    indexes = [load_shard_index(path, manifest, shard) for shard in shard_list(manifest)]
    return indexes[0] if len(indexes) == 1 else ShardedIndex(indexes)


def load_csr(file: Path, shape: tuple[int, int], what: str) -> sp.csr_matrix:
    """A CSR matrix written by ``scipy.sparse.save_npz``, as float32, refused unless it is one of
    ``shape`` whose structure holds: ``indptr`` starts at 0, never decreases and ends at the
    number of entries, every column index is inside the matrix, every value is finite. scipy
    checks none of this when it loads a file, and its C++ products index by these arrays."""

    def refuse(problem: str) -> None:
        raise BundleError(f"{file}: {what} refused: {problem}")

    try:
        with np.load(file, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in ("format", "shape", "indptr", "indices", "data")}
    except KeyError as exc:
        raise BundleError(f"{file}: {what} refused: not a scipy sparse file (no {exc})") from None
    except (OSError, ValueError) as exc:
        raise BundleError(f"{file}: cannot load {what} ({exc})") from None
    fmt, declared, indptr, indices, data = arrays.values()
    rows, cols = shape
    if fmt.item() not in (b"csr", "csr"):
        refuse(f"stored as {fmt.item()!r}, not csr")
    if tuple(int(n) for n in declared.ravel()) != shape:
        refuse(f"shape {tuple(declared.ravel().tolist())}, expected {shape}")
    for name, array in (("indptr", indptr), ("indices", indices)):
        if array.ndim != 1 or array.dtype.kind not in "iu":
            refuse(f"{name} is not a 1-d integer array")
    if data.ndim != 1 or data.dtype.kind not in "fiu" or len(data) != len(indices):
        refuse(f"data is not {len(indices)} real numbers, one per column index")
    if len(indptr) != rows + 1 or indptr[0] != 0 or indptr[-1] != len(indices) or np.any(np.diff(indptr) < 0):
        refuse(f"indptr is not {rows + 1} non-decreasing offsets from 0 to {len(indices)}")
    if len(indices) and (indices.min() < 0 or indices.max() >= cols):
        refuse(f"column index {int(indices.max() if indices.max() >= cols else indices.min())} outside 0..{cols - 1}")
    if not np.all(np.isfinite(data)):
        refuse("a value is not finite")
    return sp.csr_matrix((data.astype(np.float32), indices, indptr), shape=shape)


def load_shard_values(path: Path, manifest: Manifest, shard: Shard) -> sp.csr_matrix:
    """One shard's rows of V, (its keys x labels)."""
    return load_csr(path / shard.values, (shard.keys, manifest.counts.labels), "value matrix")


def check_rae_counts(path: Path, manifest: Manifest) -> None:
    if manifest.rae is None:
        raise BundleError(f"{path}: rae_memory bundle without RAE parameters")
    if manifest.counts.train_instances + manifest.counts.labels != manifest.counts.memory_rows:
        raise BundleError(f"{path}: memory rows != train instances + labels")


def load_values(path: Path, manifest: Manifest) -> sp.csr_matrix | None:
    """V, the shards' value rows stacked in key order."""
    if manifest.index_kind != "rae_memory":
        return None
    check_rae_counts(path, manifest)
    parts = [load_shard_values(path, manifest, shard) for shard in shard_list(manifest)]
    return parts[0] if len(parts) == 1 else sp.vstack(parts, format="csr")


def load_fusion(path: Path, manifest: Manifest, verify: bool = True) -> ScoreFusion | None:
    """The bundle's score fusion (``manifest.fusion``), or None: its ONNX model in an ONNX Runtime
    session, checked for shape."""
    if manifest.fusion is None:
        return None
    params = manifest.fusion
    try:
        groups_of(params.features)
    except ValueError as exc:
        raise BundleError(f"{path}: {exc}; this service computes {list(FEATURE_GROUPS)}") from None
    if verify:
        verify_checksums(path, manifest, [params.file, params.model, TOKENIZER_FILE])
    try:
        fusion = ScoreFusion.load(
            path, params, manifest.counts.labels, (path / TOKENIZER_FILE, manifest.tokenizer.max_length)
        )
    except Exception as exc:  # numpy, zip, ONNX Runtime and tokenizers errors alike: the file is refused
        raise BundleError(f"{path}: cannot load score fusion {params.model} / {params.file} ({exc})") from None
    if (fusion.lexicon is not None) != (params.lexical is not None):
        raise BundleError(f"{path}: the manifest lists fusion features {params.features}, its file {fusion.features}")
    return fusion


def lexicon_width(path: Path, manifest: Manifest) -> int:
    """The number of terms of a lexical fusion's term space: the length of the idf in its file
    (read alone, without the tokenizer a :class:`~service.engine.lexical.Lexicon` loads)."""
    file = path / manifest.fusion.file
    try:
        with np.load(file, allow_pickle=False) as npz:
            return len(npz["idf"])
    except (KeyError, OSError, ValueError) as exc:
        raise BundleError(f"{file}: a lexical fusion's file without a readable idf ({exc})") from None


def load_shard_key_terms(path: Path, manifest: Manifest, number: int) -> KeyTerms | None:
    """Shard ``number``'s key term vectors, for a lexical fusion (None without one), as wide as
    the fusion's term space."""
    if manifest.fusion is None or manifest.fusion.lexical is None:
        return None
    shard, name = shard_list(manifest)[number], manifest.fusion.lexical[number]
    rows = load_csr(path / name, (shard.keys, lexicon_width(path, manifest)), "key term matrix")
    try:
        return key_terms_of(rows, shard.first_key)
    except ValueError as exc:
        raise BundleError(f"{path / name}: key term matrix refused: {exc}") from None


def load_key_terms_of(path: Path, manifest: Manifest) -> KeyTerms | None:
    """Every key's term vectors (the shards' stacked in key order), for a lexical fusion."""
    parts = [load_shard_key_terms(path, manifest, i) for i in range(len(shard_list(manifest)))]
    if parts[0] is None:
        return None
    return KeyTerms(parts[0].rows if len(parts) == 1 else sp.vstack([part.rows for part in parts], format="csr"))


def check_encoder(path: Path, encoder: OnnxEncoder, manifest: Manifest) -> None:
    """One real encode: the output must be finite, unit-norm and of the manifest's dimension."""
    vectors, _ = encoder.encode(["warm-up query", "a second, longer warm-up query for padding"])
    if vectors.shape != (2, manifest.dim):
        raise BundleError(f"{path / ENCODER_FILE}: output shape {vectors.shape}, expected (2, {manifest.dim})")
    norms = np.linalg.norm(vectors, axis=1)
    if not np.all(np.isfinite(vectors)) or not np.allclose(norms, 1.0, atol=1e-3):
        raise BundleError(f"{path / ENCODER_FILE}: outputs are not finite unit vectors (norms {norms})")


def open_encoder(path: Path, manifest: Manifest, options: EncoderOptions | None) -> OnnxEncoder:
    """An ONNX Runtime session over the bundle's encoder and its tokenizer."""
    try:
        return OnnxEncoder(path / ENCODER_FILE, path / TOKENIZER_FILE, manifest.tokenizer.max_length, options)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise BundleError(f"{path}: cannot load encoder or tokenizer ({exc})") from None


def load_bundle(path: Path | str, options: EncoderOptions | None = None, verify: bool = True) -> Bundle:
    """Load and verify a bundle; raises :class:`BundleError` with the reason on any problem."""
    return _refusing(path, lambda path: _read_bundle(path, options, verify))


def _refusing(path: Path | str, load):
    """``load(resolved path)``, any failure a :class:`BundleError` (unreadable files, malformed
    arrays, …: refused, never a crash); running out of memory is the machine's failure, not the
    bundle's, and stays a :class:`MemoryError` (a vetting child reports it as such)."""
    path = Path(path).resolve()
    try:
        return load(path)
    except (BundleError, MemoryError):
        raise
    except Exception as exc:
        raise BundleError(f"{path}: cannot load bundle ({type(exc).__name__}: {exc})") from None


# The parts of a bundle that the processes of a distributed deployment load apart, each checking
# the checksums of the files it reads.


def load_encoder(
    path: Path | str, options: EncoderOptions | None = None, verify: bool = True
) -> tuple[Manifest, OnnxEncoder]:
    """The manifest and the bundle's encoder and tokenizer alone, checked by one real encode."""

    def load(path: Path) -> tuple[Manifest, OnnxEncoder]:
        manifest = read_manifest(path)
        if verify:
            verify_checksums(path, manifest, [ENCODER_FILE, TOKENIZER_FILE])
        encoder = open_encoder(path, manifest, options)
        check_encoder(path, encoder, manifest)
        return manifest, encoder

    return _refusing(path, load)


def load_labels(path: Path | str, verify: bool = True) -> tuple[Manifest, StringColumn, StringColumn, UidLookup]:
    """The manifest, the label uids and texts (index = label id) and the uid → id lookup (the
    bundle's own for label arrays: made at 10^8 labels, it would cost minutes and gigabytes)."""

    def load(path: Path) -> tuple[Manifest, StringColumn, StringColumn, UidLookup]:
        manifest = read_manifest(path)
        if verify:
            verify_checksums(path, manifest, label_files(manifest.labels_format))
        uids, texts, lookup = read_labels(path, manifest)
        if manifest.index_kind == "rae_memory":
            check_rae_counts(path, manifest)
        return manifest, uids, texts, lookup

    return _refusing(path, load)


def load_shard(
    path: Path | str, number: int, verify: bool = True, search_threads: int = 1
) -> tuple[Manifest, ShardSearcher]:
    """The manifest and shard ``number`` of a bundle alone (an unsharded bundle is shard 0 of 1):
    its index, for an RAE memory its value rows, and for a lexical fusion its keys' term vectors."""

    def load(path: Path) -> tuple[Manifest, ShardSearcher]:
        manifest = read_manifest(path)
        shards = shard_list(manifest)
        if not 0 <= number < len(shards):
            raise BundleError(f"{path}: no shard {number}; the bundle has {len(shards)}")
        shard = shards[number]
        lexical = manifest.fusion.lexical[number] if manifest.fusion and manifest.fusion.lexical else None
        if verify:
            verify_checksums(path, manifest, [n for n in (shard.index, shard.values, shard.rerank, lexical) if n])
        values = None
        if manifest.index_kind == "rae_memory":
            check_rae_counts(path, manifest)
            values = load_shard_values(path, manifest, shard)
        index = load_shard_index(path, manifest, shard)
        key_terms = load_shard_key_terms(path, manifest, number)
        return manifest, ShardSearcher(index, values, shard, search_threads, key_terms)

    return _refusing(path, load)


def _read_bundle(path: Path, options: EncoderOptions | None, verify: bool) -> Bundle:
    manifest = read_manifest(path)
    if verify:
        verify_checksums(path, manifest)
    label_uids, label_texts, uid_lookup = read_labels(path, manifest)
    index = load_index(path, manifest)
    values = load_values(path, manifest)
    fusion = load_fusion(path, manifest, verify=False)  # its checksum is among those verified above
    key_terms = load_key_terms_of(path, manifest)
    encoder = open_encoder(path, manifest, options)
    check_encoder(path, encoder, manifest)
    log.info(
        "loaded bundle %s from %s (%s, %d labels)",
        manifest.bundle_id,
        path,
        manifest.index_kind,
        manifest.counts.labels,
    )
    return Bundle(
        path=path,
        manifest=manifest,
        encoder=encoder,
        index=index,
        label_uids=label_uids,
        label_texts=label_texts,
        uid_lookup=uid_lookup,
        values=values,
        fusion=fusion,
        key_terms=key_terms,
    )
