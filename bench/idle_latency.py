"""Idle single-query latency of a served bundle: one client, sequential requests, loopback.

    python -m bench.idle_latency [--bundle bundles/default] [--requests 300] [--out bench/results/idle-latency.json]

Starts a real uvicorn process on 127.0.0.1, sends dev-split titles one at a time (k=10) on one
keep-alive connection, and reports client-side p50/p95/p99 beside the per-stage medians of the
same texts timed in-process (/metrics is too coarse) in the server's thread layout: back to back,
and after an idle gap as long as the HTTP p50, as each request of a lone client meets them. The
difference between the two is what waking from idle costs on this machine; what the HTTP p50
adds to the second is the server's own (HTTP, queue, hand-offs). The search steps are also timed
alone, back to back: what they cost when no encoder call runs between them.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.lib.args import bench_parser
from bench.lib.latency import measure
from xmc.data import load_jsonl_split
from xmc.results import machine, write_result


def main() -> None:
    parser = bench_parser(__doc__, "bench/results/idle-latency.json")
    parser.add_argument("--requests", type=int, default=300, help="single-text requests to time")
    args = parser.parse_args()
    texts = load_jsonl_split(args.data, "dev").texts[: args.requests]
    result = {
        "bundle": str(args.bundle),
        **measure(args.bundle, texts, Path("/tmp/xmcserve-bench-idle.log")),
        "machine": machine(),
    }
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
