"""Load a bundle directory and verify it (checksums, shapes, a warm-up encode) before use."""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import hnswlib
import numpy as np
import scipy.sparse as sp
from pydantic import ValidationError

from service.engine.encoder import EncoderOptions, OnnxEncoder
from service.engine.fusion import FEATURE_GROUPS, ScoreFusion, groups_of
from service.engine.lexical import KeyTerms, load_key_terms
from service.engine.manifest import (
    ENCODER_FILE,
    LABELS_FILE,
    MANIFEST_FILE,
    SCHEMA_VERSION,
    TOKENIZER_FILE,
    Manifest,
    Shard,
    required_files,
    sha256_file,
    shard_list,
)
from service.engine.shards import ShardedIndex, ShardSearcher

log = logging.getLogger(__name__)


class BundleError(RuntimeError):
    """The bundle is missing, corrupt or inconsistent; the message says which part."""


@dataclass
class Bundle:
    path: Path
    manifest: Manifest
    encoder: OnnxEncoder
    index: hnswlib.Index | ShardedIndex
    label_uids: list[str]
    label_texts: list[str]
    values: sp.csr_matrix | None
    fusion: ScoreFusion | None = None
    key_terms: KeyTerms | None = None  # the keys' term vectors, for a lexical fusion

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


def read_labels(path: Path, manifest: Manifest) -> tuple[list[str], list[str]]:
    """Label uids and texts, as many as the manifest counts."""
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
    return uids, texts


# hnswlib's saveIndex header (hnswalg.h): offsetLevel0, max_elements, cur_element_count,
# size_data_per_element, label_offset, offsetData (size_t), maxlevel (int), enterpoint (uint32),
# maxM, maxM0, M (size_t), mult (double), ef_construction (size_t).
HNSW_HEADER = struct.Struct("<QQQQQQiIQQQdQ")
# Room an index file may declare beyond its keys (hnswlib allocates max_elements up front).
HNSW_GROWTH_ALLOWANCE = 2


def check_index_header(file: Path, manifest: Manifest, keys: int) -> None:
    """The HNSW file's header against the manifest, before hnswlib allocates what the header
    asks for: a file whose checksums match but whose header claims 2^27 elements would make
    hnswlib allocate gigabytes inside the serving process."""
    size = file.stat().st_size if file.is_file() else 0
    if size < HNSW_HEADER.size:
        raise BundleError(f"{file}: {size} bytes, shorter than an HNSW header")
    with file.open("rb") as f:
        (_, max_elements, count, per_element, label_offset, data_offset, max_level, entry, max_m, max_m0, m, _, _) = (
            HNSW_HEADER.unpack(f.read(HNSW_HEADER.size))
        )
    dim, expected_m = manifest.dim, manifest.hnsw.M
    links = max_m0 * 4 + 4  # level-0 neighbour ids (uint32) and their count
    problems = [
        (count != keys, f"holds {count} keys, manifest says {keys}"),
        (max_elements > HNSW_GROWTH_ALLOWANCE * keys, f"declares room for {max_elements} elements for {keys} keys"),
        ((m, max_m, max_m0) != (expected_m, expected_m, 2 * expected_m), f"M {m}/{max_m}/{max_m0}, not {expected_m}"),
        (data_offset != links or label_offset != links + 4 * dim, f"element layout is not {dim}-d float32"),
        (per_element != links + 4 * dim + 8, f"{per_element} bytes per element, expected {links + 4 * dim + 8}"),
        (max_level < 0 or (count and entry >= count), "entry point or top level out of range"),
        (size < HNSW_HEADER.size + count * (per_element + 4), f"{size} bytes, too short for {count} elements"),
    ]
    for failed, problem in problems:
        if failed:
            raise BundleError(f"{file}: HNSW header refused: {problem}")


def load_shard_index(path: Path, manifest: Manifest, shard: Shard) -> hnswlib.Index:
    """One shard's HNSW index, its header checked before hnswlib allocates, its key ids checked
    against the shard's range."""
    file = path / shard.index
    check_index_header(file, manifest, shard.keys)
    index = hnswlib.Index(space=manifest.hnsw.space, dim=manifest.dim)
    try:
        index.load_index(str(file))
    except RuntimeError as exc:
        raise BundleError(f"{file}: cannot load HNSW index ({exc})") from None
    expected_ids = shard.first_key + np.arange(shard.keys)
    if manifest.shards and not np.array_equal(np.sort(index.get_ids_list()), expected_ids):
        raise BundleError(f"{file}: its key ids are not {shard.first_key}..{shard.first_key + shard.keys - 1}")
    index.set_ef(manifest.hnsw.ef_search)
    return index


