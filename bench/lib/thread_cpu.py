"""A server's CPU by thread, from Linux's ``/proc``: the CPU each thread of a process (and of its
child processes) has run, read before and after a load, named by the Python thread that runs on
it.

``/proc/<pid>/task/<tid>/stat`` counts the CPU a thread actually ran (``utime + stime``), never
time waiting (for the GIL, a lock, a socket, or a core taken by another process): the split it
gives is one of CPU, not of samples. Its clock ticks are 10 ms, so where the kernel has it a
thread's CPU is read in nanoseconds from ``/proc/<pid>/task/<tid>/schedstat`` (its first field,
the same run time); the process's total, exited threads included, only ``stat`` has (in ticks).
schedstat also has the time a thread waited, runnable, for a core (on a machine busy with other
work, long) and the number of times it was put on one (a wake-up each: the hand-offs between
threads show there), both given per request beside the CPU.

Python 3.11 does not name its threads for the system (every thread's ``comm`` is the
process's), so the names come from ``py-spy dump`` (the Python thread each native thread id
runs); a thread without Python frames (ONNX Runtime's or OpenMP's pool, a Rust server's workers)
keeps its ``comm`` and is labelled ``native: <comm>``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# How deep child processes are followed (a server, its worker; bounded all the same).
MAX_DEPTH = 4
# The processes' CPU (ticks) minus their live threads' (ns): threads that ended in the window, and
# the ticks' rounding (at most two ticks a process, ± 20 ms, over a window)
EXITED = "other (exited threads, tick rounding)"
TICK_NS = 10**9 // os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class TaskStat:
    tid: int
    comm: str
    ticks: int  # utime + stime, in clock ticks
    ns: int = -1  # the same CPU in ns (schedstat), when read; -1: not read
    wait_ns: int = 0  # schedstat: ns runnable, waiting on a run queue for a core
    slices: int = 0  # schedstat: times put on a core


def parse_schedstat(stat: TaskStat, text: str) -> TaskStat:
    """``stat`` with its ``/proc/.../schedstat`` figures: ns on a core, ns waiting for one, slices."""
    run_ns, wait_ns, slices = (int(field) for field in text.split()[:3])
    return TaskStat(stat.tid, stat.comm, stat.ticks, run_ns, wait_ns, slices)


def cpu_ns(stat: TaskStat) -> int:
    """A thread's CPU in ns: its schedstat's, else its ticks'."""
    return stat.ns if stat.ns >= 0 else stat.ticks * TICK_NS


def parse_stat(line: str) -> TaskStat:
    """One ``/proc/.../stat`` line. ``comm`` sits between the first ``(`` and the *last* ``)``:
    it may itself hold spaces and parentheses (``"my (odd) thread"``); the fields after it hold
    neither."""
    head, close, rest = line.rpartition(")")
    tid, open_, comm = head.partition("(")
    if not close or not open_:
        raise ValueError(f"not a /proc stat line: {line[:80]!r}")
    fields = rest.split()  # fields[0] is the state (field 3 of proc(5)); utime and stime are 14 and 15
    return TaskStat(int(tid), comm, int(fields[11]) + int(fields[12]))


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except (FileNotFoundError, ProcessLookupError):  # the thread or process ended meanwhile
        return None


def processes(pid: int) -> list[int]:
    """``pid`` and its descendants (from ``/proc/<pid>/task/*/children``), at most :data:`MAX_DEPTH` deep."""
    found, level = [pid], [pid]
    for _ in range(MAX_DEPTH):
        following = []
        for parent in level:
            for tid in _tids(parent):
                children = _read(f"/proc/{parent}/task/{tid}/children") or ""
                following += [int(child) for child in children.split()]
        found += following
        level = following
    return found


