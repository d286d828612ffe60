"""The null-encoder measurement (studies.non_encoder_cost's, and bench.serving's --null-encoder
part): each tree's server with its ONNX call replaced by a vector lookup
(bench.lib.null_encoder), held at a fixed open-loop rate for its CPU per request (the whole
process's, its event loop thread's, each thread's: :mod:`bench.lib.thread_cpu`), loaded closed
loop for its peak, and profiled by stage (py-spy's samples spread over each thread's CPU).

In the same rounds, the floors (:mod:`bench.lib.floors`: a bare ASGI app and a bare FastAPI
route under the same uvicorn settings) are held at the same rate: what the stack costs with
nothing of ours. A tree's CPU per request minus a floor's, round by round, is its machinery.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench.lib.null_encoder import VECTORS_ENV, write_vectors
from bench.lib.profiling import fold, record, samples_by_thread, stage_cpu_us
from bench.lib.thread_cpu import deltas, per_request_us, py_spy, snapshot, thread_names
from loadtest.loadgen import closed_loop, open_loop
from loadtest.localserver import ROOT, start_server, stop_server
from xmc.data import load_jsonl_split

NULL_SERVER = ROOT / "bench" / "lib" / "null_encoder.py"


# This tree's app under granian (a Rust HTTP server for ASGI apps), one worker on uvloop, with
# its own header-read timeout and buffer cap standing in for the protocol's guards (it has no
# write timeout): a comparison, not a deployment.
GRANIAN = "granian"


def start_null_server(tree: Path, bundle: Path, vectors: Path, log_path: Path, extra_env: dict, timeout_s: float = 180):
    """``tree``'s server (its own ``service`` package) with the null encoder, and an append log
    directory of its own (two servers of one bundle cannot share its log). ``tree`` may be
    :data:`GRANIAN`: this tree's app under granian. ``timeout_s``: how long it may take to be ready."""
    appends = log_path.with_suffix(".appends")
    shutil.rmtree(appends, ignore_errors=True)
    source = ROOT if tree == GRANIAN else tree
    # the tree first, so its service package is the one served; the inherited path after it, so
    # packages installed outside the interpreter's site-packages (PYTHONPATH=<folder>) still import
    python_path = os.pathsep.join(p for p in (str(source), os.environ.get("PYTHONPATH", "")) if p)
    env = {**extra_env, VECTORS_ENV: str(vectors), "PYTHONPATH": python_path, "XMCSERVE_APPEND_LOG_DIR": str(appends)}
    command = [sys.executable, str(NULL_SERVER)]
    if tree == GRANIAN:
        command = [str(Path(sys.executable).parent / "granian"), "--interface", "asgi", "--factory", "--loop", "uvloop"]
        command += ["--http1-header-read-timeout", "10000", "--no-ws", "bench.lib.null_encoder:create_app"]
    return start_server(bundle.resolve(), log_path, extra_env=env, command=command, cwd=source, timeout_s=timeout_s)


# The floors (bench.lib.floors): the same uvicorn settings with nothing of ours, in the same rounds.
FLOORS = {"floor_asgi": "asgi", "floor_fastapi": "fastapi"}


def start_floor(kind: str, bundle: Path, log_path: Path, extra_env: dict, timeout_s: float = 60):
    """A floor app of :mod:`bench.lib.floors` (``asgi`` or ``fastapi``) on a free loopback port,
    this tree's, under ``extra_env`` (the ``XMCSERVE_*`` server settings it shares with ours)."""
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "bench.lib.floors", kind]
    env = {**extra_env, "PYTHONPATH": python_path}
    return start_server(bundle.resolve(), log_path, extra_env=env, command=command, cwd=ROOT, timeout_s=timeout_s)


def paced(server, bodies: list[bytes], rps: float, seconds: float, names: dict[int, str]) -> dict:
    """``server`` held at ``rps`` (open loop) for ``seconds``: the load's summary, with the CPU
    of its process (and child processes) per answered request (``cpu_us_per_request``), its main
    thread's (``loop_cpu_us_per_request``: uvicorn's event loop; granian's app runs in a worker
    process, so there the main thread is not the loop) and each thread row's (``threads``, rows
    named by ``names``: :func:`bench.lib.thread_cpu.deltas`), all from ``/proc``."""
    pid = server.process.pid
    before = snapshot(pid)
    row = asyncio.run(open_loop(server.url, bodies, rps, seconds)).summary()
    after = snapshot(pid)
    answered = max(row["ok"], 1)
    row["cpu_us_per_request"] = round((after.cpu_s - before.cpu_s) * 1e6 / answered, 1)
    row["loop_cpu_us_per_request"] = round((after.thread_s(pid) - before.thread_s(pid)) * 1e6 / answered, 1)
    row["threads"] = per_request_us(deltas(before, after, names), answered)
    return row


