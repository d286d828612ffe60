"""The shadow worker's child process: calls the remote shadow for the copies its parent
(:class:`service.rollout.shadow_worker.ShadowWorker`) sends, until the parent goes away.

Copies are gathered into calls of up to ``batch_texts`` texts (same k and ef), each call POSTs its
texts to ``<url>/predict`` with ``X-Shadow: 1`` (so the shadow does not mirror them again),
``workers`` calls in flight; every text is compared with A's answer, the comparison is logged
(JSONL; the text by its digest unless ``log_texts``) and the aggregates go back to the parent.
Copies past their deadline are dropped (``timeout``), failures (a dead shadow, a non-200, an
answer that is not a /predict answer) are counted (``error``), never raised.

Spawned fresh, it imports this module and :mod:`service.rollout.shadow` only: importing ONNX
Runtime and the engine there would delay the first copies past their deadline.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from service.rollout.shadow import Copy, Ranked, ShadowConfig, ShadowLog, compare, text_digest

log = logging.getLogger(__name__)


def batch_key(copy: Copy) -> tuple:
    return (copy.request.k, copy.request.ef)


def take_batch(pending: deque[Copy], batch_texts: int) -> list[Copy]:
    """The oldest copy and the following ones with its k and ef, up to ``batch_texts``
    texts (a copy with more texts than that still goes, alone); the rest stay in order."""
    first = pending.popleft()
    batch, texts, kept = [first], len(first.request.texts), deque()
    while pending and texts < batch_texts:
        copy = pending.popleft()
        if batch_key(copy) == batch_key(first) and texts + len(copy.request.texts) <= batch_texts:
            batch.append(copy)
            texts += len(copy.request.texts)
        else:
            kept.append(copy)
    pending.extendleft(reversed(kept))
    return batch


def split_answers(answers: Ranked, batch: list[Copy]) -> list[Ranked]:
    """The call's answers (one per text, in the batch's order) back to their copies."""
    out, offset = [], 0
    for copy in batch:
        out.append(answers[offset : offset + len(copy.request.texts)])
        offset += len(copy.request.texts)
    return out


def call_headers(batch: list[Copy]) -> dict[str, str]:
    """``X-Shadow`` lists the request ids of every copy the call carries (the shadow's access line
    shows them); the call itself goes under the first copy's ``X-Request-Id`` and ``traceparent``."""
    first = batch[0].request
    headers = {"X-Shadow": ",".join(c.request.request_id for c in batch) or "1"}
    if first.request_id:
        headers["X-Request-Id"] = first.request_id
    if first.traceparent:
        headers["traceparent"] = first.traceparent
    return headers


class RemoteTarget:
    """The shadow: the call's texts POSTed to ``<url>/predict``."""

    def __init__(self, url: str, workers: int):
        import httpx

        self._client = httpx.Client(base_url=url, limits=httpx.Limits(max_connections=workers))

    def answer(self, batch: list[Copy]) -> Ranked | None:
        import httpx

        first = batch[0].request
        body = {
            "texts": [t for c in batch for t in c.request.texts],
            "k": first.k,
            "exclude": [e for c in batch for e in c.request.exclude],
        }
        if first.ef is not None:
            body["ef"] = first.ef
        remaining = min(c.deadline for c in batch) - time.monotonic()
        if remaining <= 0:
            return None
        try:
            response = self._client.post("/predict", json=body, headers=call_headers(batch), timeout=remaining)
        except httpx.TimeoutException:
            return None
        response.raise_for_status()
        results = response.json()["results"]
        if len(results) != len(body["texts"]):
            raise ValueError(f"shadow answered {len(results)} results for {len(body['texts'])} texts")
        return [[(str(x["uid"]), float(x["score"])) for x in r["labels"]] for r in results]