def load_index(path: Path, manifest: Manifest) -> hnswlib.Index | ShardedIndex:
    """The bundle's HNSW index; a sharded bundle's shards behind one :class:`ShardedIndex`."""
    indexes = [load_shard_index(path, manifest, shard) for shard in shard_list(manifest)]
    return indexes[0] if len(indexes) == 1 else ShardedIndex(indexes)


def load_shard_values(path: Path, manifest: Manifest, shard: Shard) -> sp.csr_matrix:
    """One shard's rows of V, (its keys x labels)."""
    try:
        values = sp.load_npz(path / shard.values).tocsr().astype(np.float32)
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path / shard.values}: cannot load value matrix ({exc})") from None
    expected = (shard.keys, manifest.counts.labels)
    if values.shape != expected:
        raise BundleError(f"{path / shard.values}: value matrix shape {values.shape}, expected {expected}")
    return values


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
    session (an old bundle's single tree, as arrays), checked for shape."""
    if manifest.fusion is None:
        return None
    params = manifest.fusion
    try:
        groups_of(params.features)
    except ValueError as exc:
        raise BundleError(f"{path}: {exc}; this service computes {list(FEATURE_GROUPS)}") from None
    if verify:
        verify_checksums(path, manifest, [params.file, *([params.model] if params.model else []), TOKENIZER_FILE])
    try:
        fusion = ScoreFusion.load(
            path, params, manifest.counts.labels, (path / TOKENIZER_FILE, manifest.tokenizer.max_length)
        )
    except Exception as exc:  # numpy, zip, ONNX Runtime and tokenizers errors alike: the file is refused
        names = " / ".join(name for name in (params.model, params.file) if name)
        raise BundleError(f"{path}: cannot load score fusion {names} ({exc})") from None
    if (fusion.lexicon is not None) != (params.lexical is not None):
        raise BundleError(f"{path}: the manifest lists fusion features {params.features}, its file {fusion.features}")
    return fusion


def load_shard_key_terms(path: Path, manifest: Manifest, number: int) -> KeyTerms | None:
    """Shard ``number``'s key term vectors, for a lexical fusion (None without one)."""
    if manifest.fusion is None or manifest.fusion.lexical is None:
        return None
    shard, name = shard_list(manifest)[number], manifest.fusion.lexical[number]
    try:
        return load_key_terms(path / name, shard.keys, shard.first_key)
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path / name}: cannot load key terms ({exc})") from None


def load_key_terms_of(path: Path, manifest: Manifest, fusion: ScoreFusion | None) -> KeyTerms | None:
    """Every key's term vectors (the shards' stacked in key order), for a lexical fusion, over
    the fusion's term space."""
    parts = [load_shard_key_terms(path, manifest, i) for i in range(len(shard_list(manifest)))]
    if parts[0] is None:
        return None
    rows = parts[0].rows if len(parts) == 1 else sp.vstack([part.rows for part in parts], format="csr")
    terms = len(fusion.lexicon.idf)
    if rows.shape[1] != terms:
        raise BundleError(f"{path}: key terms over {rows.shape[1]} terms, the fusion's lexicon has {terms}")
    return KeyTerms(rows)


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
    return _refusing(path, lambda path: _load_bundle(path, options, verify))


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


def load_labels(path: Path | str, verify: bool = True) -> tuple[Manifest, list[str], list[str]]:
    """The manifest and the label uids and texts (line number = label id)."""

    def load(path: Path) -> tuple[Manifest, list[str], list[str]]:
        manifest = read_manifest(path)
        if verify:
            verify_checksums(path, manifest, [LABELS_FILE])
        uids, texts = read_labels(path, manifest)
        if manifest.index_kind == "rae_memory":
            check_rae_counts(path, manifest)
        return manifest, uids, texts

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
            verify_checksums(path, manifest, [name for name in (shard.index, shard.values, lexical) if name])
        values = None
        if manifest.index_kind == "rae_memory":
            check_rae_counts(path, manifest)
            values = load_shard_values(path, manifest, shard)
        index = load_shard_index(path, manifest, shard)
        key_terms = load_shard_key_terms(path, manifest, number)
        return manifest, ShardSearcher(index, values, shard, search_threads, key_terms)

    return _refusing(path, load)


def _load_bundle(path: Path, options: EncoderOptions | None, verify: bool) -> Bundle:
    manifest = read_manifest(path)
    if verify:
        verify_checksums(path, manifest)
    label_uids, label_texts = read_labels(path, manifest)
    index = load_index(path, manifest)
    values = load_values(path, manifest)
    fusion = load_fusion(path, manifest, verify=False)  # its checksum is among those verified above
    key_terms = load_key_terms_of(path, manifest, fusion)
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
        values=values,
        fusion=fusion,
        key_terms=key_terms,
    )
