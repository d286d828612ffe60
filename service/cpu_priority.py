"""Where and how urgently this process computes.

Yield the CPU to everything else: the OS's idle scheduling class for work that must never
compete with the primary's requests (the in-process shadow, a shadow server sharing a host).
Confine it to cores: the in-process shadow on cores of its own (:func:`pin_process`), and
ONNX Runtime sized to the cores a pinned process may use (:func:`confined_cpu_count`).

On Linux the policy is per thread and inherited by the threads a thread starts later (ONNX
Runtime's and hnswlib's), so calling :func:`yield_cpu` on a thread before it creates its
session covers all of its work. A ``SCHED_IDLE`` thread runs only on a core nothing else wants.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Collection
from typing import Literal

CpuPriority = Literal["normal", "idle"]


def yield_cpu(pid: int = 0) -> str:
    """Move a thread (the calling one by default; on Linux a pid names a process's main thread)
    to the lowest CPU priority this OS offers; returns which it got: ``idle`` (Linux
    ``SCHED_IDLE``), ``nice19`` (where only nice values exist) or ``normal``."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid or threading.get_native_id(), 19)
        return "nice19"
    except (AttributeError, OSError):
        return "normal"


def yield_cpu_process(keep: Collection[int] = ()) -> str:
    """:func:`yield_cpu` for every thread this process has (thread pools that numerical
    libraries started at import included) and, through inheritance, every later one, except the
    threads whose native ids are in ``keep`` (a watcher that must react at normal priority: an
    idle-class thread that wakes does not preempt a running one)."""
    got = yield_cpu()
    for tid in own_threads():
        if tid not in keep:
            yield_cpu(tid)
    return got


def own_threads() -> list[int]:
    """Native ids of this process's threads (Linux procfs; empty elsewhere: then the calling
    thread's own setting, inherited by later threads, is all a caller gets)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def thread_policy(native_id: int) -> str:
    """``idle`` or ``normal`` for a thread of this process (Linux), ``unknown`` elsewhere."""
    try:
        return "idle" if os.sched_getscheduler(native_id) == os.SCHED_IDLE else "normal"
    except (AttributeError, OSError):
        return "unknown"


def parse_cpus(text: str | None) -> set[int] | None:
    """``"0-1,4"`` → {0, 1, 4}; None or ``""`` → None (not pinned). A malformed list raises
    ValueError."""
    if not text or not text.strip():
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        first, last = int(low), int(high or low)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return cpus


def pin_process(cpus: Collection[int]) -> None:
    """Confine every thread of this process, and through inheritance every later one, to
    ``cpus`` (Linux; a no-op where the OS has no affinity call)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    os.sched_setaffinity(0, cpus)
    for tid in own_threads():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


def confined_cpu_count() -> int | None:
    """How many cores this process may run on, when that is fewer than the machine has (a
    ``taskset``, a cpuset container, :func:`pin_process`); None when it may use them all."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return allowed if allowed < (os.cpu_count() or allowed) else None
