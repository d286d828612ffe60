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
* A sharded bundle (``manifest.shards``) loads as one :class:`~service.engine.shards.ShardedIndex`:
  every shard searched, the per-shard top-n merged exactly; nothing else changes.

Everything is thread-safe for concurrent ``predict`` calls on one predictor.
"""

from service.engine.append_log import AppendLog, AppendLogError, AppendLogHeld, appends_dir_beside
from service.engine.batcher import BatchAnswer, BatcherConfig, BatcherStoppedError, MicroBatcher, QueueFullError
from service.engine.bundle import Bundle, BundleError, load_bundle
from service.engine.encoder import EncoderOptions, OnnxEncoder
from service.engine.loading import load_predictor, vet_in_child
from service.engine.memory import (
    AppendBatch,
    AppendIdReused,
    AppendOutcome,
    AppendRefused,
    LineageDiverged,
    MemoryView,
)
from service.engine.search import Prediction, Predictor, Ranking, StageTimes

__all__ = [
    "AppendBatch",
    "AppendIdReused",
    "AppendLog",
    "AppendLogError",
    "AppendLogHeld",
    "AppendOutcome",
    "AppendRefused",
    "LineageDiverged",
    "MemoryView",
    "appends_dir_beside",
    "BatchAnswer",
    "BatcherConfig",
    "BatcherStoppedError",
    "Bundle",
    "BundleError",
    "EncoderOptions",
    "MicroBatcher",
    "OnnxEncoder",
    "Prediction",
    "Predictor",
    "QueueFullError",
    "Ranking",
    "StageTimes",
    "load_bundle",
    "load_predictor",
    "vet_in_child",
]
