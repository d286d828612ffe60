"""Idle single-query latency of a served bundle: one client, sequential requests, loopback.

    python -m bench.idle_latency [--bundle bundles/default] [--requests 300] [--out bench/results/idle-latency.json]

Starts a real uvicorn process on 127.0.0.1, sends dev-split titles one at a time (k=10), and
reports client-side p50/p95/p99 plus the server's own per-stage medians (from /metrics is too
coarse, so the stages are timed in-process on the same texts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from loadtest.localserver import start_server, stop_server
from service.engine import Predictor, load_bundle
from xmc.data import load_jsonl_split


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    arr = np.asarray(samples_ms)
    return {f"p{q}": round(float(np.percentile(arr, q)), 2) for q in (50, 95, 99)} | {
        "mean": round(float(arr.mean()), 2)
    }


def http_latencies(url: str, texts: list[str], warmup: int = 20) -> list[float]:
    samples = []
    with httpx.Client(base_url=url, timeout=10) as client:
        for i, text in enumerate(texts):
            start = time.perf_counter()
            response = client.post("/predict", json={"text": text, "k": 10})
            elapsed = (time.perf_counter() - start) * 1000
            response.raise_for_status()
            if i >= warmup:
                samples.append(elapsed)
    return samples


def stage_medians(bundle_dir: Path, texts: list[str]) -> dict[str, float]:
    predictor = Predictor(load_bundle(bundle_dir))
    per_stage: dict[str, list[float]] = {}
    for text in texts:
        for stage, seconds in predictor.predict([text], k=10).times.as_dict().items():
            per_stage.setdefault(stage, []).append(seconds * 1000)
    return {stage: round(statistics.median(v), 3) for stage, v in per_stage.items()}


def measure(bundle_dir: Path, texts: list[str], server_log: Path) -> dict:
    """Client-side latency of ``texts`` sent one at a time to a served ``bundle_dir``, and the
    in-process stage medians on the first 200 of them."""
    server = start_server(bundle_dir, server_log)
    try:
        http_ms = http_latencies(server.url, texts)
    finally:
        stop_server(server)
    return {
        "requests": len(http_ms),
        "http_ms": percentiles(http_ms),
        "in_process_stage_median_ms": stage_medians(bundle_dir, texts[:200]),
    }


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
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
