"""What a live memory buys, and what appending costs the traffic it serves.

    python -m studies.live_memory --bundle bundles/default [--bundle bundles/trained] \\
        [--data ../shared/data/debian-related] [--out bench/results/live-memory.json]

Debian-Related dev is split into two seeded halves, A and B. Per bundle, in one run:

1. **Quality.** The four headline metrics on half B (both filter protocols), then half A's
   instances are appended (in calls of ``--batch``; labels of theirs the memory lacks are added
   in the same call with their texts), then half B again. Appends/s in process.
2. **Compaction.** The grown memory folded into a fresh bundle (``export.compact``): key
   recall@10 of the grown and of the rebuilt HNSW graph against exact search, on half B.
3. **Traffic during appends.** The bundle served over HTTP; /predict (half B texts) open-loop at
   ``--load`` of the measured peak, first alone, then while half A is appended through
   ``/admin/append``: p50/p99 of /predict in each phase, the non-200 count, appends/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from engine import AppendBatch, load_predictor
from engine.offline import key_recall_at_10, load_labels
from export.compact import compact_bundle
from loadtest.loadgen import closed_loop, open_loop
from loadtest.localserver import start_server, stop_server
from xmc.data import XMCDataset, load_jsonl_split
from xmc.evaluate import evaluate_predictor
from xmc.metrics import HEADLINE
from xmc.results import machine, write_result

TOKEN = "bench-live-memory"


def halves(dev: XMCDataset, seed: int) -> tuple[XMCDataset, XMCDataset]:
    order = np.random.default_rng(seed).permutation(len(dev))
    middle = len(dev) // 2
    return dev.subset(np.sort(order[:middle])), dev.subset(np.sort(order[middle:]))


def append_batches(bundle_uids: list[str], half: XMCDataset, batch: int) -> list[AppendBatch]:
    """Half A's instances as append calls; each call also adds the labels of its instances that
    the bundle (or an earlier call) lacks."""
    known, calls = set(bundle_uids), []
    uids, texts = half.labels.uids, half.labels.texts
    for start in range(0, len(half), batch):
        rows = range(start, min(start + batch, len(half)))
        instances, labels = [], []
        for r in rows:
            row_labels = [uids[j] for j in half.Y[r].indices]
            if not row_labels:
                continue
            for j in half.Y[r].indices:
                if uids[j] not in known:
                    known.add(uids[j])
                    labels.append((uids[j], texts[j]))
            instances.append((half.texts[r], row_labels))
        calls.append(AppendBatch(labels=labels, instances=instances))
    return calls


def headline(result: dict) -> dict:
    pick = lambda metrics: {name: metrics[name] for name in HEADLINE if name in metrics}  # noqa: E731
    return {"filter_after": pick(result["metrics"]), "exclude_before": pick(result["metrics_exclude_before"])}


def quality_phase(bundle: Path, train: XMCDataset, calls: list[AppendBatch], half_b, workdir: Path) -> dict:
    predictor = load_predictor(bundle, appends_dir=workdir / "appends")
    before = evaluate_predictor(predictor, half_b, train, k=100)
    started = time.perf_counter()
    for call in calls:
        predictor.append(call)
    seconds = time.perf_counter() - started
    after = evaluate_predictor(predictor, half_b, train, k=100)
    view = predictor.view
    compacted_dir = workdir / "compacted"
    compact_started = time.perf_counter()
    compact_bundle(bundle, compacted_dir, appends_dir=workdir / "appends")
    compact_seconds = time.perf_counter() - compact_started
    compacted = load_predictor(compacted_dir)
    queries = np.concatenate(
        [predictor.bundle.encoder.encode(half_b.texts[i : i + 256])[0] for i in range(0, len(half_b), 256)]
    )
    return {
        "bundle_id": predictor.bundle.bundle_id,
        "half_b_before": headline(before),
        "half_b_after": headline(after),
        "appended": {"calls": len(calls), "instances": view.appended_instances, "labels": view.appended_labels},
        "in_process_appends_seconds": round(seconds, 1),
        "in_process_instances_per_s": round(view.appended_instances / seconds, 1),
        "compaction_seconds": round(compact_seconds, 1),
        "key_recall_at_10": {
            "grown": key_recall_at_10(predictor, queries),
            "rebuilt": key_recall_at_10(compacted, queries),
        },
    }


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def summary(result) -> dict:
    accepted = result.latencies_by_status.get(200, [])
    refused = sum(count for status, count in result.statuses.items() if status != 200) + result.errors
    return {
        "requests": len(accepted) + refused,
        "non_200": refused,
        "p50_ms": pct(accepted, 50),
        "p99_ms": pct(accepted, 99),
    }


def traffic_phase(bundle: Path, calls: list[AppendBatch], half_b, load: float, seconds: float, workdir: Path) -> dict:
    env = {
        "XMCSERVE_ADMIN_TOKEN": TOKEN,
        "XMCSERVE_APPEND_LOG_DIR": str(workdir / "http-appends"),
        "XMCSERVE_BUNDLE_ROOT": str(bundle.parent),
    }
    server = start_server(bundle, workdir / "server.log", extra_env=env)
    bodies = [json.dumps({"text": text, "k": 10}).encode() for text in half_b.texts[:512]]
    try:
        peak = asyncio.run(closed_loop(f"{server.url}/predict", bodies, concurrency=8, seconds=8))
        peak_qps = peak.summary()["qps"]
        rate = load * peak_qps
        alone = asyncio.run(open_loop(f"{server.url}/predict", bodies, rps=rate, seconds=seconds))
        with httpx.Client(base_url=server.url, headers={"X-Admin-Token": TOKEN}, timeout=120) as client:
            view = client.get("/info").json()["routing"]["variants"]["A"]["memory"]
        appended = {"instances": 0, "calls": 0, "seconds": 0.0, "failures": 0}
        appender = threading.Thread(target=_append_over_http, args=(server.url, calls, seconds, appended))
        appender.start()
        during = asyncio.run(open_loop(f"{server.url}/predict", bodies, rps=rate, seconds=seconds))
        appender.join(seconds + 120)
    finally:
        stop_server(server)
    return {
        "peak_qps": round(peak_qps, 1),
        "offered_rps": round(rate, 1),
        "memory_before": view,
        "predict_alone": summary(alone),
        "predict_during_appends": summary(during),
        "appends_over_http": appended
        | {"instances_per_s": round(appended["instances"] / max(appended["seconds"], 1e-9), 1)},
    }


def _append_over_http(url: str, calls: list[AppendBatch], limit_s: float, out: dict) -> None:
    started = time.perf_counter()
    with httpx.Client(base_url=url, headers={"X-Admin-Token": TOKEN}, timeout=120) as client:
        for call in calls:
            if time.perf_counter() - started > limit_s:
                break
            body = {
                "labels": [{"uid": uid, "text": text} for uid, text in call.labels],
                "instances": [{"text": text, "labels": uids} for text, uids in call.instances],
            }
            r = client.post("/admin/append", json=body)
            out["calls"] += 1
            if r.status_code == 200:
                out["instances"] += len(call.instances)
            else:
                out["failures"] += 1
    out["seconds"] = round(time.perf_counter() - started, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, action="append", required=True, help="bundle to measure (repeatable)")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/debian-related"), help="dataset dir")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dev split into halves A and B")
    parser.add_argument("--batch", type=int, default=64, help="instances per append call")
    parser.add_argument("--load", type=float, default=0.5, help="/predict load during appends, share of the peak")
    parser.add_argument("--seconds", type=float, default=30, help="length of each traffic phase")
    parser.add_argument("--out", type=Path, default=Path("bench/results/live-memory.json"), help="JSON result file")
    args = parser.parse_args(argv)
    dev = load_jsonl_split(args.data, "dev")
    train = load_jsonl_split(args.data, "trn", labels=dev.labels)
    half_a, half_b = halves(dev, args.seed)
    results = []
    for bundle in args.bundle:
        with tempfile.TemporaryDirectory(prefix="live-memory-") as tmp:
            workdir = Path(tmp)
            result = {"bundle": str(bundle)}
            calls = append_batches(load_labels(bundle)[1], half_a, args.batch)  # the same calls for both phases
            result |= quality_phase(bundle.resolve(), train, calls, half_b, workdir)
            result |= traffic_phase(bundle.resolve(), calls, half_b, args.load, args.seconds, workdir)
        print(json.dumps(result))
        results.append(result)
    out = {
        "benchmark": "live_memory",
        "data": str(args.data),
        "halves": {"seed": args.seed, "A": len(half_a), "B": len(half_b)},
        "machine": machine(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
