"""Load a bundle directory into what serves it: the encoder (ONNX, or the null encoder a
benchmark asks for: ``EncoderOptions.backend``), the index (hnswlib, faiss IVF-PQ,
or shards of either), the label arrays, the RAE value rows, the score fusion; verified (checksums,
shapes, a warm-up encode) before use.

The bundle format and the checks of each file are :mod:`bundle`'s (the manifest, confinement and
checksums, the label arrays, the CSR value rows, the HNSW and IVF-PQ files): checksums say a file
is the one the exporter wrote, not that the exporter wrote a sound one, so every array a search
reads by index is checked before it is used. A bundle that fails is refused with the file and the
reason (:class:`~bundle.BundleError`). Servers vet a bundle in a child process
(:func:`~engine.search.vet_in_child`), so these checks run there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bundle import (
    ENCODER_FILE,
    TOKENIZER_FILE,
    BundleError,
    Card,
    HnswFileRefused,
    IndexRefused,
    Manifest,
    Shard,
    StringColumn,
    UidLookup,
    check_rae_counts,
    label_files,
    load_csr,
    load_shard_values,
    load_values,
    read_card,
    read_labels,
    read_manifest,
    shard_list,
    verify_checksums,
)
from engine.encoder import Encoder, EncoderOptions, OnnxEncoder
from engine.fusion import FEATURE_GROUPS, ScoreFusion, groups_of
from engine.index import HnswIndex, IvfPqIndex, KeyIndex, ShardedIndex
from engine.lexical import KeyTerms, key_terms_of
from engine.null_encoder import NullEncoder
from engine.shards import ShardSearcher

log = logging.getLogger(__name__)


@dataclass
class Bundle:
    path: Path
    manifest: Manifest
    encoder: Encoder
    index: KeyIndex
    label_uids: StringColumn
    label_texts: StringColumn
    values: sp.csr_matrix | None
    fusion: ScoreFusion | None = None
    key_terms: KeyTerms | None = None  # the keys' term vectors, for a lexical fusion
    uid_lookup: UidLookup | None = None  # uid → label id (None: made from label_uids)
    card: Card | None = None  # what made it and how good it is (None: a bundle from before cards)

    @property
    def bundle_id(self) -> str:
        return self.manifest.bundle_id


def load_shard_index(path: Path, manifest: Manifest, shard: Shard) -> HnswIndex | IvfPqIndex:
    """One shard's key index, loaded by its kind's class after its files' checks (an HNSW file's
    header and body before hnswlib reads it; a compressed index's inverted lists and re-rank
    vectors before faiss does): a refusal is the bundle's error."""
    file = path / shard.index
    if manifest.ann == "ivfpq":
        try:
            return IvfPqIndex.load(file, path / shard.rerank, manifest.dim, manifest.ivfpq, shard.first_key, shard.keys)
        except IndexRefused as exc:
            raise BundleError(f"{file}: IVF-PQ index refused: {exc}") from None
    try:
        return HnswIndex.load(file, manifest.dim, manifest.hnsw, shard.first_key, shard.keys)
    except HnswFileRefused as exc:
        raise BundleError(str(exc)) from None
    except RuntimeError as exc:
        raise BundleError(f"{file}: cannot load HNSW index ({exc})") from None


def load_index(path: Path, manifest: Manifest) -> KeyIndex:
    """The bundle's key index; a sharded bundle's shards behind one :class:`ShardedIndex`."""
    indexes = [load_shard_index(path, manifest, shard) for shard in shard_list(manifest)]
    return indexes[0] if len(indexes) == 1 else ShardedIndex(indexes)


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
        sparse = [params.sparse.file] if params.sparse is not None else []
        verify_checksums(path, manifest, [params.file, params.model, TOKENIZER_FILE, *sparse])
    try:
        fusion = ScoreFusion.load(
            path, params, manifest.counts.labels, (path / TOKENIZER_FILE, manifest.tokenizer.max_length)
        )
    except BundleError:
        raise
    except Exception as exc:  # numpy, zip, ONNX Runtime and tokenizers errors alike: the file is refused
        raise BundleError(f"{path}: cannot load score fusion {params.model} / {params.file} ({exc})") from None
    if (fusion.lexicon is not None) != (params.lexical is not None):
        raise BundleError(f"{path}: the manifest lists fusion features {params.features}, its file {fusion.features}")
    return fusion


def lexicon_width(path: Path, manifest: Manifest) -> int:
    """The number of terms of a lexical fusion's term space: the length of the idf in its file
    (read alone, without the tokenizer a :class:`~engine.lexical.Lexicon` loads)."""
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


def check_encoder(path: Path, encoder: Encoder, manifest: Manifest) -> None:
    """One real encode: the output must be finite, unit-norm and of the manifest's dimension."""
    vectors, _ = encoder.encode(["warm-up query", "a second, longer warm-up query for padding"])
    if vectors.shape != (2, manifest.dim):
        raise BundleError(f"{path / ENCODER_FILE}: output shape {vectors.shape}, expected (2, {manifest.dim})")
    norms = np.linalg.norm(vectors, axis=1)
    if not np.all(np.isfinite(vectors)) or not np.allclose(norms, 1.0, atol=1e-3):
        raise BundleError(f"{path / ENCODER_FILE}: outputs are not finite unit vectors (norms {norms})")


def open_encoder(path: Path, manifest: Manifest, options: EncoderOptions | None) -> Encoder:
    """An ONNX Runtime session over the bundle's encoder and its tokenizer; with the ``null``
    backend, the tokenizer and the vector file the options name (:mod:`engine.null_encoder`),
    whose vectors must have the manifest's dimension."""
    options = options or EncoderOptions()
    max_length = manifest.tokenizer.max_length
    try:
        if options.backend == "null":
            return NullEncoder(path / TOKENIZER_FILE, max_length, manifest.dim, options.null_vectors, options)
        return OnnxEncoder(path / ENCODER_FILE, path / TOKENIZER_FILE, max_length, options)
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
) -> tuple[Manifest, Encoder]:
    """The manifest and the bundle's encoder and tokenizer alone, checked by one real encode."""

    def load(path: Path) -> tuple[Manifest, Encoder]:
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
    card = read_card(path, manifest.files)  # its checksum is among those verified above
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
        card=card,
    )