def profile(server, bodies: list[bytes], rps: float, seconds: float, collapsed: Path, names: dict[int, str]) -> dict:
    """py-spy over ``server`` held at ``rps`` (no idle samples): the shares of its samples by
    stage (:func:`bench.lib.profiling.fold`), and under ``cpu_split`` the CPU per request of
    each thread row in the same window (``/proc``) spread over its own samples' stages
    (:func:`bench.lib.profiling.stage_cpu_us`)."""
    pid = server.process.pid
    before = snapshot(pid)
    load = record(server, bodies, rps, seconds, 250, collapsed, subprocesses=True)
    after = snapshot(pid)
    answered = max(load["ok"], 1)
    threads = per_request_us(deltas(before, after, names), answered)
    thread_us = {row: values["cpu_us_per_request"] for row, values in threads.items()}
    return {
        **fold(collapsed),
        "cpu_split": {
            "answered": load["ok"],
            "cpu_us_per_request": round((after.cpu_s - before.cpu_s) * 1e6 / answered, 1),
            "threads": threads,
            **stage_cpu_us(thread_us, samples_by_thread(collapsed)),
        },
    }


def measure(
    trees: dict[str, Path], bundle: Path, bodies: list[bytes], texts: list[str], args: argparse.Namespace
) -> dict:
    work = Path("/tmp/xmcserve-bench")
    work.mkdir(exist_ok=True)
    vectors = work / "null-vectors.npz"
    write_vectors(bundle, texts, vectors)
    extra_env = dict(item.split("=", 1) for item in args.env)
    floors = {} if args.no_floors else FLOORS
    servers = {}
    try:
        for name, tree in trees.items():
            servers[name] = start_null_server(tree, bundle, vectors, work / f"null-{name}.log", extra_env)
        for name, kind in floors.items():
            servers[name] = start_floor(kind, bundle, work / f"{name}.log", extra_env)
        for server in servers.values():
            asyncio.run(closed_loop(server.url, bodies, 8, 3.0))  # warm-up
        names = {name: thread_names(server.process.pid) for name, server in servers.items()}
        rounds: dict[str, list[dict]] = {name: [] for name in servers}
        peak: dict[str, list[float]] = {name: [] for name in trees}
        order_base = list(servers)
        for round_ in range(args.rounds):
            order = order_base[round_ % len(order_base) :] + order_base[: round_ % len(order_base)]
            for name in order:
                row = paced(servers[name], bodies, args.rps, args.null_seconds, names[name])
                rounds[name].append(row)
                closed = None
                if name in trees and not args.cpu_only:  # the floors' peak would be the load generator's
                    closed = asyncio.run(
                        closed_loop(servers[name].url, bodies, args.null_concurrency, args.null_seconds)
                    )
                    closed = closed.summary()
                    peak[name].append(closed["qps"])
                line = {"round": round_, "server": name, "cpu_us_per_request": row["cpu_us_per_request"]}
                line["loop_cpu_us_per_request"] = row["loop_cpu_us_per_request"]
                print(json.dumps({**line, "peak_qps": closed and closed["qps"]}), flush=True)
        for name, server in servers.items():  # threads started since the first look
            names[name] = {**names[name], **thread_names(server.process.pid)}
        profiles = {}
        for name, server in ({} if args.cpu_only or py_spy() is None else servers).items():
            if name in floors:
                continue
            share = profile(server, bodies, args.rps, args.null_seconds, work / f"null-{name}.txt", names[name])
            median_us = statistics.median(r["cpu_us_per_request"] for r in rounds[name])
            profiles[name] = {
                **share,
                # the old split: the shares of all samples times the rounds' median CPU (kept for
                # comparison with earlier results; cpu_split is the one by each thread's own CPU)
                "stage_cpu_us_per_request": {k: round(v * median_us, 1) for k, v in share["stages"].items()},
            }
    finally:
        for server in servers.values():
            stop_server(server)
    result = report(rounds, peak, list(trees), list(floors))
    result["profiles"] = profiles
    result["py_spy"] = str(py_spy()) if py_spy() else "not installed: no profile, threads named by comm"
    return result


