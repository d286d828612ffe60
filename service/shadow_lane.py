"""The in-process shadow's compute: variant B's bundle in a child process in the OS's idle CPU class.

Why a process and not a thread: an idle-class *thread* shares the interpreter lock with the
primary. It gets preempted while holding it whenever the primary's threads want both cores, and
the primary then waits for a thread that cannot run (measured: the primary's p99 3.4x worse at
100 q/s). A child process has its own lock and runs only on a core nothing else wants, so
mirroring all of A's traffic cannot slow A: under load the copies wait, expire and are counted
as dropped.

The child loads the bundle that slot B holds (each copy names it by path and bundle id, so a
reload or promotion of B is followed on the next copy), batches the copies pending together,
skips those past their deadline and answers (uid, score) rankings. It holds a second copy of B
in memory. A child that dies fails its pending copies (counted by the mirror) and is started
again on the next copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

from service.batcher import predict_jobs
from service.bundle import load_bundle
from service.cpu_priority import yield_cpu, yield_cpu_process
from service.encoder import EncoderOptions
from service.search import Predictor
from service.shadow import Ranked, ShadowRequest, ranked

log = logging.getLogger(__name__)

# texts the child puts in one batch at most
MAX_BATCH_TEXTS = 64


class ShadowLaneError(RuntimeError):
    """The lane could not compute a copy (no candidate, bundle refused, child gone)."""


@dataclass
class _Copy:
    """One mirrored request as the child receives it (``monotonic`` clocks are system-wide on Linux)."""

    copy_id: int
    bundle_path: str
    bundle_id: str
    texts: list[str]
    k: int
    ef: int | None
    exclude: list[list[str]]
    deadline: float


class ShadowLane:
    """Parent side: :meth:`call` sends a copy to the child and awaits its rankings."""

    def __init__(
        self, candidate: Callable[[], Predictor | None], options: EncoderOptions, verify: bool, timeout_s: float
    ):
        self._candidate = candidate
        # The child is idle-class: its intra-op threads may use every core nothing else wants,
        # spinning would only burn what the primary leaves.
        self._options = replace(options, allow_spinning=False)
        self._verify = verify
        self._timeout_s = timeout_s
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._closed = False
        threading.Thread(target=self._send_loop, name="xmcserve-shadow-send", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _ensure_child(self) -> None:
        with self._lock:
            if self._process is not None and self._process.is_alive():
                return
            context = multiprocessing.get_context("spawn")  # no forked copy of the server's threads
            parent, child = context.Pipe()
            self._process = context.Process(
                target=lane_main, args=(child, self._options, self._verify), name="xmcserve-shadow-lane", daemon=True
            )
            self._process.start()
            # At once, before the child's imports and bundle load: those run idle-class too.
            yield_cpu(self._process.pid)
            child.close()
            self._conn = parent
        threading.Thread(target=self._receive_loop, args=(parent,), name="xmcserve-shadow-recv", daemon=True).start()

    def warm(self) -> None:
        """Start the child and load the candidate now, so the first copies do not wait for it."""
        predictor = self._candidate()
        if predictor is None or self._closed:
            return
        self._ensure_child()
        bundle = predictor.bundle
        copy = _Copy(next(self._ids), str(bundle.path), bundle.bundle_id, [], 0, None, [], time.monotonic() + 3600)
        self._outbox.put((self._conn, copy))

    async def call(self, request: ShadowRequest) -> Ranked:
        predictor = self._candidate()
        if predictor is None:
            raise ShadowLaneError("no candidate bundle loaded to shadow")
        if self._closed:
            raise ShadowLaneError("shadow lane closed")
        self._ensure_child()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        copy_id = next(self._ids)
        self._waiting[copy_id] = (future, loop)
        bundle = predictor.bundle
        self._outbox.put(
            (
                self._conn,
                _Copy(
                    copy_id,
                    str(bundle.path),
                    bundle.bundle_id,
                    request.texts,
                    request.k,
                    request.ef,
                    [list(e) for e in request.exclude],
                    time.monotonic() + self._timeout_s,
                ),
            )
        )
        try:
            return await future
        finally:
            self._waiting.pop(copy_id, None)

    async def close(self) -> None:
        self._closed = True
        self._outbox.put(None)
        self._fail_waiting("shadow lane closed")
        if self._process is not None and self._process.is_alive():
            self._process.terminate()

    def _send_loop(self) -> None:
        # Sending blocks when the pipe is full (a starved child): on this thread, never the loop's.
        while (item := self._outbox.get()) is not None:
            conn, copy = item
            try:
                conn.send(copy)
            except (OSError, ValueError) as exc:  # the child is gone; the next copy starts another
                self._settle(copy.copy_id, ShadowLaneError(f"shadow lane unreachable: {exc}"))

    def _receive_loop(self, conn: Connection) -> None:
        while True:
            try:
                copy_id, outcome = conn.recv()
            except (EOFError, OSError):
                break
            self._settle(copy_id, ShadowLaneError(outcome) if isinstance(outcome, str) else outcome)
        if not self._closed:
            log.warning("shadow lane process exited; it restarts on the next copy")
        self._fail_waiting("shadow lane process exited")

    def _settle(self, copy_id: int, outcome) -> None:
        entry = self._waiting.get(copy_id)
        if entry is None:  # timed out and forgotten
            return
        future, loop = entry
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
            loop.call_soon_threadsafe(_set_outcome, future, outcome)

    def _fail_waiting(self, reason: str) -> None:
        for copy_id in list(self._waiting):
            self._settle(copy_id, ShadowLaneError(reason))


def _set_outcome(future: asyncio.Future, outcome) -> None:
    if future.done():  # the mirror's timeout cancelled it
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


# ---------------------------------------------------------------- child process


def lane_main(conn: Connection, options: EncoderOptions, verify: bool) -> None:
    """The child: idle CPU class first (every thread it starts inherits it), then copies until
    the parent goes away. Outcomes are rankings or an error message (str)."""
    yield_cpu_process()
    loaded: tuple[str, str, Predictor] | None = None  # (path, bundle id, predictor)
    while (batch := _next_batch(conn)) is not None:
        now = time.monotonic()
        live = [c for c in batch if c.deadline > now]
        for copy in batch:
            if copy.deadline <= now:
                conn.send((copy.copy_id, "expired before the shadow had a free core"))
        for key, copies in itertools.groupby(live, key=lambda c: (c.bundle_path, c.bundle_id)):
            copies = list(copies)
            try:
                if loaded is None or loaded[:2] != key:
                    loaded = (*key, _load(Path(key[0]), key[1], options, verify))
                outcomes = [[] for _ in copies]  # a copy without texts only loads (warm)
                asked = [i for i, c in enumerate(copies) if c.texts]
                if asked:
                    per_copy, _, _ = predict_jobs(loaded[2], [copies[i] for i in asked])
                    for i, rankings in zip(asked, per_copy, strict=True):
                        outcomes[i] = ranked(rankings, loaded[2].bundle.label_uids)
            except Exception as exc:  # reported per copy; the lane keeps running
                outcomes = [f"{type(exc).__name__}: {exc}"] * len(copies)
            for copy, outcome in zip(copies, outcomes, strict=True):
                conn.send((copy.copy_id, outcome))


def _next_batch(conn: Connection) -> list[_Copy] | None:
    try:
        first = conn.recv()
    except (EOFError, OSError):
        return None
    batch, texts = [first], len(first.texts)
    while texts < MAX_BATCH_TEXTS and conn.poll(0):
        batch.append(conn.recv())
        texts += len(batch[-1].texts)
    return batch


def _load(path: Path, bundle_id: str, options: EncoderOptions, verify: bool) -> Predictor:
    predictor = Predictor(load_bundle(path, options, verify=verify))
    if predictor.bundle.bundle_id != bundle_id:
        raise ShadowLaneError(f"{path} now holds {predictor.bundle.bundle_id}, not the candidate {bundle_id}")
    return predictor
