"""The in-process shadow's compute: variant B's bundle in a child process that yields to the primary.

Why a process and not a thread: an idle-class *thread* shares the interpreter lock with the
primary. It gets preempted while holding it whenever the primary's threads want both cores, and
the primary then waits for a thread that cannot run (measured: the primary's p99 3.4x worse at
100 q/s). A child process has its own lock.

Why more than the idle CPU class: the child computed on the core the primary's single-threaded
stages left free and evicted the primary's weights from the shared caches (the primary's p99 x3.9
at half its peak). So, with a :class:`~service.primary_gate.PrimaryActivity` (the default), the
child computes a copy in units of :data:`CHUNK_TEXTS` texts, each started only while the primary
has no request in flight and aborted the moment one arrives (:class:`~service.primary_gate.PrimaryGate`).
Under load the copies wait, expire and are counted as dropped (``timeout``): mirroring all of A's
traffic takes only the moments A is idle.

The child loads the bundle that slot B holds (each copy names it by path and bundle id, so a
reload or promotion of B is followed on the next copy), skips copies past their deadline and
answers (uid, score) rankings. It holds a second copy of B in memory. A child that dies fails
its pending copies (counted by the mirror) and is started again on the next copy.
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
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.bundle import load_bundle
from service.encoder import EncoderOptions
from service.primary_gate import PrimaryActivity, PrimaryGate, lane_entry
from service.search import Predictor
from service.shadow import Ranked, ShadowRequest, ranked

log = logging.getLogger(__name__)

# Texts per unit of shadow work: one ONNX call that a quiet moment of the primary can hold
# (a few milliseconds on one core) and whose abort wastes little.
CHUNK_TEXTS = 8
EXPIRED = "expired: the primary had no quiet moment before the copy's deadline"


class ShadowLaneError(RuntimeError):
    """The lane could not compute a copy (no candidate, bundle refused, child gone)."""


class ShadowLaneExpired(ShadowLaneError, TimeoutError):
    """The copy's deadline passed before the primary left the child a quiet moment."""


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
        self,
        candidate: Callable[[], Predictor | None],
        options: EncoderOptions,
        verify: bool,
        timeout_s: float,
        activity: PrimaryActivity | None = None,
    ):
        """``activity``: the serving process's requests in flight; the child computes only while
        there are none (None: it computes whenever the idle CPU class lets it)."""
        self._candidate = candidate
        self._activity = activity
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
            shared = self._activity.shared if self._activity is not None else None
            # The options travel as a dict: unpickling an EncoderOptions would import ONNX Runtime
            # before lane_entry has moved the child to the idle class.
            self._process = context.Process(
                target=lane_entry,
                args=(child, shared, asdict(self._options), self._verify),
                name="xmcserve-shadow-lane",
                daemon=True,
            )
            self._process.start()
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
            self._settle(copy_id, _outcome(outcome))
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


def _outcome(sent):
    """Rankings, or the child's error message as the exception the mirror counts."""
    if not isinstance(sent, str):
        return sent
    return ShadowLaneExpired(sent) if sent == EXPIRED else ShadowLaneError(sent)


def _set_outcome(future: asyncio.Future, outcome) -> None:
    if future.done():  # the mirror's timeout cancelled it
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


# ---------------------------------------------------------------- child process


def lane_main(conn: Connection, gate: PrimaryGate, options: EncoderOptions, verify: bool) -> None:
    """The child's loop (entered through :func:`~service.primary_gate.lane_entry`, idle-class):
    copies until the parent goes away. Outcomes are rankings or an error message (str)."""
    loaded: tuple[str, str, Predictor] | None = None  # (path, bundle id, predictor)
    while True:
        try:
            copy: _Copy = conn.recv()
        except (EOFError, OSError):
            return
        if copy.deadline <= time.monotonic():
            conn.send((copy.copy_id, EXPIRED))
            continue
        try:
            key = (copy.bundle_path, copy.bundle_id)
            if loaded is None or loaded[:2] != key:
                loaded = (*key, _load(Path(copy.bundle_path), copy.bundle_id, options, verify))
            outcome = _answer(loaded[2], copy, gate) if copy.texts else []  # a copy without texts only loads
        except Exception as exc:  # reported per copy; the lane keeps running
            outcome = f"{type(exc).__name__}: {exc}"
        conn.send((copy.copy_id, outcome))


def _answer(predictor: Predictor, copy: _Copy, gate: PrimaryGate) -> Ranked | str:
    """The candidate's rankings of one copy, computed in the primary's quiet moments."""
    parts = []
    for start in range(0, len(copy.texts), CHUNK_TEXTS):
        vectors = _encode_when_quiet(predictor, copy.texts[start : start + CHUNK_TEXTS], gate, copy.deadline)
        if vectors is None:
            return EXPIRED
        parts.append(vectors)
    if not gate.wait_for_quiet(copy.deadline):
        return EXPIRED
    exclude = [predictor.bundle.label_ids(e) for e in copy.exclude]
    prediction = predictor.search(np.concatenate(parts), copy.k, copy.ef, exclude)
    return ranked(prediction.rankings, predictor.bundle.label_uids)


def _encode_when_quiet(predictor: Predictor, texts: list[str], gate: PrimaryGate, deadline: float):
    """Vectors of ``texts``, encoded again after every abort; None once ``deadline`` passes."""
    encoder = predictor.bundle.encoder
    while gate.wait_for_quiet(deadline):
        run_options = ort.RunOptions()
        vectors = gate.run(run_options, lambda options=run_options: encoder.encode(texts, options)[0])
        if vectors is not None:
            return vectors
    return None


def _load(path: Path, bundle_id: str, options: EncoderOptions, verify: bool) -> Predictor:
    predictor = Predictor(load_bundle(path, options, verify=verify))
    if predictor.bundle.bundle_id != bundle_id:
        raise ShadowLaneError(f"{path} now holds {predictor.bundle.bundle_id}, not the candidate {bundle_id}")
    return predictor
