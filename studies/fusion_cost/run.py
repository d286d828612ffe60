"""What a score fusion costs a served query: the same RAE memory without a fusion, with one over
the RAE features and with the lexical features too, measured in alternating rounds in one run.

    python -m studies.fusion_cost --bundle none=bundles/quality/…-lambda0.3 \
        --bundle rae-features=bundles/quality/…-lambda0.3-fused-rae-features \
        --bundle lexical=bundles/quality/…-lambda0.3-fused [--rounds 2] [--requests 400]

Each round serves every bundle in turn (a real uvicorn process on 127.0.0.1, one client, single
texts of the dev split, k 10, as :mod:`bench.idle_latency`) and times the service's stages in
process on the same texts, then evaluates it on the whole dev split as ``studies.quality`` does
(:func:`export.evaluate.evaluate_bundle`: batched search, k 100), whose queries per second are the
batched cost. Alternating rounds keep a slow minute of this shared VM from landing on one bundle only.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date
from pathlib import Path

from bench.lib.latency import measure
from engine.offline import load_bundle
from export.evaluate import evaluate_bundle
from xmc.data import load_jsonl_split
from xmc.results import machine, write_result

SERVER_LOG = Path("/tmp/xmcserve-bench-fusion-cost.log")


def named_bundle(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, Path(path)


def summary(runs: list[dict]) -> dict:
    """Per-bundle medians over the rounds of HTTP p50, each stage's median and batched throughput."""
    stages = runs[0]["in_process_stage_median_ms"]
    return {
        "http_p50_ms": round(statistics.median(r["http_ms"]["p50"] for r in runs), 2),
        "batched_queries_per_second": round(statistics.median(r["batched_queries_per_second"] for r in runs), 1),
        "stage_median_ms": {
            stage: round(statistics.median(r["in_process_stage_median_ms"][stage] for r in runs), 3) for stage in stages
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--bundle",
        type=named_bundle,
        action="append",
        required=True,
        help="NAME=PATH of a bundle to measure (repeat; the same memory with and without its fusions)",
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/debian-related"), help="dataset dir")
    parser.add_argument("--requests", type=int, default=400, help="single-text requests per bundle and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds over the bundles")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fusion-cost.json"), help="result JSON")
    args = parser.parse_args(argv)
    dev, train = load_jsonl_split(args.data, "dev"), load_jsonl_split(args.data, "trn")
    texts = dev.texts[: args.requests]
    runs: dict[str, list[dict]] = {name: [] for name, _ in args.bundle}
    for round_number in range(1, args.rounds + 1):
        for name, bundle in args.bundle:
            print(f"round {round_number}: {name}", flush=True)
            run = {"round": round_number, "bundle": str(bundle), **measure(bundle, texts, SERVER_LOG)}
            evaluation = evaluate_bundle(load_bundle(bundle), dev, train, k=100)
            run["batched_queries_per_second"] = evaluation["queries_per_second"]
            run["dev_metrics"] = {name: evaluation["metrics"][name] for name in ("P@1", "P@5", "PSP@5", "R@100")}
            runs[name].append(run)
    result = {
        "what": "idle single-query and batched cost of a score fusion, same memory, bundles in alternating rounds",
        "date": date.today().isoformat(),
        "machine": machine(),
        "summary": {name: summary(r) for name, r in runs.items()},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
