"""Shadow traffic: mirror a sampled fraction of primary requests to a shadow and compare.

The shadow is the in-process candidate bundle (variant B) or a remote xmcserve URL. It never sits
on the primary's critical path: :meth:`ShadowMirror.offer` is called after the primary answer is
ready and only enqueues (bounded, non-blocking); waiting copies are sent together, a few calls at
a time, each with a timeout; a full queue or a slow or dead shadow drops the copy and counts it.

Per mirrored text: overlap@k = |top-k A ∩ top-k B| / k, Kendall's τ of the shared labels' ranks,
the mean |score A − score B| over shared labels, and the latency delta (the shadow call that
carried the text − the primary request), into Prometheus histograms and a size-bounded rotating
JSONL log (see ``service.shadow_report``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.handlers
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from service.search import Ranking

log = logging.getLogger(__name__)

# (uid, score) best first, one list per text
Ranked = list[list[tuple[str, float]]]


@dataclass
class ShadowRequest:
    texts: list[str]
    k: int
    ef: int | None
    exclude: list[list[str]]
    primary: Ranked
    primary_seconds: float
    primary_variant: str


def kendall_tau_of_ranks(ranks: list[int]) -> float:
    """Kendall's τ between the order 0, 1, …, n−1 and ``ranks`` (distinct): 1 − 4·inversions /
    (n(n − 1)). Ranks within one top-k have no ties, so this equals τ-b; scipy's ``kendalltau``
    gives the same value at ~0.5 ms a call, too slow for the event loop at one call per text."""
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


ShadowCall = Callable[[ShadowRequest], Awaitable[Ranked]]


def remote_shadow(url: str, timeout_s: float) -> tuple[ShadowCall, Callable[[], Awaitable[None]]]:
    """A shadow that is another xmcserve: the same request body, POSTed to ``url``/predict."""
    client = httpx.AsyncClient(base_url=url, timeout=timeout_s)

    async def call(request: ShadowRequest) -> Ranked:
        body = {"texts": request.texts, "k": request.k, "exclude": request.exclude}
        if request.ef is not None:
            body["ef"] = request.ef
        response = await client.post("/predict", json=body, headers={"X-Shadow": "1"})
        response.raise_for_status()
        return [[(x["uid"], x["score"]) for x in r["labels"]] for r in response.json()["results"]]

    return call, client.aclose


@dataclass
class ShadowConfig:
    """Attributes:
    fraction: share of primary requests mirrored (0 = off, 1 = all).
    queue_size: most copies waiting; more are dropped, never waited for.
    timeout_s: a shadow answer later than this is dropped.
    workers: shadow calls in flight at once.
    batch_texts: most texts one shadow call carries. Waiting copies with the same k and ef go
        in one call: a remote call costs A ~1.4 ms of CPU in httpx with one text and 2.0 ms
        with sixteen (0.13 ms per text), CPU taken from A's own requests.
        Keep it ≤ the shadow's ``max_texts_per_request``.
    batch_wait_s: after the first copy, how long to wait for more before sending the call.
    """

    fraction: float = 0.0
    queue_size: int = 64
    timeout_s: float = 2.0
    workers: int = 4
    batch_texts: int = 32
    batch_wait_s: float = 0.02


def merged(batch: list[ShadowRequest]) -> ShadowRequest:
    """One request carrying the texts of ``batch`` (same k and ef) in order."""
    first = batch[0]
    return ShadowRequest(
        texts=[t for r in batch for t in r.texts],
        k=first.k,
        ef=first.ef,
        exclude=[e for r in batch for e in r.exclude],
        primary=[p for r in batch for p in r.primary],
        primary_seconds=first.primary_seconds,
        primary_variant=first.primary_variant,
    )


class ShadowMirror:
    """Samples primary requests into a bounded queue; one collector takes waiting copies into
    calls of up to ``batch_texts`` texts and runs at most ``workers`` calls at once."""

    def __init__(
        self,
        call: ShadowCall,
        config: ShadowConfig,
        metrics,
        target: str,
        shadow_log: ShadowLog | None = None,
        close: Callable[[], Awaitable[None]] | None = None,
        warm: Callable[[], None] | None = None,
    ):
        self.config = config
        self.target = target
        self._call = call
        self._metrics = metrics
        self._log = shadow_log
        self._close = close
        self._warm = warm or (lambda: None)
        self._queue: asyncio.Queue[ShadowRequest] = asyncio.Queue(maxsize=config.queue_size)
        self._held: ShadowRequest | None = None  # taken from the queue, opens the next call
        self._collector: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()
        self._stopping = False
        self._rng = random.Random()

    def start(self) -> None:
        if self.config.fraction > 0:
            self._warm()
        self._slots = asyncio.Semaphore(self.config.workers)
        self._collector = asyncio.create_task(self._collect())

    async def stop(self) -> None:
        # The flag as well as the cancel: on Python < 3.12, asyncio.wait_for can swallow a
        # cancellation that lands as the shadow call completes.
        self._stopping = True
        tasks = [t for t in [self._collector, *self._calls] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._close:
            await self._close()
        if self._log:
            self._log.close()

    def set_fraction(self, fraction: float) -> None:
        if fraction > 0 >= self.config.fraction:
            self._warm()
        self.config.fraction = fraction

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def offer(self, request: ShadowRequest) -> bool:
        """Mirror ``request`` if sampled and there is room; never blocks."""
        if self.config.fraction <= 0 or self._rng.random() >= self.config.fraction:
            return False
        try:
            self._queue.put_nowait(request)
        except asyncio.QueueFull:
            self._metrics.shadow_dropped.labels(reason="queue_full").inc()
            return False
        return True

    async def _collect(self) -> None:
        while not self._stopping:
            await self._slots.acquire()  # copies wait in the bounded queue while all calls run
            batch = await self._next_batch()
            task = asyncio.create_task(self._send(batch))
            self._calls.add(task)
            task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task) -> None:
        self._calls.discard(task)
        self._slots.release()

    async def _next_batch(self) -> list[ShadowRequest]:
        first = self._held or await self._queue.get()
        self._held = None
        if len(first.texts) * (1 + self._queue.qsize()) < self.config.batch_texts:
            await asyncio.sleep(self.config.batch_wait_s)  # let a call's worth of copies gather
        batch, texts = [first], len(first.texts)
        while texts < self.config.batch_texts and not self._queue.empty():
            copy = self._queue.get_nowait()
            if (copy.k, copy.ef) != (first.k, first.ef) or texts + len(copy.texts) > self.config.batch_texts:
                self._held = copy  # opens the next call
                break
            batch.append(copy)
            texts += len(copy.texts)
        return batch

    async def _send(self, batch: list[ShadowRequest]) -> None:
        started = time.perf_counter()
        try:
            shadow = await asyncio.wait_for(self._call(merged(batch)), self.config.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):  # the shadow's own give-up (deadline) counts the same
            self._metrics.shadow_dropped.labels(reason="timeout").inc(len(batch))
            return
        except Exception as exc:  # a dead or failing shadow is counted, never raised
            self._metrics.shadow_dropped.labels(reason="error").inc(len(batch))
            log.debug("shadow call failed: %s", exc)
            return
        seconds = time.perf_counter() - started
        offset = 0
        for request in batch:
            self._record(request, shadow[offset : offset + len(request.texts)], seconds)
            offset += len(request.texts)

    def _record(self, request: ShadowRequest, shadow: Ranked, shadow_seconds: float) -> None:
        self._metrics.shadow_compared.inc(len(request.texts))
        delta = shadow_seconds - request.primary_seconds
        self._metrics.shadow_latency_delta.observe(delta)
        for text, primary, mirrored in zip(request.texts, request.primary, shadow, strict=False):
            agreement = compare(primary, mirrored, request.k)
            self._metrics.shadow_overlap.observe(agreement["overlap"])
            if agreement["kendall_tau"] is not None:
                self._metrics.shadow_rank_correlation.observe(agreement["kendall_tau"])
            if self._log:
                self._log.write(
                    {
                        "ts": round(time.time(), 3),
                        "target": self.target,
                        "primary_variant": request.primary_variant,
                        "text": text,
                        "k": request.k,
                        **agreement,
                        "primary_ms": round(request.primary_seconds * 1000, 2),
                        "shadow_ms": round(shadow_seconds * 1000, 2),
                        "primary_top": [uid for uid, _ in primary[:10]],
                        "shadow_top": [uid for uid, _ in mirrored[:10]],
                    }
                )
