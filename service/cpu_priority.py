"""Yield the CPU to everything else: the OS's idle scheduling class for work that must never
compete with the primary's requests (the in-process shadow, a shadow server sharing a host).

On Linux the policy is per thread and inherited by the threads a thread starts later (ONNX
Runtime's and hnswlib's), so calling :func:`yield_cpu` on a thread before it creates its
session covers all of its work. A ``SCHED_IDLE`` thread runs only on a core nothing else wants.
"""

from __future__ import annotations

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
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread (and its future children) only
        return got
    for tid in threads:
        if tid not in keep:
            yield_cpu(tid)
    return got


def thread_policy(native_id: int) -> str:
    """``idle`` or ``normal`` for a thread of this process (Linux), ``unknown`` elsewhere."""
    try:
        return "idle" if os.sched_getscheduler(native_id) == os.SCHED_IDLE else "normal"
    except (AttributeError, OSError):
        return "unknown"
