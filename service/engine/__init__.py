"""The serving engine: bundle → encoder → search → RAE aggregation, and the micro-batcher.

A library with no HTTP in it; the uvicorn app (:mod:`service.http`) is one front end over it.
The public surface:

* :func:`load_predictor` — open a bundle directory, verify it (checksums, shapes, a warm-up
  prediction) and return a :class:`Predictor`; :func:`load_bundle` without the warm-up.
* :class:`Predictor` — ``predict(texts, k, ef, exclude)`` (``encode(texts)`` + search) and
  ``search(vectors, k, ef, exclude, view, texts)`` (search only; a bundle whose score fusion is
  lexical, :mod:`service.engine.lexical`, needs the texts too), both returning a :class:`Prediction`:
  one :class:`Ranking` (label ids and scores, best first) per text, the :class:`StageTimes`,
  and the HNSW ef the search ran at. ``exclude`` holds label *ids* per text;
  ``predictor.view.label_ids(uids)`` maps uids to ids, and ``prediction.view.label_uids[id]``
  ids back to uids.
* ``Predictor.append(AppendBatch)`` — new labels and training instances into the live memory
  (:mod:`service.engine.memory`): encoded, logged to the bundle's :class:`AppendLog`
  (:mod:`service.engine.append_log`) when
  ``load_predictor(..., appends_dir=...)`` gave one, and published atomically; a
  :class:`MemoryView` is one consistent state of it. :class:`AppendRefused`: bad input.
* :class:`MicroBatcher` — an asyncio queue of requests (``submit(texts, k, ef, exclude_uids)``)
  batched onto one predictor per batch and run in two overlapped stages (an encode thread, a
  search thread: the encoder never waits for the previous batch's search), bounded
  (:class:`QueueFullError`), stoppable (:class:`BatcherStoppedError`); configured by
  :class:`BatcherConfig`.
* :class:`EncoderOptions` — how the ONNX encoder runs (provider, threads, spinning).
* :class:`KeyIndex` — the key index a bundle searches (``Bundle.index``): :class:`HnswIndex`,
  :class:`IvfPqIndex` (``ann`` ivfpq) or, for a sharded bundle (``manifest.shards``), one
  :class:`ShardedIndex` over its shards (every shard searched, the per-shard top-n merged
  exactly); the search breadth is an argument of each ``search``.

* :func:`rank_batch` — the one ranking of a batch's fetched nearest keys (:class:`Neighbours`) into
  each query's top-k labels, which :class:`Predictor` and the Ray ingress call; with
  ``feature_rows=True`` it returns instead the score fusion's candidates and φ (:class:`FusionRows`),
  which ``export.fuse`` fits a fusion on.
* What export writes and bench inspects: the bundle format (:class:`Manifest` and its parts, the
  file names, :func:`sha256_file`, :func:`content_id`), the score fusion (:class:`ScoreFusion`, its
  models and feature groups), the lexical terms (:class:`Lexicon`, :class:`KeyTerms`), the RAE
  values (:func:`build_values`) and the parts a distributed deployment loads apart
  (:func:`load_labels`, :func:`load_shard`, :func:`merge_answers`). Nothing outside
  ``service/engine`` imports its submodules (``tests/service/test_engine_surface.py``).

Everything is thread-safe for concurrent ``predict`` calls on one predictor.
"""

