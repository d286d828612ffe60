"""The serving engine: bundle → encoder → key search → RAE aggregation → score fusion, and the
micro-batcher. A library with no HTTP in it; the uvicorn app (:mod:`service.http`) and the Ray
Serve app (:mod:`service.ray_serve`) are front ends over it.

This package's names are what a front end needs; the front ends and ``training/`` import
nothing else of the engine (``tests/service/test_engine_surface.py``):

* :class:`Engine` — the one object a server front end calls (:mod:`engine.serving`): the A/B
  variants and their batchers, ``predict``, loading with a vetting child, ``reload`` /
  ``promote`` / ``rollback``, the two-step append (``prepare_append``, ``commit_append``) and
  readiness; configured by :class:`EngineParams`, its retries of a held append log by
  :class:`BusyRetry`; it raises :class:`VariantUnavailable`, :class:`CatchUpFailed` and
  :class:`BundleChanged` besides the errors below.
* :func:`load_predictor` — open a bundle directory, verify it (checksums, shapes, a warm-up
  prediction), replay its append log, and return a :class:`Predictor` (in process, with no
  server: what :class:`Engine` loads into each variant).
* :class:`Predictor` — ``predict(texts, k, ef, exclude)`` (encode + search) returning a
  prediction: one :class:`Ranking` (label ids and scores, best first) per text, the stage
  times, the breadth the search ran at. ``exclude`` holds label *ids* per text;
  ``predictor.view.label_ids(uids)`` maps uids to ids.
* ``Predictor.append(AppendBatch)`` — new labels and training instances into the live memory,
  logged (the log directory: :func:`appends_dir_beside` by default) and published atomically;
  its outcome says what was applied; a :class:`MemoryView` is one consistent state
  of the memory; :data:`MAX_LABELS_PER_INSTANCE` bounds an instance's labels;
  ``EngineParams.shared_appends`` makes a process append in turns with the other workers of its
  server (``XMCSERVE_WORKERS``).
* :class:`BatcherConfig` — each variant's micro-batching (:mod:`engine.batcher`: requests
  batched onto one predictor in two overlapped stages, encode and search, bounded and
  stoppable); a :class:`BatchAnswer` is one request's share. :class:`EncoderOptions` and
  :func:`thread_layout` say how the ONNX encoder runs (provider, workers, threads), and
  ``EncoderOptions.backend`` whether a benchmark's null encoder (:mod:`engine.null_encoder`:
  the real tokenizer, vectors looked up) stands in for it.
* :class:`XmcserveError` — the one error base (defined by :mod:`bundle`, the lowest layer):
  :class:`BundleError`, :class:`AppendRefused` and :class:`AppendIdReused`,
  :class:`AppendLogError` and :class:`AppendLogHeld`, :class:`LineageDiverged`, :class:`MemoryBusy`,
  :class:`QueueFullError`, :class:`BatcherStoppedError`, :class:`DeadlineExceededError`; each
  keeps the builtin base (``ValueError``, ``RuntimeError``) callers caught it by.
* RAE-XMC's aggregation (:class:`ValueRows`, :func:`aggregate`, :func:`labels_of_keys`,
  :func:`top_k_of_row`), which training's exact-search dev check shares with serving.

Two narrower surfaces serve other users: :mod:`engine.distributed`, the engine of a bundle
sharded across processes as three parts (encoder, shard, coordinator) that a distributed front
end (the Ray Serve deployments) holds one each, and
:mod:`engine.offline`, what building, fusing, compacting and measuring a bundle use
beyond serving (``export/``, ``bench/``); the key index is :mod:`engine.index`. The
bundle format itself is :mod:`bundle`'s.

Everything is thread-safe for concurrent ``predict`` calls on one predictor.
"""

from bundle import BundleError, XmcserveError
from engine.append_log import AppendLogError, AppendLogHeld, appends_dir_beside
from engine.batcher import BatchAnswer, BatcherConfig, BatcherStoppedError, DeadlineExceededError, QueueFullError
from engine.encoder import EncoderOptions, thread_layout
from engine.loading import load_predictor
from engine.memory import (
    MAX_LABELS_PER_INSTANCE,
    AppendBatch,
    AppendIdReused,
    AppendRefused,
    LineageDiverged,
    MemoryBusy,
    MemoryView,
)
from engine.rae import ValueRows, aggregate, labels_of_keys, top_k_of_row
from engine.search import Predictor, Ranking
from engine.serving import BundleChanged, BusyRetry, CatchUpFailed, Engine, EngineParams, VariantUnavailable

__all__ = [
    # the engine a server front end calls
    "Engine",
    "EngineParams",
    "BusyRetry",
    # loading and predicting in process
    "load_predictor",
    "Predictor",
    "Ranking",
    # the live memory
    "AppendBatch",
    "MemoryView",
    "MAX_LABELS_PER_INSTANCE",
    "appends_dir_beside",
    # batching and the encoder's layout
    "BatcherConfig",
    "BatchAnswer",
    "EncoderOptions",
    "thread_layout",
    # errors
    "XmcserveError",
    "VariantUnavailable",
    "CatchUpFailed",
    "BundleChanged",
    "BundleError",
    "AppendRefused",
    "AppendIdReused",
    "AppendLogError",
    "AppendLogHeld",
    "LineageDiverged",
    "MemoryBusy",
    "QueueFullError",
    "BatcherStoppedError",
    "DeadlineExceededError",
    # RAE-XMC's aggregation, shared with training
    "ValueRows",
    "aggregate",
    "labels_of_keys",
    "top_k_of_row",
]
