"""What a server process costs: its CPU seconds (from its /metrics), any server's CPU seconds
and peak resident memory with its children and one process's memory (from /proc: :func:`memory`),
and a py-spy profile of it under load,
folded by stage; that profile's samples also spread over each thread's own CPU
(:func:`stage_cpu_us`, the threads' CPU from :mod:`bench.lib.thread_cpu`).

py-spy records without ``--idle``, so it drops the samples of a thread the system shows asleep
(on a lock, the GIL, ``epoll``) or whose top frame is a known wait. A thread that is runnable
but waiting for a core (taken by another process on a busy machine) is still sampled, so the
shares of samples between threads are shares of time on or waiting for a core, not of CPU:
:func:`stage_cpu_us` uses the samples only to split each thread's own CPU between stages.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench.lib.thread_cpu import EXITED, label
from loadtest.loadgen import open_loop


def server_cpu_s(url: str) -> float:
    """The server process's CPU seconds so far (its ``process_cpu_seconds_total``)."""
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    raise RuntimeError("no process_cpu_seconds_total in /metrics")


OTHER = "http_asyncio_other"  # the stage of a sample no marker matched


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live process below it (Linux: ``/proc/<pid>/task/*/children``)."""
    pids, todo = [], [pid]
    while todo and len(pids) < 4096:
        current = todo.pop()
        pids.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in children.read_text().split())
            except OSError:  # the thread or the process ended meanwhile
                continue
    return pids


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) so far of one process, not its children (0 once gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) so far of ``pid`` and its live children."""
    return sum(process_cpu_s(member) for member in process_tree(pid))


def tree_peak_rss_mib(pid: int) -> float:
    """Peak resident memory (``VmHWM``) of ``pid`` and of its live children, summed, in MiB."""
    kib = 0
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return round(kib / 1024, 1)


def memory(pid: int | str = "self", unit: str = "mib", digits: int = 1) -> dict[str, float]:
    """Resident and peak-resident memory (``VmRSS``, ``VmHWM``) of one process, in MiB or GiB
    (``unit``): ``{"rss_<unit>": …, "peak_rss_<unit>": …}``."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    kib = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS:", "VmHWM:"))}
    scale = 2**10 if unit == "mib" else 2**20
    return {f"rss_{unit}": round(kib["VmRSS"] / scale, digits), f"peak_rss_{unit}": round(kib["VmHWM"] / scale, digits)}


def stage_of(stack: str) -> str:
    frames = stack.split(";")[::-1]
    for frame in frames:
        for stage, markers in STAGES:
            if any(m in frame for m in markers):
                return stage
    return OTHER


def fold(collapsed: Path) -> dict:
    leaves, stages, threads, total = Counter(), Counter(), Counter(), 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        leaves[stack.split(";")[-1]] += n
        stages[stage_of(stack)] += n
        threads[stack.split(";")[0]] += n

    def shares(counter: Counter, top: int) -> dict:
        return {k: round(v / max(total, 1), 4) for k, v in counter.most_common(top)}

    return {
        "samples": total,
        "stages": shares(stages, 20),
        "threads": shares(threads, 10),
        "leaves": shares(leaves, 25),
    }


# py-spy's thread frame with ``--threads``: ``thread (<native id>): <Python name>``
THREAD_FRAME = re.compile(r"thread \((\d+)\)(?:: (.*))?")
NATIVE = "native threads (no Python frames)"
UNSAMPLED = "threads never sampled"


def samples_by_thread(collapsed: Path) -> dict[str, dict]:
    """py-spy's collapsed samples per thread row (:func:`bench.lib.thread_cpu.label` of the
    thread's Python name, the rows of :func:`bench.lib.thread_cpu.deltas`): ``{row: {"stages":
    Counter, "leaves": Counter}}``, the leaves those of the samples of no stage (:data:`OTHER`)."""
    rows: dict[str, dict] = {}
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread = next((m for frame in frames[:2] if (m := THREAD_FRAME.fullmatch(frame))), None)
        name = label(thread.group(2) or f"thread {thread.group(1)}") if thread else "unknown thread"
        row = rows.setdefault(name, {"stages": Counter(), "leaves": Counter()})
        stage = stage_of(stack)
        row["stages"][stage] += int(count)
        if stage == OTHER:
            row["leaves"][frames[-1]] += int(count)
    return rows


def stage_cpu_us(thread_us: dict[str, float], samples: dict[str, dict], top_leaves: int = 12) -> dict:
    """Each thread row's CPU (µs per request, ``thread_us``) spread over the stages of its own
    samples, and summed by stage: µs of CPU per request per stage (``by_stage``), per thread and
    stage (``by_thread``), and the largest leaves of the unmatched stage (``other_leaves``). A
    row with CPU but no sample is a stage of its own (:data:`NATIVE` for a thread without Python,
    :data:`UNSAMPLED` for a Python thread py-spy never caught running, :data:`EXITED`)."""
    by_stage: Counter = Counter()
    leaves: Counter = Counter()
    by_thread: dict[str, dict] = {}
    for row, us in thread_us.items():
        counts = samples.get(row, {}).get("stages", Counter())
        total = sum(counts.values())
        if total == 0:
            stage = EXITED if row == EXITED else NATIVE if row.startswith("native: ") else UNSAMPLED
            split = {stage: us}
        else:
            split = {stage: us * n / total for stage, n in counts.items()}
            for leaf, n in samples[row]["leaves"].items():
                leaves[leaf] += us * n / total
        by_thread[row] = {stage: round(v, 1) for stage, v in sorted(split.items(), key=lambda kv: -kv[1])}
        by_stage.update(split)
    return {
        "by_stage": {stage: round(v, 1) for stage, v in by_stage.most_common()},
        "by_thread": by_thread,
        "other_leaves": {leaf: round(v, 1) for leaf, v in leaves.most_common(top_leaves)},
    }


def record(
    server, bodies: list[bytes], rps: float, seconds: float, rate: int, collapsed: Path, subprocesses: bool = False
) -> dict:
    """py-spy's collapsed stacks of ``server`` into ``collapsed`` while an open loop holds it at
    ``rps`` for ``seconds`` (whole seconds for py-spy); returns the load's summary. Raises
    ``RuntimeError`` when py-spy fails. ``subprocesses``: its child processes too (a server whose
    app runs in a worker process)."""
    py_spy = Path(sys.executable).parent / "py-spy"
    command = [str(py_spy), "record", "--pid", str(server.process.pid), "--duration", str(int(seconds))]
    command += ["--rate", str(rate), "--format", "raw", "--threads", "--nonblocking"]
    command += ["--subprocesses"] if subprocesses else []
    spy = subprocess.Popen([*command, "--output", str(collapsed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    load = asyncio.run(open_loop(server.url, bodies, rps, seconds)).summary()
    _, err = spy.communicate(timeout=seconds + 60)
    if spy.returncode != 0:
        raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
    return load


# A sample is charged to the first stage whose marker appears in its stack (innermost first).
STAGES = (
    ("onnx_run", ("Session.run (",)),
    ("hnsw_search", ("engine/index/", "Predictor.knn (")),
    ("rae_aggregate", ("rank (engine/search.py", "rae.py")),
    ("tokenize", ("encode_batch", "tokenize (engine/encoder.py")),
    ("response_json", ("to_response", "json/encoder.py", "predict_response")),
    ("request_parse", ("pydantic", "fastapi/routing.py", "fastapi/dependencies")),
    ("metrics", ("prometheus_client",)),
    ("batcher", ("engine/batcher.py",)),
    ("http_protocol", ("httptools_impl.py", "h11_impl.py", "/h11/", "protocols/http/")),
    ("middleware", ("service/observability/", "front_door.py", "guards.py", "RequestObserver", "starlette/")),
    ("endpoint", ("service/http/app.py",)),
)
