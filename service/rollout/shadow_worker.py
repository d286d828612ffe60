"""The shadow worker's parent side: the handle of a child process that calls the remote shadow, off
the primary's process.

:class:`ShadowWorker`: copies from :class:`~service.rollout.shadow.ShadowMirror` are buffered and
written to the child in one non-blocking write per flush; the child's per-call results are read
when the event loop sees them and handed to the mirror. That is all the primary's process does
per mirrored request (an append, and a few histogram observations per call).

Child side: :func:`service.rollout.shadow_child.worker_main`, spawned fresh (it imports that
module and :mod:`service.rollout.shadow` only, never this one nor the engine).

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
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from service.rollout.shadow import Copy, ShadowConfig
from service.rollout.shadow_child import worker_main

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