def report(rounds: dict[str, list[dict]], peak: dict[str, list[float]], trees: list[str], floors: list[str]) -> dict:
    """The figures of the rounds: per server (trees and floors) the CPU per request of each
    round and its median, the loop thread's, each thread row's median; each tree's machinery
    (its CPU per request minus a floor's, round by round, and the median of those differences,
    for the process and for the loop thread); this tree against the baseline."""
    cpu_us = {name: [r["cpu_us_per_request"] for r in rows] for name, rows in rounds.items()}
    loop_us = {name: [r["loop_cpu_us_per_request"] for r in rows] for name, rows in rounds.items()}
    result = {
        "cpu_source": "/proc: the process's (and its children's) utime + stime, each thread's schedstat run time",
        "cpu_us_per_request": cpu_us,
        "median_cpu_us_per_request": {name: statistics.median(v) for name, v in cpu_us.items()},
        "loop_cpu_us_per_request": loop_us,
        "median_loop_cpu_us_per_request": {name: statistics.median(v) for name, v in loop_us.items()},
        "median_thread_cpu_us_per_request": {name: median_threads(rows) for name, rows in rounds.items()},
        "peak_qps": peak,
        "median_peak_qps": {name: statistics.median(v) for name, v in peak.items() if v},
        "paced": {
            name: [{k: v for k, v in r.items() if k != "threads"} for r in rows] for name, rows in rounds.items()
        },
        "thread_cpu_us_per_request": {name: [r["threads"] for r in rows] for name, rows in rounds.items()},
    }
    if floors:
        result["floors"] = {
            "floor_asgi": "a bare ASGI callable: the body read, a fixed JSON answered (bench.lib.floors)",
            "floor_fastapi": "one FastAPI @app.post route: the body awaited, fixed orjson bytes returned",
            "served_by": "uvicorn with python -m service.http's options, uvicorn's plain httptools protocol",
        }
        result["machinery_cpu_us_per_request"] = machinery(cpu_us, trees, floors)
        result["machinery_loop_cpu_us_per_request"] = machinery(loop_us, trees, floors)
    if "baseline" in trees:
        median = result["median_cpu_us_per_request"]
        result["cpu_per_request_this_over_baseline"] = round(median["this"] / median["baseline"], 3)
        result["cpu_per_request_this_over_baseline_per_round"] = [
            round(a / b, 3) for a, b in zip(cpu_us["this"], cpu_us["baseline"], strict=True)
        ]
        loop = result["median_loop_cpu_us_per_request"]
        result["loop_cpu_per_request_this_over_baseline"] = round(loop["this"] / loop["baseline"], 3)
        result["cpu_us_per_request_this_minus_baseline"] = difference(cpu_us["this"], cpu_us["baseline"])
    return result


def difference(ours: list[float], floor: list[float]) -> dict:
    """Round by round ``ours - floor`` and the median of those differences."""
    per_round = [round(a - b, 1) for a, b in zip(ours, floor, strict=True)]
    return {"per_round": per_round, "median": round(statistics.median(per_round), 1)}


def machinery(us: dict[str, list[float]], trees: list[str], floors: list[str]) -> dict:
    """Each tree's figure minus each floor's, round by round (:func:`difference`)."""
    return {tree: {f"over_{floor}": difference(us[tree], us[floor]) for floor in floors} for tree in trees}


THREAD_FIGURES = ("cpu_us_per_request", "runqueue_wait_us_per_request", "timeslices_per_request")


def median_threads(rows: list[dict]) -> dict:
    """Per thread row, the median over the rounds of each of its figures per request (0 in a
    round without it; None where no round has it) and its largest thread count, largest CPU
    first."""
    names = {name for row in rows for name in row["threads"]}
    medians = {}
    for name in names:
        counts = [row["threads"][name]["threads"] for row in rows if name in row["threads"]]
        counts = [c for c in counts if c is not None]
        medians[name] = {"threads": max(counts) if counts else None}
        for figure in THREAD_FIGURES:
            values = [row["threads"].get(name, {}).get(figure, 0.0) for row in rows]
            known = [v for v in values if v is not None]
            medians[name][figure] = round(statistics.median(known), 2) if len(known) == len(values) else None
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]["cpu_us_per_request"]))


def add_arguments(parser: argparse.ArgumentParser, rounds: bool = True) -> None:
    """The options of this measurement (``rounds``: also ``--rounds``, which bench.serving has)."""
    parser.add_argument("--baseline-tree", type=Path, default=None, help="a checkout of the code to compare with")
    parser.add_argument(
        "--granian", action="store_true", help="also serve this tree's app under granian (a comparison)"
    )
    parser.add_argument("--rps", type=float, default=150.0, help="the fixed open-loop rate the CPU is measured at")
    parser.add_argument("--null-seconds", type=float, default=10.0, help="seconds of each load")
    parser.add_argument(
        "--null-concurrency", type=int, default=64, help="closed-loop concurrency of the null-encoder peak"
    )
    parser.add_argument(
        "--cpu-only",
        action="store_true",
        help="only the CPU per request at the fixed rate: no closed-loop peak, no py-spy profile",
    )
    parser.add_argument(
        "--no-floors",
        action="store_true",
        help="without the floors (a bare ASGI app and a bare FastAPI route under the same uvicorn settings)",
    )
    if rounds:
        parser.add_argument("--rounds", type=int, default=3, help="rounds over the trees (order rotated each round)")


def run(args: argparse.Namespace, bundle: Path, data: Path) -> dict:
    texts = load_jsonl_split(data, "dev").texts
    bodies = [json.dumps({"text": t, "k": 10}).encode() for t in texts]
    trees = {"this": ROOT}
    if args.baseline_tree is not None:
        trees["baseline"] = args.baseline_tree.resolve()
    if args.granian:
        trees["granian"] = GRANIAN
    return {
        "what": "the server with its ONNX call replaced by a vector lookup (bench.lib.null_encoder)",
        "trees": {name: str(tree) for name, tree in trees.items()},
        "this_commit": git_head(ROOT),
        "baseline_commit": git_head(args.baseline_tree) if args.baseline_tree else None,
        "rps": args.rps,
        "seconds_per_load": args.null_seconds,
        "rounds": args.rounds,
        "concurrency": args.null_concurrency,
        **measure(trees, bundle, bodies, texts, args),
    }


def git_head(tree: Path) -> str | None:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None
