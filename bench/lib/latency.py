"""One request at a time against an idle server: the latency percentiles over HTTP and the medians
of the stages the server reports, timed in-process in the server's thread layout: back to back,
after an idle gap as long as a request takes over HTTP (as each of a lone client's requests meets
them), and the search steps alone, back to back, with no encoder call between them to take the
caches.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from engine import EncoderOptions, Predictor
from engine.offline import load_bundle
from loadtest.loadgen import Connection, encode_request
from loadtest.localserver import start_server, stop_server
from service.http.settings import Settings


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    arr = np.asarray(samples_ms)
    return {f"p{q}": round(float(np.percentile(arr, q)), 2) for q in (50, 95, 99)} | {
        "mean": round(float(arr.mean()), 2)
    }


def p50_p99_ms(seconds: list[float], digits: int = 2) -> dict[str, float]:
    """The median and 99th percentile of ``seconds``, in milliseconds."""
    ms = np.asarray(seconds) * 1000
    return {f"p{q}_ms": round(float(np.percentile(ms, q)), digits) for q in (50, 99)}


def http_latencies(url: str, texts: list[str], warmup: int = 20) -> list[float]:
    """Milliseconds of each request, one at a time on one keep-alive connection, sent by the
    light client the serving benchmark loads with (so the client's own cost stays small)."""
    bodies = [json.dumps({"text": text, "k": 10}).encode() for text in texts]
    return asyncio.run(_sequential(url, bodies))[warmup:]


async def _sequential(url: str, bodies: list[bytes]) -> list[float]:
    parts = urlsplit(url)
    connection = await Connection.open(parts.hostname, parts.port)
    samples = []
    try:
        for body in bodies:
            request = encode_request(parts.hostname, "/predict", body)
            start = time.perf_counter()
            status = await connection.send(request)
            samples.append((time.perf_counter() - start) * 1000)
            if status != 200:
                raise RuntimeError(f"/predict answered {status}")
    finally:
        connection.close()
    return samples


def served_predictor(bundle_dir: Path) -> Predictor:
    """The bundle's predictor with its encoder in the server's thread layout (its intra-op
    threads a call, ``XMCSERVE_*`` settings as the server reads them)."""
    _, threads = Settings().thread_layout()
    return Predictor(load_bundle(bundle_dir, EncoderOptions(intra_op_threads=threads)))


def stage_medians(predictor: Predictor, texts: list[str], idle_gap_s: float = 0.0, search_only: bool = False) -> dict:
    """Each stage's median over ``texts``, one at a time, with ``idle_gap_s`` of sleep before
    each. ``search_only``: the texts are encoded first, and only their searches are timed, back
    to back (the search's working set then stays in the caches the encoder's call would take)."""
    per_stage: dict[str, list[float]] = {}
    for text in texts[:20]:  # warm-up
        predictor.predict([text], k=10)
    encoded = [predictor.encode([text]) for text in texts] if search_only else []
    for i, text in enumerate(texts):
        if idle_gap_s:
            time.sleep(idle_gap_s)
        if search_only:
            vectors, _, terms = encoded[i]
            times = predictor.search(vectors, 10, texts=[text], terms=terms).times
        else:
            times = predictor.predict([text], k=10).times
        for stage, seconds in times.as_dict().items():
            if not (search_only and stage in ("tokenize", "encode")):
                per_stage.setdefault(stage, []).append(seconds * 1000)
    return {stage: round(statistics.median(v), 3) for stage, v in per_stage.items()}


def measure(bundle_dir: Path, texts: list[str], server_log: Path) -> dict:
    """Client-side latency of ``texts`` sent one at a time to a served ``bundle_dir``, and the
    in-process stage medians on the first 200 of them, back to back and after an idle gap of the
    HTTP p50 (``XMCSERVE_*`` settings as the server reads them)."""
    server = start_server(bundle_dir, server_log)
    try:
        http_ms = http_latencies(server.url, texts)
    finally:
        stop_server(server)
    http = percentiles(http_ms)
    gap_s = http["p50"] / 1000
    predictor = served_predictor(bundle_dir)
    tight = stage_medians(predictor, texts[:200])
    after_gap = stage_medians(predictor, texts[:200], idle_gap_s=gap_s)
    return {
        "requests": len(http_ms),
        "http_ms": http,
        "intra_op_threads": predictor.bundle.encoder.options.intra_op_threads,
        "cpus": len(os.sched_getaffinity(0)),
        "in_process_stage_median_ms": tight,
        "in_process_stage_median_ms_after_idle_gap": after_gap,
        # the search steps alone, back to back: what they cost while no encoder call runs between
        "in_process_search_only_median_ms": stage_medians(predictor, texts[:200], search_only=True),
        "idle_gap_ms": round(gap_s * 1000, 2),
        "in_process_total_ms": {
            "back_to_back": round(sum(tight.values()), 3),
            "after_idle_gap": round(sum(after_gap.values()), 3),
        },
    }