from service.engine.append_log import (
    AppendLog,
    AppendLogError,
    AppendLogHeld,
    appends_dir_beside,
    lineage_log_path,
    sync_directory,
)
from service.engine.batcher import BatchAnswer, BatcherConfig, BatcherStoppedError, MicroBatcher, QueueFullError
from service.engine.bundle import (
    Bundle,
    BundleError,
    load_bundle,
    load_encoder,
    load_labels,
    load_shard,
    load_shard_index,
    read_manifest,
)
from service.engine.encoder import MAX_CHUNK, EncoderOptions, OnnxEncoder
from service.engine.fusion import (
    FEATURE_GROUPS,
    OPTIONAL_GROUPS,
    OnnxTreeEnsemble,
    ScoreFusion,
    features_of_groups,
    memory_log_frequency,
)
from service.engine.index import HnswIndex, IvfPqIndex, KeyIndex, ShardedIndex, exact_rerank, faiss_threads
from service.engine.ivfpq import empty_index
from service.engine.labels import check_unique_uids, write_label_arrays
from service.engine.lexical import KeyTerms, Lexicon, save_key_terms
from service.engine.loading import SOURCE_LOGS, carried_lineage, load_for_reading, load_predictor, vet_in_child
from service.engine.manifest import (
    ENCODER_FILE,
    FUSION_MODEL_FILE,
    INDEX_FILE,
    LABELS_FILE,
    MANIFEST_FILE,
    TOKENIZER_FILE,
    VALUES_FILE,
    AnnKind,
    Counts,
    FusionModelKind,
    FusionParams,
    HnswParams,
    IndexKind,
    IvfPqParams,
    LabelsFormat,
    Lineage,
    Manifest,
    RaeMode,
    RaeParams,
    Shard,
    SourceInfo,
    TokenizerInfo,
    content_id,
    label_files,
    lexical_file_names,
    sha256_file,
    shard_file_names,
    shard_list,
    utc_now,
)
from service.engine.memory import (
    AppendBatch,
    AppendIdReused,
    AppendOutcome,
    AppendRefused,
    LineageDiverged,
    MemoryView,
    fetch_and_ef,
)
from service.engine.rae import build_values
from service.engine.search import FusionRows, Neighbours, Prediction, Predictor, Ranking, StageTimes, rank_batch
from service.engine.shards import merge_answers

__all__ = [
    "AnnKind",
    "AppendBatch",
    "AppendIdReused",
    "AppendLog",
    "AppendLogError",
    "AppendLogHeld",
    "AppendOutcome",
    "AppendRefused",
    "appends_dir_beside",
    "BatchAnswer",
    "BatcherConfig",
    "BatcherStoppedError",
    "build_values",
    "check_unique_uids",
    "Bundle",
    "BundleError",
    "carried_lineage",
    "content_id",
    "Counts",
    "empty_index",
    "ENCODER_FILE",
    "EncoderOptions",
    "exact_rerank",
    "faiss_threads",
    "FEATURE_GROUPS",
    "features_of_groups",
    "fetch_and_ef",
    "FUSION_MODEL_FILE",
    "FusionModelKind",
    "FusionParams",
    "FusionRows",
    "HnswIndex",
    "HnswParams",
    "INDEX_FILE",
    "IndexKind",
    "IvfPqIndex",
    "IvfPqParams",
    "KeyIndex",
    "KeyTerms",
    "label_files",
    "LABELS_FILE",
    "LabelsFormat",
    "lexical_file_names",
    "Lexicon",
    "Lineage",
    "lineage_log_path",
    "LineageDiverged",
    "load_bundle",
    "load_encoder",
    "load_for_reading",
    "load_labels",
    "load_predictor",
    "load_shard",
    "load_shard_index",
    "Manifest",
    "MANIFEST_FILE",
    "MAX_CHUNK",
    "memory_log_frequency",
    "MemoryView",
    "merge_answers",
    "MicroBatcher",
    "Neighbours",
    "OnnxEncoder",
    "OnnxTreeEnsemble",
    "OPTIONAL_GROUPS",
    "Prediction",
    "Predictor",
    "QueueFullError",
    "RaeMode",
    "RaeParams",
    "rank_batch",
    "Ranking",
    "read_manifest",
    "save_key_terms",
    "ScoreFusion",
    "sha256_file",
    "Shard",
    "ShardedIndex",
    "shard_file_names",
    "shard_list",
    "SOURCE_LOGS",
    "SourceInfo",
    "StageTimes",
    "sync_directory",
    "TOKENIZER_FILE",
    "TokenizerInfo",
    "utc_now",
    "VALUES_FILE",
    "vet_in_child",
    "write_label_arrays",
]
