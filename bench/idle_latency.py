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

import argparse
import json
import os
import platform
from pathlib import Path

from bench.lib.latency import measure
from xmc.data import load_jsonl_split
from xmc.results import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("bundles/default"), help="bundle to serve")
    parser.add_argument("--data", type=Path, default=Path("data/debian-sample"), help="dataset dir (its dev texts)")
    parser.add_argument("--requests", type=int, default=300, help="single-text requests to time")
    parser.add_argument("--out", type=Path, default=Path("bench/results/idle-latency.json"), help="result JSON")
    args = parser.parse_args()
    texts = load_jsonl_split(args.data, "dev").texts[: args.requests]
    result = {
        "bundle": str(args.bundle),
        **measure(args.bundle, texts, Path("/tmp/xmcserve-bench-idle.log")),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
