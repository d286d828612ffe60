"""The in-process shadow yields to the primary: shadow work runs only while the primary is quiet.

The idle CPU class alone does not keep a co-located shadow off the primary's latency: an idle-class
process still computes on the core the primary's single-threaded stages (HTTP, tokenizer, HNSW)
leave free, and its model weights and activations evict the primary's from the shared caches
(measured: the primary's p99 x3.9 at half its peak with the shadow lane comparing half the copies).
So the shadow child also watches the primary's activity through shared memory:

* :class:`PrimaryActivity` (server process): HTTP requests in flight and when the last one ended,
  written by the event loop at every request's start and end (plain stores). While the shadow
  waits, an idle transition also arms a ``quiet_s`` timer on the loop, and a primary still idle
  when it fires wakes the shadow with a one-byte pipe write.
* :class:`PrimaryGate` (shadow child): a unit of shadow work starts only after the primary has had
  no request in flight for ``quiet_s``. Waiting costs the primary nothing: the child sleeps on the
  pipe until woken (a child that woke itself at every idle transition of a busy primary was
  preempted ~200 times a second). While a unit runs, a watcher thread at normal priority polls
  the activity and aborts the ONNX Runtime call through its ``RunOptions.terminate`` flag the
  moment a request arrives. The interrupted unit is computed again at the next quiet moment, or
  dropped as expired at its deadline.

This module imports nothing heavy: :func:`worker_entry` is the child's entry point, and it starts the
watcher and moves the rest of the process to the idle class *before* the child imports ONNX
Runtime and loads a bundle, so all of that runs idle-class too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from service.cpu_priority import pin_process, yield_cpu_process

T = TypeVar("T")

# How long the primary must have been without a request before a unit of shadow work starts.
# Requests of one burst arrive a few hundred microseconds apart: starting in such a gap would
# only be aborted again.
QUIET_S = 0.002
# How often the watcher looks at the primary while shadow work runs (its abort latency).
WATCH_INTERVAL_S = 0.0005
# A waiting shadow sleeps on the wake-up pipe; it also looks again this often, in case a wake-up
# crossed its going to sleep (the two sides' flags are plain stores, not a lock).
RECHECK_S = 0.25


@dataclass
class SharedActivity:
    """What the child maps (a ``Process`` argument under spawn: the values are shared memory, the
    connection's descriptor is duplicated into the child)."""

    in_flight: Any  # RawValue(c_int32): requests in flight
    quiet_since: Any  # RawValue(c_double): time.monotonic() when the last one ended
    waiting: Any  # RawValue(c_int32): 1 while the child sleeps until the primary is quiet
    wake: Connection  # read end of the wake-up pipe
    quiet_s: float = QUIET_S


class PrimaryActivity:
    """The serving process's requests in flight, in shared memory a spawned child can map.

    Only the event loop thread writes (``enter``/``leave``), so plain stores suffice; readers in
    other processes tolerate a stale or torn value (it only moves one scheduling decision).
    """

    def __init__(self, quiet_s: float = QUIET_S) -> None:
        context = multiprocessing.get_context("spawn")
        read_end, self._wake_fd = os.pipe()
        os.set_blocking(self._wake_fd, False)
        self.shared = SharedActivity(
            in_flight=context.RawValue(ctypes.c_int32, 0),
            quiet_since=context.RawValue(ctypes.c_double, time.monotonic()),
            waiting=context.RawValue(ctypes.c_int32, 0),
            wake=Connection(read_end, writable=False),
            quiet_s=quiet_s,
        )
        self._wake_timer: asyncio.TimerHandle | None = None

    def enter(self) -> None:
        self.shared.in_flight.value += 1

    def leave(self) -> None:
        shared = self.shared
        shared.in_flight.value -= 1
        if shared.in_flight.value <= 0:
            shared.quiet_since.value = time.monotonic()
            if shared.waiting.value and self._wake_timer is None:
                self._wake_when_quiet(shared.quiet_s)

    def _wake_when_quiet(self, delay_s: float) -> None:
        try:
            self._wake_timer = asyncio.get_running_loop().call_later(delay_s, self._wake_if_quiet)
        except RuntimeError:  # no event loop (a caller outside the server): wake now, it waits itself
            self._wake()

    def _wake_if_quiet(self) -> None:
        self._wake_timer = None
        shared = self.shared
        if shared.in_flight.value > 0:  # busy again: the next idle transition arms the timer
            return
        remaining = shared.quiet_since.value + shared.quiet_s - time.monotonic()
        if remaining > 0:
            self._wake_when_quiet(remaining)
        elif shared.waiting.value:
            self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            os.write(self._wake_fd, b"\0")

    @property
    def in_flight(self) -> int:
        return self.shared.in_flight.value


class PrimaryGate:
    """Child side. With ``shared=None`` (yielding off) every check passes and nothing is aborted."""

    def __init__(self, shared: SharedActivity | None, watch_interval_s: float = WATCH_INTERVAL_S):
        self._shared = shared
        self._in_flight = shared.in_flight if shared is not None else None
        self._quiet_since = shared.quiet_since if shared is not None else None
        if shared is not None:
            os.set_blocking(shared.wake.fileno(), False)
        self.quiet_s = shared.quiet_s if shared is not None else 0.0
        self._watch_interval_s = watch_interval_s
        self._run_options: Any = None
        self._running = threading.Event()
        self.interrupted = 0  # units aborted because the primary got a request
        self.watcher: threading.Thread | None = None
        if self._in_flight is not None:
            self.watcher = threading.Thread(target=self._watch, name="xmcserve-shadow-gate", daemon=True)
            self.watcher.start()

    @property
    def enabled(self) -> bool:
        return self._in_flight is not None

    def primary_busy(self) -> bool:
        return self._in_flight is not None and self._in_flight.value > 0

    def quiet(self) -> bool:
        """No primary request in flight, and none for ``quiet_s``."""
        if self._in_flight is None:
            return True
        return self._in_flight.value <= 0 and time.monotonic() - self._quiet_since.value >= self.quiet_s

    def wait_for_quiet(self, deadline: float) -> bool:
        """Block until the primary is quiet (True) or ``deadline`` (``time.monotonic``) passes (False)."""
        while not self.quiet():
            now = time.monotonic()
            if now >= deadline:
                return False
            if self._in_flight.value <= 0:  # idle now, not yet for quiet_s: this wait costs A nothing
                time.sleep(max(0.0, min(deadline, self._quiet_since.value + self.quiet_s) - now))
            else:
                self._sleep_until_woken(min(deadline - now, RECHECK_S))
        return True

    def _sleep_until_woken(self, timeout_s: float) -> None:
        shared = self._shared
        shared.waiting.value = 1
        try:
            if shared.in_flight.value > 0:  # looked at after raising the flag: leave() sees one or the other
                select.select([shared.wake.fileno()], [], [], max(0.0, timeout_s))
            try:
                while os.read(shared.wake.fileno(), 4096):
                    pass
            except BlockingIOError:
                pass
        finally:
            shared.waiting.value = 0

    def run(self, run_options: Any, work: Callable[[], T]) -> T | None:
        """``work()``, aborted through ``run_options.terminate`` (an ONNX Runtime ``RunOptions``
        that ``work`` passes to its session calls) if the primary gets a request meanwhile;
        None when it was aborted."""
        self._run_options = run_options
        self._running.set()
        try:
            return work()
        except Exception:
            if getattr(run_options, "terminate", False):
                self.interrupted += 1
                return None
            raise
        finally:
            self._running.clear()
            self._run_options = None

    def _watch(self) -> None:
        while True:
            self._running.wait()
            while self._running.is_set():
                options = self._run_options
                if options is not None and self._in_flight.value > 0:
                    options.terminate = True
                time.sleep(self._watch_interval_s)


def worker_entry(conn, results, activity: SharedActivity | None, spec: dict) -> None:
    """The shadow worker's entry point (``multiprocessing`` spawn target).

    The child first moves to its own cores when ``spec["cpus"]`` names them (so ONNX Runtime,
    loaded later, sizes its threads to them). The gate's watcher starts next and keeps the normal
    CPU class, which an unprivileged process could not get back once it had yielded; everything
    else, the imports of ONNX Runtime and the bundle load included, then runs in the idle class.
    """
    if spec.get("cpus"):
        pin_process(spec["cpus"])
    gate = PrimaryGate(activity)
    yield_cpu_process(keep={gate.watcher.native_id} if gate.watcher else ())
    from service.shadow_worker import worker_main

    worker_main(conn, results, gate, spec)