def _tids(pid: int) -> list[int]:
    try:
        return [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class Snapshot:
    """The ticks of each process (its exited threads included) and of each live thread."""

    process_ticks: dict[int, int]
    threads: dict[int, TaskStat]

    @property
    def cpu_s(self) -> float:
        """The processes' CPU seconds so far (exited threads included; ticks)."""
        return sum(self.process_ticks.values()) * TICK_NS / 1e9

    def thread_s(self, tid: int) -> float:
        """Thread ``tid``'s CPU seconds so far (0 when it is not among the live threads)."""
        return cpu_ns(self.threads[tid]) / 1e9 if tid in self.threads else 0.0


def snapshot(pid: int, children: bool = True) -> Snapshot:
    """The CPU so far of ``pid`` (and its descendants) and of each of their live threads."""
    process_ticks, threads = {}, {}
    for proc in processes(pid) if children else [pid]:
        if (line := _read(f"/proc/{proc}/stat")) is None:
            continue
        process_ticks[proc] = parse_stat(line).ticks
        for tid in _tids(proc):
            if (line := _read(f"/proc/{proc}/task/{tid}/stat")) is not None:
                stat = parse_stat(line)
                if (sched := _read(f"/proc/{proc}/task/{tid}/schedstat")) is not None:
                    stat = parse_schedstat(stat, sched)
                threads[tid] = stat
    return Snapshot(process_ticks, threads)


def label(name: str) -> str:
    """A thread's row: its name with numbers folded (``xmcserve-encode-0`` and ``-1`` are one
    row, ``xmcserve-encode-*``), so rows match across servers and runs."""
    return re.sub(r"\d+", "*", name)


def deltas(before: Snapshot, after: Snapshot, names: dict[int, str]) -> dict[str, dict]:
    """What each row of threads ran between two snapshots: ``{label: {"threads": n, "cpu_s": s,
    "wait_s": s, "slices": n}}`` (CPU seconds, seconds waiting for a core, times put on one). A
    thread is named by ``names`` (native id → Python thread name), else ``native: <comm>``; one
    born in the window counts from zero; :data:`EXITED` is what the processes ran beyond their
    live threads (threads that ended in the window, and the rounding of the processes' ticks: it
    may be slightly negative). The rows' CPU sums to the processes' over the window."""
    rows: dict[str, dict] = {}
    live_ns = 0
    for tid, stat in after.threads.items():
        start = before.threads.get(tid)
        if start is None or cpu_ns(start) > cpu_ns(stat):  # born in the window, or its tid reused
            start = TaskStat(tid, stat.comm, 0, 0 if stat.ns >= 0 else -1)
        ns = cpu_ns(stat) - cpu_ns(start)
        live_ns += ns
        name = label(names[tid]) if tid in names else f"native: {stat.comm}"
        row = rows.setdefault(name, {"threads": 0, "ns": 0, "wait_ns": 0, "slices": 0})
        row["threads"] += 1
        row["ns"] += ns
        row["wait_ns"] += stat.wait_ns - start.wait_ns
        row["slices"] += stat.slices - start.slices
    process_ns = sum(t - before.process_ticks.get(p, 0) for p, t in after.process_ticks.items()) * TICK_NS
    rows[EXITED] = {"threads": None, "ns": process_ns - live_ns, "wait_ns": None, "slices": None}
    return {
        name: {
            "threads": row["threads"],
            "cpu_s": row["ns"] / 1e9,
            "wait_s": None if row["wait_ns"] is None else row["wait_ns"] / 1e9,
            "slices": row["slices"],
        }
        for name, row in rows.items()
    }


def per_request_us(rows: dict[str, dict], answered: int) -> dict[str, dict]:
    """:func:`deltas`' rows per answered request, largest CPU first: µs of CPU, µs waiting for a
    core, and times put on one."""
    answered = max(answered, 1)
    ordered = sorted(rows.items(), key=lambda item: -item[1]["cpu_s"])

    def per(value, scale: float, digits: int):
        return None if value is None else round(value * scale / answered, digits)

    return {
        name: {
            "threads": row["threads"],
            "cpu_us_per_request": per(row["cpu_s"], 1e6, 1),
            "runqueue_wait_us_per_request": per(row.get("wait_s"), 1e6, 1),
            "timeslices_per_request": per(row.get("slices"), 1, 2),
        }
        for name, row in ordered
    }


def py_spy() -> Path | None:
    """The py-spy beside this interpreter, or None when it is not installed."""
    path = Path(sys.executable).parent / "py-spy"
    return path if path.exists() else None


def parse_dump(text: str) -> dict[int, str]:
    """``py-spy dump --json``'s threads: native id → Python thread name."""
    names = {}
    for item in _flatten(json.loads(text)):
        if item.get("os_thread_id") is not None:
            names[int(item["os_thread_id"])] = item.get("thread_name") or f"thread {item['os_thread_id']}"
    return names


def _flatten(data) -> Iterable[dict]:
    for item in data if isinstance(data, list) else [data]:
        if isinstance(item, list):
            yield from _flatten(item)
        elif isinstance(item, dict):
            yield item


def thread_names(pid: int, timeout_s: float = 20) -> dict[int, str]:
    """Native thread id → Python thread name of the Python threads of ``pid`` and its child
    processes, from one ``py-spy dump`` each (not paused: ``--nonblocking``); empty without
    py-spy, and a process it fails on (not Python, say) adds none: those threads keep their
    ``comm``."""
    spy = py_spy()
    if spy is None:
        return {}
    names: dict[int, str] = {}
    for proc in processes(pid):
        command = [str(spy), "dump", "--pid", str(proc), "--json", "--nonblocking"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode == 0:
                names.update(parse_dump(done.stdout))
        except (subprocess.TimeoutExpired, json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return names
