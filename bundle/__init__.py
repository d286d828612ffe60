"""The bundle contract: what a bundle directory holds and how each of its files is checked.

``export/`` writes bundles, ``service/`` reads them, ``training/`` and ``bench/`` build and inspect
their parts; all of them take the format from here. Nothing in this package knows HTTP, batching,
encoders or index runtimes (ONNX Runtime, hnswlib, faiss): it is numpy, scipy and pydantic over
files, and imports nothing of ``service``, ``export`` or ``training``. The public surface:

* The manifest (:mod:`bundle.manifest`): the schema (:class:`Manifest` and its parts), the file
  names, :func:`sha256_file`, :func:`content_id`, and the file lists a manifest implies
  (:func:`required_files`, :func:`label_files`, :func:`shard_list`, …).
* The card (:mod:`bundle.card`): :class:`Card` (``card.json``, what made the bundle and how good
  it is, with its ``README.md``), read back checked by :func:`read_card`; outside the bundle id.
* The directory (:mod:`bundle.directory`): :func:`read_manifest`, every file name kept inside the
  directory (:func:`check_confined`), the checksums (:func:`verify_checksums`). Any refusal is a
  :class:`BundleError` (:mod:`bundle.errors`) naming the file and the reason.
* The labels (:mod:`bundle.labels`): uids and texts as memory-mapped arrays (:class:`StringColumn`),
  the uid → id lookup (:class:`UidLookup`), unique uids (:func:`check_unique_uids`); written by
  :func:`write_label_arrays`, read back checked by :func:`read_labels`.
* The value rows of an RAE memory (:mod:`bundle.values`): :func:`build_values` and their CSR files
  read back checked (:func:`load_values`, :func:`load_shard_values`; :func:`load_csr`,
  :mod:`bundle.csr_file`, checks any CSR file of a bundle; :func:`npz_headers`, an npz's members'
  shapes and dtypes read before any is inflated).
* The index files, checked before a native library reads them: hnswlib's
  (:mod:`bundle.hnsw_file`) and faiss IVF-PQ fast-scan's with its re-rank vectors
  (:mod:`bundle.ivfpq_file`).

Outside the package, code imports these names from ``bundle`` itself, never its submodules
(``tests/bundle/test_surface.py``).
"""

from bundle.card import CARD_FILE, CARD_FILES, CARD_README_FILE, MAX_CARD_BYTES, Card, Figures, read_card, render_readme
from bundle.csr_file import load_csr, npz_headers
from bundle.directory import check_confined, read_manifest, verify_checksums
from bundle.errors import BundleError, XmcserveError
from bundle.hnsw_file import HnswFileRefused, check_index_body, check_index_header
from bundle.ivfpq_file import (
    FAST_SCAN_BLOCK,
    PQ_BITS,
    IndexRefused,
    check_index_file,
    empty_lists_size,
    load_rerank_vectors,
)
from bundle.labels import (
    DuplicateUids,
    LabelsRefused,
    StringColumn,
    UidLookup,
    check_unique_uids,
    load_label_arrays,
    read_labels,
    write_label_arrays,
)
from bundle.manifest import (
    ENCODER_FILE,
    FUSION_FILE,
    FUSION_MODEL_FILE,
    INDEX_FILE,
    IVF_INDEX_FILE,
    LABEL_ARRAY_FILES,
    LABELS_FILE,
    LEXICAL_FILE,
    MANIFEST_FILE,
    RERANK_FILE,
    SCHEMA_VERSION,
    SPARSE_FILE,
    TOKENIZER_FILE,
    VALUES_FILE,
    AnnKind,
    Counts,
    FusionModelKind,
    FusionParams,
    FusionSizeChoice,
    HnswParams,
    IndexKind,
    IvfPqParams,
    LabelKeysParams,
    LabelsFormat,
    Lineage,
    Manifest,
    RaeMode,
    RaeParams,
    Shard,
    SourceInfo,
    SparseFitKind,
    SparseRankerParams,
    TokenizerInfo,
    content_id,
    label_files,
    lexical_file_names,
    required_files,
    sha256_file,
    shard_file_names,
    shard_list,
    utc_now,
)
from bundle.values import build_values, check_rae_counts, load_shard_values, load_values

__all__ = [
    "CARD_FILE",
    "CARD_FILES",
    "CARD_README_FILE",
    "MAX_CARD_BYTES",
    "Card",
    "Figures",
    "read_card",
    "render_readme",
    "AnnKind",
    "build_values",
    "BundleError",
    "XmcserveError",
    "check_confined",
    "check_index_body",
    "check_index_file",
    "check_index_header",
    "check_rae_counts",
    "check_unique_uids",
    "content_id",
    "Counts",
    "DuplicateUids",
    "empty_lists_size",
    "ENCODER_FILE",
    "FAST_SCAN_BLOCK",
    "FUSION_FILE",
    "FUSION_MODEL_FILE",
    "FusionModelKind",
    "FusionParams",
    "HnswFileRefused",
    "HnswParams",
    "INDEX_FILE",
    "IndexKind",
    "IndexRefused",
    "IVF_INDEX_FILE",
    "IvfPqParams",
    "LABEL_ARRAY_FILES",
    "label_files",
    "LABELS_FILE",
    "LabelsFormat",
    "LabelsRefused",
    "LEXICAL_FILE",
    "lexical_file_names",
    "Lineage",
    "load_csr",
    "npz_headers",
    "load_label_arrays",
    "load_rerank_vectors",
    "load_shard_values",
    "load_values",
    "Manifest",
    "MANIFEST_FILE",
    "PQ_BITS",
    "RaeMode",
    "RaeParams",
    "read_labels",
    "read_manifest",
    "required_files",
    "RERANK_FILE",
    "SCHEMA_VERSION",
    "sha256_file",
    "Shard",
    "shard_file_names",
    "shard_list",
    "SourceInfo",
    "SPARSE_FILE",
    "SparseFitKind",
    "SparseRankerParams",
    "LabelKeysParams",
    "FusionSizeChoice",
    "StringColumn",
    "TOKENIZER_FILE",
    "TokenizerInfo",
    "UidLookup",
    "utc_now",
    "VALUES_FILE",
    "verify_checksums",
    "write_label_arrays",
]
