"""The shadow worker: a child process that calls the remote shadow, off the primary's process.

Parent side, :class:`ShadowWorker`: copies from :class:`~service.rollout.shadow.ShadowMirror` are
buffered and written to the child in one non-blocking write per flush; the child's per-call
results are read when the event loop sees them and handed to the mirror. That is all the
primary's process does per mirrored request (an append, and a few histogram observations per call).

Child side, :func:`worker_main`: copies are gathered into calls of up to ``batch_texts`` texts
(same k and ef), each call POSTs its texts to ``<url>/predict`` with ``X-Shadow: 1`` (so the
shadow does not mirror them again), ``workers`` calls in flight; every text is compared with A's
answer, the comparison is logged (JSONL) and the aggregates go back to the parent. Copies past
their deadline are dropped (``timeout``), failures (a dead shadow, a non-200, an answer that is
not a /predict answer) are counted (``error``), never raised.

Why a process, like a mirroring sidecar: a thread shares the interpreter lock with the primary
and, preempted while holding it, stalls A; the httpx call and the comparisons on A's event loop
tripled A's median at half its peak on an idle 16-core machine (bench/results/README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import multiprocessing
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from service.rollout.shadow import Copy, Ranked, ShadowConfig, ShadowLog, compare

log = logging.getLogger(__name__)

PIPE_SIZE_SETTING = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux's fcntl code for a pipe's capacity

# A child that exits unasked is started again on the next copy: at once the first time, then after
# 1, 2, 4 … 60 s while it keeps exiting before it reports a result (a bad URL, an import error:
# it dies at start), like Kubernetes' CrashLoopBackOff; a result from a child resets the count.
# Copies offered while the worker waits are dropped (``worker_down``), never held.
RESTART_BACKOFF_FIRST_S = 1.0
RESTART_BACKOFF_MAX_S = 60.0


def restart_delay_s(failures: int) -> float:
    """The wait before the next start after ``failures`` consecutive exits without a result."""
    return 0.0 if failures <= 1 else min(RESTART_BACKOFF_FIRST_S * 2 ** (failures - 2), RESTART_BACKOFF_MAX_S)


# ---------------------------------------------------------------- parent side


class ShadowWorker:
    """Parent-side handle of the child process, driven by the event loop alone.

    No thread of its own: a thread woken per copy took the interpreter lock from A's batch
    thread and event loop at every request (A's p99 x1.44 with copies only handed over and
    dropped, x1.05 when at most one was outstanding). Copies are buffered and flushed together
    every ``flush_s`` in one non-blocking write (framed as ``multiprocessing.connection``
    frames, the rest written when the pipe has room); results are read when the loop sees them.

    Every copy with texts is settled exactly once, which keeps :attr:`outstanding` exact: by the
    child's result or, when the child dies, as lost with everything else outstanding.
    """

    def __init__(
        self, config: ShadowConfig, url: str, flush_s: float = 0.02, clock: Callable[[], float] = time.monotonic
    ):
        """``config``: the mirror's (the child gets a copy at start); ``url``: the shadow's base
        URL (``<url>/predict`` answers the copies); ``clock``: times the restart back-off."""
        self.config = config
        self.url = url
        self.flush_s = flush_s
        self.on_result: Callable[[tuple], None] = lambda result: None
        self.on_exit: Callable[[], None] = lambda: None  # a child exited unasked
        self.exits = 0
        self._clock = clock
        self._failures = 0  # consecutive exits without a result
        self._not_before = float("-inf")
        self._submitted = 0
        self._settled = 0
        self._buffer: list[Copy] = []  # copies waiting for the next flush
        self._unsent = bytearray()  # framed bytes the pipe had no room for yet
        self._flush_handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._copies_fd: int | None = None  # write end of the copies pipe (non-blocking)
        self._results: Connection | None = None  # read end of the results pipe
        self._writing = False
        self._closed = False

    @property
    def outstanding(self) -> int:
        """Copies handed over and not yet compared or dropped."""
        return self._submitted - self._settled

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def restart_delay_s(self) -> float:
        """How long after the last exit the next start waits."""
        return restart_delay_s(self._failures)

    def start(self) -> bool:
        """Start the child (on the running event loop) unless it runs or its restart back-off
        has not passed; whether a child runs now."""
        if self._process is not None:
            return True
        if self._closed or self._clock() < self._not_before:
            return False
        self._loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")  # no forked copy of the server's threads
        copies_read, self._copies_fd = os.pipe()
        os.set_blocking(self._copies_fd, False)
        with contextlib.suppress(AttributeError, OSError):  # Linux: room for a burst of copies
            fcntl.fcntl(self._copies_fd, PIPE_SIZE_SETTING, 1 << 20)
        copies = Connection(copies_read, writable=False)
        self._results, results_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=worker_main,
            args=(copies, results_out, self.config, self.url),
            name="xmcserve-shadow",
            daemon=True,
        )
        self._process.start()
        copies.close()  # the child holds its own copies of these ends: EOF and EPIPE then mean it is gone
        results_out.close()
        self._loop.add_reader(self._results.fileno(), self._on_results)
        return True

    def submit(self, copy: Copy) -> None:
        self._submitted += 1
        if not self.start():  # closed, or waiting to restart a child that keeps exiting
            self._settle(("dropped", "worker_down", 1))
            return
        self._enqueue(copy)

    def close(self) -> None:
        self._closed = True
        self._stop_child()

    def _enqueue(self, copy: Copy) -> None:
        self._buffer.append(copy)
        if self._flush_handle is None and self._loop is not None:
            self._flush_handle = self._loop.call_later(self.flush_s, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        if not self._buffer or self._copies_fd is None:
            return
        payload = ForkingPickler.dumps(self._buffer)
        self._buffer = []
        self._unsent += struct.pack("!i", len(payload)) + payload
        self._write()

    def _write(self) -> None:
        try:
            written = os.write(self._copies_fd, self._unsent)
        except BlockingIOError:
            written = 0
        except OSError:  # the child is gone; its results pipe says so too
            self._child_gone()
            return
        del self._unsent[:written]
        if self._unsent and not self._writing:
            self._loop.add_writer(self._copies_fd, self._write)
            self._writing = True
        elif not self._unsent and self._writing:
            self._loop.remove_writer(self._copies_fd)
            self._writing = False

    def _on_results(self) -> None:
        try:
            while self._results is not None and self._results.poll(0):
                result = self._results.recv()
                self._failures = 0  # the child works
                self._settle(result)
        except (EOFError, OSError):
            self._child_gone()

    def _settle(self, result: tuple) -> None:
        self._settled += result[2] if result[0] == "dropped" else result[1]
        try:
            self.on_result(result)
        except Exception:  # metrics must not stop the results
            log.exception("recording a shadow result failed")

    def _child_gone(self) -> None:
        if not self._closed:
            self.exits += 1
            self._failures += 1
            self._not_before = self._clock() + self.restart_delay_s
            log.warning("shadow worker process exited; it restarts on a copy %.0f s from now", self.restart_delay_s)
            try:
                self.on_exit()
            except Exception:
                log.exception("recording a shadow worker exit failed")
        self._stop_child()
        if self.outstanding > 0:  # sent, buffered or unsent: none of them will be answered
            self._settle(("dropped", "error", self.outstanding, "the shadow worker process exited"))

    def _stop_child(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._buffer = []
        self._unsent.clear()
        if self._loop is not None and not self._loop.is_closed():
            if self._results is not None:
                self._loop.remove_reader(self._results.fileno())
            if self._writing:
                self._loop.remove_writer(self._copies_fd)
        self._writing = False
        if self._results is not None:
            self._results.close()
            self._results = None
        if self._copies_fd is not None:
            os.close(self._copies_fd)
            self._copies_fd = None
        if self._process is not None:
            if self._process.is_alive():
                self._process.terminate()
            self._process = None


# ---------------------------------------------------------------- child side


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
                    self._log.write(
                        {
                            "ts": round(time.time(), 3),
                            "target": self._target_name,
                            "primary_variant": request.primary_variant,
                            "request_id": request.request_id,
                            "text": text,
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
