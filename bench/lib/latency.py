"""One request at a time against an idle server: the latency percentiles over HTTP and the medians
of the stages the server reports.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from loadtest.localserver import start_server, stop_server
from service.engine import Predictor, load_bundle


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
