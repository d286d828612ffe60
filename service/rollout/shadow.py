"""Shadow traffic: mirror a sampled fraction of primary requests to a remote shadow and compare.

The shadow is another xmcserve (or anything that answers ``POST /predict``) on hardware of its
own — a compose service, a k8s Deployment — as Istio/Envoy mirroring does it. The primary's
process does two things for it: :meth:`ShadowMirror.offer`, after the primary answer is ready,
samples the request and hands a copy to the shadow worker (a non-blocking append; a copy over
``queue_size`` outstanding is dropped and counted), and the worker's per-call results become
Prometheus observations. Batching copies into calls, calling the shadow, comparing the rankings
and writing the comparison log run in the worker's child process
(:mod:`service.rollout.shadow_worker`), outside the primary's interpreter lock and event loop.

Per mirrored text: overlap@k = |top-k A ∩ top-k B| / k, Kendall's τ of the shared labels' ranks,
the mean |score A − score B| over shared labels, and the latency delta (the shadow call that
carried the text − the primary request), into Prometheus histograms and a size-bounded rotating
JSONL log (see ``service.rollout.shadow_report``), and into a bounded in-memory ring of recent
comparisons for the rollout page (:mod:`service.rollout.agreement`).

The log names a text by a short sha256 (:func:`text_digest`), not by the text: request texts are
never logged by default (docs/operations.md), and the digest still joins the lines of one text.
``log_texts`` (``XMCSERVE_SHADOW_LOG_TEXTS``) writes the texts too, for debugging.
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from service.rollout import PRIMARY
from service.rollout.agreement import AgreementHistory

if TYPE_CHECKING:  # the worker's child process imports this module without the engine
    from engine import Ranking

log = logging.getLogger(__name__)

# Dropped copies are logged at most once per reason this often (with the count since the last line).
DROP_LOG_INTERVAL_S = 10.0
# (uid, score) best first, one list per text
Ranked = list[list[tuple[str, float]]]


@dataclass
class ShadowRequest:
    """A primary request as it is mirrored: what the shadow computes and A's answer to compare."""

    texts: list[str]
    k: int
    ef: int | None
    exclude: list[list[str]]
    primary: Ranked
    primary_seconds: float
    primary_variant: str
    request_id: str = ""  # the primary request's X-Request-Id, sent with the shadow call
    traceparent: str | None = None  # the primary request span's W3C traceparent (tracing on)


@dataclass
class Copy:
    """A mirrored request on its way to the worker process (``time.monotonic`` is system-wide on
    Linux, so the deadline means the same in both processes)."""

    request: ShadowRequest
    deadline: float


def text_digest(text: str) -> str:
    """The first 16 hex digits (64 bits) of the text's UTF-8 sha256: what the comparison log names
    a text by. Not a secret: a text one can guess can be confirmed by hashing it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def kendall_tau_of_ranks(ranks: list[int]) -> float:
    """Kendall's τ between the order 0, 1, …, n−1 and ``ranks`` (distinct): 1 − 4·inversions /
    (n(n − 1)). Ranks within one top-k have no ties, so this equals τ-b; scipy's ``kendalltau``
    gives the same value at ~0.5 ms a call."""
    n = len(ranks)
    b = np.asarray(ranks)
    inversions = int(np.count_nonzero(np.triu(b[:, None] > b[None, :], 1)))
    return 1.0 - 4.0 * inversions / (n * (n - 1))


def compare(primary: list[tuple[str, float]], shadow: list[tuple[str, float]], k: int) -> dict:
    """Agreement of two rankings of one text."""
    b_rank = {uid: i for i, (uid, _) in enumerate(shadow[:k])}
    b_score = dict(shadow[:k])
    shared = [(uid, score) for uid, score in primary[:k] if uid in b_rank]  # in A's order
    tau = kendall_tau_of_ranks([b_rank[uid] for uid, _ in shared]) if len(shared) >= 2 else None
    score_delta = sum(abs(score - b_score[uid]) for uid, score in shared) / len(shared) if shared else None
    return {"overlap": len(shared) / k, "kendall_tau": tau, "score_delta": score_delta, "shared": len(shared)}


def ranked(rankings: list[Ranking], label_uids: list[str]) -> Ranked:
    """(uid, score) lists of a bundle's rankings: what the two sides of a comparison share."""
    return [[(label_uids[i], s) for i, s in zip(r.ids.tolist(), r.scores.tolist(), strict=True)] for r in rankings]


