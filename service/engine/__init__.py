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
* :class:`XmcserveError` — the base of every exception the engine raises (:class:`BundleError`,
  :class:`AppendRefused`, :class:`AppendLogError`, :class:`QueueFullError`, …); each keeps the
  builtin base (``ValueError``, ``RuntimeError``) it was caught by before.
* :class:`KeyIndex` — the key index a bundle searches (``Bundle.index``): :class:`HnswIndex`,
  :class:`IvfPqIndex` (``ann`` ivfpq) or, for a sharded bundle (``manifest.shards``), one
  :class:`ShardedIndex` over its shards (every shard searched, the per-shard top-n merged
  exactly); the search breadth is an argument of each ``search``.

* :func:`rank_batch` — the one ranking of a batch's fetched nearest keys (:class:`Neighbours`, as
  many as :func:`neighbours_needed` says) into each query's top-k labels (a list of
  :class:`Ranking`), which :class:`Predictor` and the Ray ingress call;
  :func:`fusion_candidates` computes alike the score fusion's candidates and φ
  (:class:`FusionRows`), which ``export.fuse`` fits a fusion on.
* What export writes and bench inspects beyond the bundle format (which is :mod:`bundle`'s: the
  manifest, the file names, checksums, label arrays, RAE value rows, the index files' checks):
  the score fusion (:class:`ScoreFusion`, its models and feature groups), the lexical terms
  (:class:`Lexicon`, :class:`KeyTerms`) and the parts a distributed deployment loads apart
  (:func:`load_labels`, :func:`load_shard`, :func:`merge_answers`); :class:`BundleError`, what
  every loader here refuses a bundle with, is :mod:`bundle`'s too. Nothing outside
  ``service/engine`` imports its submodules (``tests/service/test_engine_surface.py``).

Everything is thread-safe for concurrent ``predict`` calls on one predictor.
"""

from bundle import BundleError, XmcserveError
from service.engine.append_log import (
    AppendLog,
    AppendLogError,
    AppendLogHeld,
    appends_dir_beside,
    lineage_log_path,
    sync_directory,
)
from service.engine.batcher import BatchAnswer, BatcherConfig, BatcherStoppedError, MicroBatcher, QueueFullError
from service.engine.bundle import Bundle, load_bundle, load_encoder, load_labels, load_shard, load_shard_index
from service.engine.encoder import MAX_CHUNK, EncoderOptions, OnnxEncoder
from service.engine.fusion import (
    FEATURE_GROUPS,
    OPTIONAL_GROUPS,
    OnnxTreeEnsemble,
    ScoreFusion,
    features_of_groups,
    memory_log_frequency,
)
from service.engine.index import HnswIndex, IvfPqIndex, KeyIndex, ShardedIndex, empty_index, exact_rerank, faiss_threads
from service.engine.lexical import KeyTerms, Lexicon, save_key_terms
from service.engine.loading import SOURCE_LOGS, carried_lineage, load_for_reading, load_predictor, vet_in_child
from service.engine.memory import (
    AppendBatch,
    AppendIdReused,
    AppendOutcome,
    AppendRefused,
    LineageDiverged,
    MemoryView,
    fetch_and_ef,
)
from service.engine.search import (
    FusionRows,
    Neighbours,
    Prediction,
    Predictor,
    Ranking,
    StageTimes,
    fusion_candidates,
    neighbours_needed,
    rank_batch,
)
from service.engine.shards import merge_answers

__all__ = [
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
    "Bundle",
    "BundleError",
    "carried_lineage",
    "empty_index",
    "EncoderOptions",
    "XmcserveError",
    "exact_rerank",
    "faiss_threads",
    "FEATURE_GROUPS",
    "features_of_groups",
    "fetch_and_ef",
    "fusion_candidates",
    "FusionRows",
    "HnswIndex",
    "IvfPqIndex",
    "KeyIndex",
    "KeyTerms",
    "Lexicon",
    "lineage_log_path",
    "LineageDiverged",
    "load_bundle",
    "load_encoder",
    "load_for_reading",
    "load_labels",
    "load_predictor",
    "load_shard",
    "load_shard_index",
    "MAX_CHUNK",
    "memory_log_frequency",
    "MemoryView",
    "merge_answers",
    "MicroBatcher",
    "Neighbours",
    "neighbours_needed",
    "OnnxEncoder",
    "OnnxTreeEnsemble",
    "OPTIONAL_GROUPS",
    "Prediction",
    "Predictor",
    "QueueFullError",
    "rank_batch",
    "Ranking",
    "save_key_terms",
    "ScoreFusion",
    "ShardedIndex",
    "SOURCE_LOGS",
    "StageTimes",
    "sync_directory",
    "vet_in_child",
]
