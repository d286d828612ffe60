"""A million labels end to end: generate → train → export (sharded) → serve → evaluate, with the
wall seconds and peak memory (RSS) of every stage.

    python -m bench.million_e2e [--labels 1000000] [--trn 2000000] [--work /tmp/xmcserve-million]
        [--out bench/results/million-e2e.json]

* **generate**: ``data/make_synthetic.py`` (Debian-Related's shape: titles, ~5 labels per
  instance, Zipf-like label frequencies, same-item filter pairs, held-out dev and tst).
* **train**: ``training/configs/synthetic-1m.yaml``, a short CPU run (one epoch on the first
  ``max_train`` instances) of a small randomly initialised BERT with the MiniLM vocabulary:
  on this machine MiniLM itself encodes ~230 titles/s, so one pass over 10^6 labels would
  take over an hour; the small encoder keeps every stage's data at full size while the
  model is small. On a GPU, set ``--encoder minilm`` and a longer schedule.
* **export**: a label index of every label's vector, in ``--shards`` shards, built on all cores.
* **serve**: ``python -m service.http`` on the bundle: seconds to ready, the server's peak RSS,
  and the latency of single-text ``/predict`` calls sent one at a time.
* **evaluate**: ``export.evaluate`` on the held-out ``tst`` split, both protocols.

Each stage runs as its own process; its peak RSS is the kernel's (``wait4``), children included.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import httpx

from bench.lib.args import bench_parser
from bench.lib.latency import p50_p99_ms
from bench.lib.profiling import memory
from bench.lib.stages import random_encoder, run_stage, tst_titles
from loadtest.localserver import start_server, stop_server
from xmc.results import machine, write_result

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "training" / "configs" / "synthetic-1m.yaml"


def serve_stage(bundle: Path, queries: list[str], log_dir: Path) -> dict:
    """Start the server on ``bundle``, time single requests, read its peak RSS, stop it."""
    started = time.perf_counter()
    server = start_server(bundle, log_dir / "serve.log", timeout_s=900)
    ready_seconds = time.perf_counter() - started
    latencies = []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for text in queries:
                sent = time.perf_counter()
                client.post("/predict", json={"texts": [text], "k": 10}).raise_for_status()
                latencies.append(time.perf_counter() - sent)
        peak = memory(server.process.pid, "gib", 2)["peak_rss_gib"]
    finally:
        stop_server(server)
    return {
        "seconds_to_ready": round(ready_seconds, 1),
        "peak_rss_gib": peak,
        "requests": len(queries),
        **p50_p99_ms(latencies),
    }


def main() -> None:
    parser = bench_parser(__doc__, "bench/results/million-e2e.json", bundle=None, data=None)
    parser.add_argument("--labels", type=int, default=1_000_000, help="labels of the synthetic data set")
    parser.add_argument("--trn", type=int, default=2_000_000, help="training instances of the data set")
    parser.add_argument("--tst", type=int, default=20_000, help="held-out instances evaluated")
    parser.add_argument("--max-train", type=int, default=500_000, help="instances the short training run uses")
    parser.add_argument("--shards", type=int, default=2, help="index shards of the exported bundle")
    parser.add_argument("--requests", type=int, default=500, help="single-text /predict calls timed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/xmcserve-million"), help="scratch directory")
    args = parser.parse_args()
    work = args.work
    if work.exists():
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True)
    data, run, bundle, logs = work / "data", work / "run", work / "bundle", work / "logs"
    py = sys.executable
    stages = {}
    sizes = ["--labels", str(args.labels), "--trn", str(args.trn), "--dev", "5000", "--tst", str(args.tst)]
    stages["generate"] = run_stage("generate", [py, "data/make_synthetic.py", "--out", str(data), *sizes], logs)
    encoder = random_encoder(work / "encoder", layers=2, seed=0)
    sets = [f"data_dir={data}", f"encoder_dir={encoder}", f"out_dir={run}", f"cache_dir={run / 'cache'}"]
    sets.append(f"max_train={args.max_train}")
    train = [py, "-m", "training.train", "--config", str(CONFIG), *(f"--set={s}" for s in sets)]
    stages["train"] = run_stage("train", train, logs)
    export = [py, "-m", "export.build", "--data", str(data), "--checkpoint", str(run / "best"), "--out", str(bundle)]
    export += ["--index-kind", "labels", "--shards", str(args.shards), "--build-threads", "0"]
    stages["export"] = run_stage("export", export, logs)
    stages["serve"] = serve_stage(bundle, tst_titles(data, args.requests), logs)
    evaluate = [py, "-m", "export.evaluate", "--bundle", str(bundle), "--data", str(data), "--split", "tst"]
    stages["evaluate"] = run_stage("evaluate", [*evaluate, "--out", str(work / "eval-tst.json")], logs)

    train_log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    manifest = json.loads((bundle / "manifest.json").read_text())
    result = {
        "machine": machine(),
        "data": json.loads((data / "stats.json").read_text()),
        "encoder": "BERT 2 layers x 64, random init, MiniLM vocabulary",
        "stages": stages,
        "train": {k: train_log[-1].get(k) for k in ("epoch", "loss", "batches", "epoch_seconds", "samples_per_second")},
        "train_dev_start": train_log[0]["dev"],
        "train_dev_end": train_log[-1]["dev"],
        "bundle": {
            "labels": manifest["counts"]["labels"],
            "shards": len(manifest.get("shards") or []) or 1,
            "bytes": sum(f.stat().st_size for f in bundle.iterdir()),
            "encode_texts_per_s": manifest["params"].get("encode_texts_per_s"),
            "build_seconds": manifest["params"].get("build_seconds"),
        },
        "evaluate_tst": json.loads((work / "eval-tst.json").read_text()),
    }
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