class ShadowLog:
    """JSON lines, rotated by size: at most (backups + 1) x max_bytes on disk."""

    def __init__(self, path: Path, max_bytes: int, backups: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._logger = logging.getLogger(f"xmcserve.shadow.{path}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(self._handler)

    def write(self, record: dict) -> None:
        self._logger.info(json.dumps(record, ensure_ascii=False))

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()


@dataclass
class ShadowConfig:
    """Attributes:
    fraction: share of primary requests mirrored (0 = off, 1 = all).
    queue_size: most copies outstanding (handed to the worker and not yet compared or dropped);
        more are dropped at once, never waited for.
    timeout_s: a copy not compared this long after A answered is dropped.
    batch_texts: most texts one shadow call carries (waiting copies with the same k and ef share
        a call: a call costs a fixed ~1.4 ms of CPU in httpx whatever it carries). Keep it ≤ the
        shadow's ``max_texts_per_request``.
    workers: shadow calls in flight at once.
    batch_wait_s: after the first copy, how long the worker waits for more before the call (the
        comparison is not latency-critical; fuller calls cost both sides less).
    log: the JSONL comparison log (None: no log), rotated at ``log_max_bytes``, ``log_backups`` kept.
    log_texts: write each mirrored text into the log (debugging); by default only its
        :func:`text_digest`.
    """

    fraction: float = 0.0
    queue_size: int = 64
    timeout_s: float = 2.0
    batch_texts: int = 32
    workers: int = 4
    batch_wait_s: float = 0.1
    log: Path | None = None
    log_max_bytes: int = 10_000_000
    log_backups: int = 3
    log_texts: bool = False


class ShadowMirror:
    """Samples primary requests and hands copies to a shadow worker (``service.rollout.shadow_worker``);
    the worker's results arrive through :meth:`record`."""

    def __init__(
        self,
        config: ShadowConfig,
        metrics,
        target: str,
        worker,
        variant: str = PRIMARY,
        history: AgreementHistory | None = None,
        clock=time.monotonic,
    ):
        """``worker``: has ``start()``, ``submit(copy)``, ``outstanding`` and ``close()``.
        ``target``: the shadow's URL, as /info and the log name it. ``variant``: the variant
        whose answers are offered (labels every shadow metric). ``history``: where the recent
        comparisons are kept for the rollout page."""
        self.config = config
        self.target = target
        self.variant = variant
        self.history = history or AgreementHistory()
        self._metrics = metrics
        metrics.shadow_compared.labels(variant=variant)  # exported at 0 until the first comparison
        for reason in ("queue_full", "timeout", "error", "worker_down"):
            metrics.shadow_dropped.labels(reason=reason, variant=variant)
        self._worker = worker
        self._rng = random.Random()
        self._clock = clock
        self._unlogged_drops: dict[str, int] = {}
        self._last_drop_line: dict[str, float] = {}
        worker.on_result = self.record
        metrics.shadow_worker_exits.labels(variant=variant)
        worker.on_exit = lambda: metrics.shadow_worker_exits.labels(variant=variant).inc()

    def start(self) -> None:
        if self.config.fraction > 0:
            self._worker.start()

    async def stop(self) -> None:
        self._worker.close()

    def set_fraction(self, fraction: float) -> None:
        if fraction > 0:
            self._worker.start()
        self.config.fraction = fraction

    @property
    def depth(self) -> int:
        return self._worker.outstanding

    def offer(self, request: ShadowRequest) -> bool:
        """Mirror ``request`` if sampled and there is room; never blocks."""
        if self.config.fraction <= 0 or self._rng.random() >= self.config.fraction:
            return False
        if self._worker.outstanding >= self.config.queue_size:
            self._metrics.shadow_dropped.labels(reason="queue_full", variant=self.variant).inc()
            self.history.add_dropped("queue_full", 1)
            self._log_drop("queue_full", 1)
            return False
        self._worker.submit(Copy(request, time.monotonic() + self.config.timeout_s))
        return True

    def _log_drop(self, reason: str, copies: int, detail: str | None = None) -> None:
        """A warning for dropped copies, at most one per reason every :data:`DROP_LOG_INTERVAL_S`
        (counting the drops since the last one): a failing shadow must not flood the log."""
        pending = self._unlogged_drops.get(reason, 0) + copies
        now = self._clock()
        if now - self._last_drop_line.get(reason, -DROP_LOG_INTERVAL_S) < DROP_LOG_INTERVAL_S:
            self._unlogged_drops[reason] = pending
            return
        self._unlogged_drops[reason] = 0
        self._last_drop_line[reason] = now
        what = "shadow failing" if reason == "error" else "shadow copies dropped"
        log.warning(
            "%s: %d copies (%s)%s",
            what,
            pending,
            reason,
            f": {detail}" if detail else "",
            extra={
                "event": "shadow_dropped",
                "reason": reason,
                "copies": pending,
                "target": self.target,
                "detail": detail,
            },
        )

    def record(self, result: tuple) -> None:
        """One worker result: ``("compared", copies, overlaps, taus, score_deltas, latency_deltas,
        samples)`` (``samples``: one (text, k, overlap, τ, score delta, latency delta) per text) or
        ``("dropped", reason, copies)``."""
        metrics, variant = self._metrics, self.variant
        if result[0] == "dropped":
            reason, copies = result[1], result[2]
            metrics.shadow_dropped.labels(reason=reason, variant=variant).inc(copies)
            self.history.add_dropped(reason, copies)
            self._log_drop(reason, copies, result[3] if len(result) > 3 else None)
            return
        _, _, overlaps, taus, score_deltas, latency_deltas, samples = result
        self.history.add_compared(samples)
        metrics.shadow_compared.labels(variant=variant).inc(len(overlaps))
        for histogram, values in (
            (metrics.shadow_overlap, overlaps),
            (metrics.shadow_rank_correlation, taus),
            (metrics.shadow_score_delta, score_deltas),
            (metrics.shadow_latency_delta, latency_deltas),
        ):
            child = histogram.labels(variant=variant)
            for value in values:
                child.observe(value)
