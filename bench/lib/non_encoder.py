"""The null-encoder measurement (bench.non_encoder_cost's, and bench.serving's --null-encoder
part): each tree's server with its ONNX call replaced by a vector lookup
(bench.lib.null_encoder), held at a fixed open-loop rate for its CPU per request (the whole
process's, and its event loop thread's alone), loaded closed loop for its peak, and profiled by
stage.
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

from bench.lib.loadgen import closed_loop, open_loop
from bench.lib.null_encoder import VECTORS_ENV, write_vectors
from bench.lib.profiling import fold, loop_cpu_s, record, server_cpu_s
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


def cpu_per_request_us(
    url: str, bodies: list[bytes], rps: float, seconds: float, pid: int | None = None
) -> tuple[float, dict]:
    """The server's CPU µs per answered request at ``rps`` (open loop), and the load's summary;
    with ``pid`` (the server's process) the summary also has ``loop_cpu_us_per_request``: its
    main thread's, which runs uvicorn's event loop (granian's app runs in a worker process: its
    main thread's figure is not the loop's)."""
    cpu0, loop0 = server_cpu_s(url), loop_cpu_s(pid) if pid else 0.0
    row = asyncio.run(open_loop(url, bodies, rps, seconds)).summary()
    answered = max(row["ok"], 1)
    if pid:
        row["loop_cpu_us_per_request"] = round((loop_cpu_s(pid) - loop0) * 1e6 / answered, 1)
    return (server_cpu_s(url) - cpu0) * 1e6 / answered, row


def profile(server, bodies: list[bytes], rps: float, seconds: float, collapsed: Path) -> dict:
    """py-spy over ``server`` held at ``rps``: the shares of its CPU samples by stage."""
    record(server, bodies, rps, seconds, 250, collapsed, subprocesses=True)
    return fold(collapsed)


def measure(
    trees: dict[str, Path], bundle: Path, bodies: list[bytes], texts: list[str], args: argparse.Namespace
) -> dict:
    work = Path("/tmp/xmcserve-bench")
    work.mkdir(exist_ok=True)
    vectors = work / "null-vectors.npz"
    write_vectors(bundle, texts, vectors)
    extra_env = dict(item.split("=", 1) for item in args.env)
    servers = {}
    try:
        for name, tree in trees.items():
            servers[name] = start_null_server(tree, bundle, vectors, work / f"null-{name}.log", extra_env)
        for server in servers.values():
            asyncio.run(closed_loop(server.url, bodies, 8, 3.0))  # warm-up
        cpu_us: dict[str, list[float]] = {name: [] for name in trees}
        loop_us: dict[str, list[float]] = {name: [] for name in trees}
        peak: dict[str, list[float]] = {name: [] for name in trees}
        paced: dict[str, list[dict]] = {name: [] for name in trees}
        names = list(trees)
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                url, pid = servers[name].url, servers[name].process.pid
                us, row = cpu_per_request_us(url, bodies, args.rps, args.null_seconds, pid)
                cpu_us[name].append(round(us, 1))
                loop_us[name].append(row["loop_cpu_us_per_request"])
                paced[name].append(row)
                if args.cpu_only:
                    closed = None
                else:
                    closed = asyncio.run(closed_loop(url, bodies, args.null_concurrency, args.null_seconds)).summary()
                    peak[name].append(closed["qps"])
                line = {"round": round_, "tree": name, "cpu_us_per_request": us}
                print(json.dumps({**line, "loop_cpu_us_per_request": loop_us[name][-1], "peak_qps": closed}))
        profiles = {}
        for name, server in ({} if args.cpu_only else servers).items():
            share = profile(server, bodies, args.rps, args.null_seconds, work / f"null-{name}.txt")
            median_us = statistics.median(cpu_us[name])
            profiles[name] = {
                **share,
                "stage_cpu_us_per_request": {k: round(v * median_us, 1) for k, v in share["stages"].items()},
            }
    finally:
        for server in servers.values():
            stop_server(server)
    result = {
        "cpu_us_per_request": cpu_us,
        "median_cpu_us_per_request": {name: statistics.median(v) for name, v in cpu_us.items()},
        "loop_cpu_us_per_request": loop_us,
        "median_loop_cpu_us_per_request": {name: statistics.median(v) for name, v in loop_us.items()},
        "peak_qps": peak,
        "median_peak_qps": {name: statistics.median(v) for name, v in peak.items() if v},
        "paced": paced,
        "profiles": profiles,
    }
    if "baseline" in trees:
        median = result["median_cpu_us_per_request"]
        result["cpu_per_request_this_over_baseline"] = round(median["this"] / median["baseline"], 3)
        result["cpu_per_request_this_over_baseline_per_round"] = [
            round(a / b, 3) for a, b in zip(cpu_us["this"], cpu_us["baseline"], strict=True)
        ]
        loop = result["median_loop_cpu_us_per_request"]
        result["loop_cpu_per_request_this_over_baseline"] = round(loop["this"] / loop["baseline"], 3)
    return result


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
