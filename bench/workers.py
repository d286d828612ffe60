"""One bundle served by 1 and by N worker processes (``XMCSERVE_WORKERS``), in turns, in one run.

    python -m bench.workers [--bundle bundles/default] [--workers 1,2] [--rounds 3] [--seconds 10]
                            [--out bench/results/serving-workers.json]

Each round starts a server per worker count (in turn, the order alternating between rounds, so
drift on a shared machine falls on both) and measures its idle p50 (one connection, sequential
requests) and its closed-loop peak (``--concurrency`` connections, new ones for each load, so the
kernel deals them over the workers). The servers get the documented defaults, each worker its
share of the cores (``XMCSERVE_INTRA_OP_THREADS`` / batch workers from ``cores // workers``).
The JSON has every round and the medians, and each count's peak and idle p50 as a ratio of the
first count's. Issue 56's check on a 2-core machine: 2 processes do not lose against 1.

``--null-encoder``: the servers' ONNX call replaced by a lookup of the texts' vectors
(:mod:`bench.lib.null_encoder`): the most any encoder could let that many processes answer, what
the machinery alone allows.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.lib.args import bench_parser
from bench.lib.non_encoder import start_null_server
from bench.lib.null_encoder import write_vectors
from loadtest.loadgen import closed_loop
from loadtest.localserver import ROOT, start_server, stop_server
from xmc.data import load_jsonl_split
from xmc.results import write_result


@dataclass(frozen=True)
class WorkersBenchParams:
    """bundle: the bundle served; data: the split whose texts are sent (dev); workers: the counts
    compared, the first the reference; rounds: times each count is measured; seconds: each peak
    load; concurrency: its connections; idle_requests: sequential requests of the idle p50;
    start_timeout_s: how long a server may take to have every worker ready."""

    bundle: Path = Path("bundles/default")
    data: Path = Path("data/debian-sample")
    workers: tuple[int, ...] = (1, 2)
    rounds: int = 3
    seconds: float = 10.0
    concurrency: int = 32
    idle_requests: int = 300
    texts: int = 512
    start_timeout_s: float = 300.0
    null_encoder: bool = False


def bodies_of(params: WorkersBenchParams) -> list[bytes]:
    split = "dev" if (params.data / "dev.json.gz").exists() else "trn"
    texts = load_jsonl_split(params.data, split).texts[: params.texts]
    return [json.dumps({"text": text, "k": 10}).encode() for text in texts]


def start(params: WorkersBenchParams, workers: int, log_dir: Path, vectors: Path | None = None):
    """A server of ``workers`` processes (with the null encoder when ``vectors`` is given), returned
    once every worker serves."""
    run_dir = log_dir / f"run-{workers}"
    env = {"XMCSERVE_WORKERS": str(workers), "XMCSERVE_RUN_DIR": str(run_dir), "XMCSERVE_LOG_ACCESS": "false"}
    log_path = log_dir / f"server-{workers}.log"
    if vectors is not None:
        server = start_null_server(ROOT, params.bundle, vectors, log_path, env, timeout_s=params.start_timeout_s)
    else:
        server = start_server(params.bundle, log_path, extra_env=env, timeout_s=params.start_timeout_s)
    deadline = time.monotonic() + params.start_timeout_s
    # every worker up, not only the first to answer /readyz
    while workers > 1 and len(list((run_dir / "acks").glob("[0-9]*"))) < workers:
        if time.monotonic() > deadline:
            stop_server(server)
            raise TimeoutError(f"{workers} workers not all up within {params.start_timeout_s} s: {log_path}")
        time.sleep(0.2)
    return server


def measure(params: WorkersBenchParams, url: str, bodies: list[bytes]) -> dict:
    idle = asyncio.run(closed_loop(url, bodies, 1, 60.0, max_requests=params.idle_requests))
    asyncio.run(closed_loop(url, bodies, params.concurrency, 2.0))  # warm-up: every worker's pools
    peak = asyncio.run(closed_loop(url, bodies, params.concurrency, params.seconds))
    ok = peak.statuses.get(200, 0)
    return {
        "idle_p50_ms": round(float(np.percentile(idle.latencies_ms, 50)), 3),
        "peak_qps": round(ok / peak.seconds, 1),
        "peak_p99_ms": round(float(np.percentile(peak.latencies_ms, 99)), 2),
        "non_200": {str(s): n for s, n in peak.statuses.items() if s != 200},
        "client_errors": peak.errors + idle.errors,
    }


def run(params: WorkersBenchParams, log_dir: Path) -> dict:
    bodies = bodies_of(params)
    vectors = None
    if params.null_encoder:
        vectors = log_dir / "vectors.npz"
        write_vectors(params.bundle, [json.loads(b)["text"] for b in bodies], vectors)
    rounds: list[dict] = []
    for round_ in range(params.rounds):
        order = params.workers if round_ % 2 == 0 else tuple(reversed(params.workers))
        row = {}
        for workers in order:
            server = start(params, workers, log_dir, vectors)
            try:
                row[str(workers)] = measure(params, server.url, bodies)
            finally:
                stop_server(server)
        rounds.append(row)
        print(f"round {round_ + 1}: {json.dumps(row)}", file=sys.stderr)
    reference = str(params.workers[0])
    medians = {
        str(w): {
            key: statistics.median(r[str(w)][key] for r in rounds) for key in ("idle_p50_ms", "peak_qps", "peak_p99_ms")
        }
        for w in params.workers
    }
    ratios = {
        w: {
            "peak_qps": round(m["peak_qps"] / medians[reference]["peak_qps"], 3),
            "idle_p50_ms": round(m["idle_p50_ms"] / medians[reference]["idle_p50_ms"], 3),
        }
        for w, m in medians.items()
    }
    return {"rounds": rounds, "median": medians, "ratio_to_first": ratios}


def main(argv: list[str] | None = None) -> None:
    defaults = WorkersBenchParams()
    parser = bench_parser(__doc__, "bench/results/serving-workers.json", bundle=defaults.bundle, data=defaults.data)
    parser.add_argument("--workers", default=",".join(map(str, defaults.workers)), help="worker counts, first = 1x")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="times each count is measured")
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="each peak load's length")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="peak load connections")
    parser.add_argument("--idle-requests", type=int, default=defaults.idle_requests, help="requests of the idle p50")
    parser.add_argument("--null-encoder", action="store_true", help="the ONNX call replaced by a lookup")
    args = parser.parse_args(argv)
    params = WorkersBenchParams(
        bundle=args.bundle,
        data=args.data,
        workers=tuple(int(w) for w in args.workers.split(",")),
        rounds=args.rounds,
        seconds=args.seconds,
        concurrency=args.concurrency,
        idle_requests=args.idle_requests,
        null_encoder=args.null_encoder,
    )
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as log_dir:
        result = run(params, Path(log_dir))
    result = {
        "benchmark": "bench.workers",
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(params).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "processor": platform.processor(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        **result,
    }
    write_result(args.out, result)
    print(json.dumps({"median": result["median"], "ratio_to_first": result["ratio_to_first"]}, indent=2))


if __name__ == "__main__":
    main()