class WorkerLoop:
    """The child's main loop: receive copies, gather calls, run them on the target, report."""

    def __init__(
        self,
        conn: Connection,
        results: Connection,
        target,
        config: ShadowConfig,
        shadow_log: ShadowLog | None,
        workers: int,
        target_name: str = "",
    ):
        self._conn = conn
        self._results = results
        self._target = target
        self._target_name = target_name
        self._config = config
        self._log = shadow_log
        self._pending: deque[Copy] = deque()
        self._send_lock = threading.Lock()
        self._slots = threading.Semaphore(workers)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="xmcserve-shadow-call")

    def run(self) -> None:
        while self._receive(block=not self._pending):
            # copies wait in the pipe (and then in the parent, bounded) while every call is busy
            self._slots.acquire()
            if not self._receive(block=False):
                return
            self._drop_expired()
            if self._pending and self._pending_texts() < self._config.batch_texts:  # let a call's worth gather
                deadline = time.monotonic() + self._config.batch_wait_s
                while self._pending_texts() < self._config.batch_texts and self._conn.poll(
                    max(0.0, deadline - time.monotonic())
                ):
                    if not self._receive(block=False):
                        return
            if not self._pending:
                self._slots.release()
                continue
            self._pool.submit(self._call, take_batch(self._pending, self._config.batch_texts))

    def _receive(self, block: bool) -> bool:
        """Move what the parent sent into ``pending``; False once the parent is gone."""
        try:
            while block or self._conn.poll(0):
                self._pending.extend(self._conn.recv())
                block = False
        except (EOFError, OSError):
            return False
        return True

    def _pending_texts(self) -> int:
        return sum(len(c.request.texts) for c in self._pending)

    def _drop_expired(self) -> None:
        now = time.monotonic()
        expired = [c for c in self._pending if c.deadline <= now]
        if expired:
            self._pending = deque(c for c in self._pending if c.deadline > now)
            self._report(("dropped", "timeout", len(expired)))

    def _call(self, batch: list[Copy]) -> None:
        try:
            started = time.monotonic()
            try:
                answers = self._target.answer(batch)
            except Exception as exc:  # a dead or failing shadow is counted, never raised
                self._report(("dropped", "error", len(batch), f"{type(exc).__name__}: {str(exc)[:200]}"))
                return
            if answers is None:
                self._report(("dropped", "timeout", len(batch)))
                return
            self._report(self._compare(batch, split_answers(answers, batch), time.monotonic() - started))
        finally:
            self._slots.release()

    def _compare(self, batch: list[Copy], answers: list[Ranked], shadow_seconds: float) -> tuple:
        overlaps, taus, score_deltas, latency_deltas, samples = [], [], [], [], []
        for copy, shadow in zip(batch, answers, strict=True):
            request = copy.request
            latency_delta = shadow_seconds - request.primary_seconds
            latency_deltas.append(latency_delta)
            for text, primary, mirrored in zip(request.texts, request.primary, shadow, strict=False):
                agreement = compare(primary, mirrored, request.k)
                samples.append(
                    (
                        text,
                        request.k,
                        agreement["overlap"],
                        agreement["kendall_tau"],
                        agreement["score_delta"],
                        latency_delta,
                    )
                )
                overlaps.append(agreement["overlap"])
                if agreement["kendall_tau"] is not None:
                    taus.append(agreement["kendall_tau"])
                if agreement["score_delta"] is not None:
                    score_deltas.append(agreement["score_delta"])
                if self._log:
                    # the text itself only when asked for: request texts are not logged by default
                    named = {"text_sha256": text_digest(text)} | ({"text": text} if self._config.log_texts else {})
                    self._log.write(
                        {
                            "ts": round(time.time(), 3),
                            "target": self._target_name,
                            "primary_variant": request.primary_variant,
                            "request_id": request.request_id,
                            **named,
                            "k": request.k,
                            **agreement,
                            "primary_ms": round(request.primary_seconds * 1000, 2),
                            "shadow_ms": round(shadow_seconds * 1000, 2),
                            "primary_top": [uid for uid, _ in primary[:10]],
                            "shadow_top": [uid for uid, _ in mirrored[:10]],
                        }
                    )
        return ("compared", len(batch), overlaps, taus, score_deltas, latency_deltas, samples)

    def _report(self, result: tuple) -> None:
        with self._send_lock, contextlib.suppress(OSError, ValueError):  # the parent is gone
            self._results.send(result)


def worker_main(conn: Connection, results: Connection, config: ShadowConfig, url: str) -> None:
    """The child process: call the shadow for the copies the parent sends until it goes away."""
    shadow_log = ShadowLog(config.log, config.log_max_bytes, config.log_backups) if config.log else None
    WorkerLoop(conn, results, RemoteTarget(url, config.workers), config, shadow_log, config.workers, url).run()
