"""Overload benchmark: open-loop load at 100 % and 150 % of the server's measured peak.

    python -m bench.overload [--bundle bundles/default] [--seconds 20] [--out bench/results/overload.json]

One server, one run: the idle p50 (one client, sequential), the closed-loop peak (32
connections), then open-loop phases at each ``--loads`` share of the peak, with the server's
default deadline (``XMCSERVE_REQUEST_TIMEOUT_MS``) and again with each ``--timeouts-ms`` sent
as the requests' own ``timeout_ms``. Per phase: accepted
(200) p50/p99 from each request's scheduled send, the refused fraction by status, how long the
server took to answer a refusal (from the actual send), and the server's RSS after the phase.
Targets (issue "Hardening"): at 150 %, accepted p99 <= 20 x the idle p50, every refusal a 429 or
503 answered within a couple of milliseconds, RSS flat.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np

from bench.lib.args import bench_parser
from bench.lib.profiling import memory
from loadtest.loadgen import closed_loop, open_loop
from loadtest.localserver import start_server, stop_server
from xmc.data import load_jsonl_split
from xmc.results import machine, write_result

REFUSALS = (429, 503)


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def phase_summary(result, pid: int) -> dict:
    total = sum(result.statuses.values()) + result.errors
    accepted = result.latencies_by_status.get(200, [])
    refusal_service = [ms for status in REFUSALS for ms in result.service_ms_by_status.get(status, [])]
    return {
        "offered_rps": result.target_rps,
        "requests": total,
        "accepted": len(accepted),
        "accepted_qps": round(len(accepted) / result.seconds, 1),
        "accepted_p50_ms": pct(accepted, 50),
        "accepted_p99_ms": pct(accepted, 99),
        "refused_share_by_status": {
            str(status): round(count / total, 4) for status, count in sorted(result.statuses.items()) if status != 200
        },
        "client_errors": result.errors,
        "refusal_server_ms_p50": pct(refusal_service, 50),
        "refusal_server_ms_p99": pct(refusal_service, 99),
        "refusal_server_ms_max": round(max(refusal_service), 2) if refusal_service else None,
        **memory(pid),
    }


def main() -> None:
    parser = bench_parser(__doc__, "bench/results/overload.json")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each open-loop phase")
    parser.add_argument("--loads", default="1.0,1.5", help="open-loop phases as shares of the peak")
    parser.add_argument(
        "--timeouts-ms", default="100", help="request deadlines (timeout_ms in the body) to run each load with too"
    )
    args = parser.parse_args()
    texts = load_jsonl_split(args.data, "dev").texts
    bodies = [json.dumps({"text": t, "k": 10}).encode() for t in texts]
    deadlines = [None] + [int(x) for x in args.timeouts_ms.split(",") if x]
    server = start_server(args.bundle, Path("/tmp/xmcserve-bench-overload.log"))
    pid = server.process.pid
    try:
        asyncio.run(closed_loop(server.url, bodies, 4, 3.0))  # warm-up
        idle = asyncio.run(closed_loop(server.url, bodies, 1, 10.0)).summary()
        peak = asyncio.run(closed_loop(server.url, bodies, 32, 10.0)).summary()["qps"]
        before = memory(pid)
        phases = {}
        for deadline in deadlines:
            with_deadline = (
                bodies
                if deadline is None
                else [json.dumps({"text": t, "k": 10, "timeout_ms": deadline}).encode() for t in texts]
            )
            for share in (float(x) for x in args.loads.split(",")):
                time.sleep(2.0)  # let the last phase's queue drain
                result = asyncio.run(open_loop(server.url, with_deadline, share * peak, args.seconds, 1024))
                name = f"{round(share * 100)}%" + (f" timeout_ms={deadline}" if deadline else " default deadline")
                phases[name] = phase_summary(result, pid)
                print(name, json.dumps(phases[name]), flush=True)
    finally:
        stop_server(server)
    highest = max(float(name.split("%")[0]) for name in phases)
    at_highest = {name: phase for name, phase in phases.items() if float(name.split("%")[0]) == highest}
    out = {
        "bundle": str(args.bundle),
        "machine": machine(),
        "idle_p50_ms": idle["p50_ms"],
        "peak_qps": peak,
        "rss_before": before,
        "phases": phases,
        "ratios": {
            f"accepted_p99_over_idle_p50 at {name}": round(phase["accepted_p99_ms"] / idle["p50_ms"], 2)
            for name, phase in at_highest.items()
        }
        | {"rss_growth_mib": round(max(p["rss_mib"] for p in phases.values()) - before["rss_mib"], 1)},
        "targets": {
            "accepted_p99_over_idle_p50_max": 20,
            "met_tail": {name: phase["accepted_p99_ms"] / idle["p50_ms"] <= 20 for name, phase in at_highest.items()},
            "refusals_only_429_503": all(
                status in ("429", "503") for phase in phases.values() for status in phase["refused_share_by_status"]
            ),
        },
    }
    write_result(args.out, out)
    print(json.dumps(out["ratios"] | out["targets"], indent=2))


if __name__ == "__main__":
    main()
