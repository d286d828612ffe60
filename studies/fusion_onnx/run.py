"""The ONNX fusion models: parity with the fitting library, and the cost of scoring one batch's φ
in ONNX Runtime for each kind of model ``export.fuse`` fits, on the same features, in alternating
rounds in one run.

    python -m studies.fusion_onnx --bundle bundles/… --run runs/… --data data/debian-sample \\
        [--batch 64] [--rounds 5] [--out bench/results/fusion-onnx-parity.json]

φ is ``export.fuse``'s: every feature group of both kinds of search of the run's held-out
instances; a batch is the pairs of ``--batch`` consecutive searches (what one served batch of that
many queries scores). The models: ``export.fuse``'s single tree (scikit-learn) and the boosted
candidates (LightGBM GBDT and LambdaMART), each as ONNX. Each is timed over every batch once per
round, the variants in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import numpy as np

from export.fusion_fit import FuseError, fit_model
from export.fusion_to_onnx import onnx_fusion_model
from studies.lib.held_out import held_out_features, held_out_instances
from xmc.checkpoint import HOLDOUT_FILE
from xmc.results import write_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="an rae_memory bundle (fused or not)")
    parser.add_argument("--run", type=Path, required=True, help=f"the training run whose {HOLDOUT_FILE} to fit on")
    parser.add_argument("--data", type=Path, required=True, help="dataset dir the bundle's memory was built from")
    parser.add_argument("--batch", type=int, default=64, help="searches whose pairs make one scored batch")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds over the variants")
    parser.add_argument("--trees", type=int, default=100, help="boosting rounds of the GBDT and LambdaMART")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fusion-onnx-parity.json"), help="result JSON")
    args = parser.parse_args(argv)
    try:
        train, predictor, rows = held_out_instances(args.bundle, args.run, args.data)
    except FuseError as exc:
        raise SystemExit(f"studies.fusion_onnx: {exc}") from None
    unfitted, _, pairs = held_out_features(predictor, train, rows)
    features = unfitted.features

    fitted = {
        "tree": fit_model("tree", pairs, features),
        "gbdt": fit_model("gbdt", pairs, features, {"trees": args.trees}),
        "lambdarank": fit_model("lambdarank", pairs, features, {"trees": args.trees}),
    }
    parity, variants = {}, {}
    for kind, model in fitted.items():
        try:
            onnx_model, parity[f"onnx-{kind}"] = onnx_fusion_model(model, pairs.X)
        except FuseError as exc:
            raise SystemExit(f"studies.fusion_onnx: {exc}") from None
        variants[f"onnx-{kind}"] = onnx_model.predict

    searches = len(pairs.relevant)
    bounds = np.searchsorted(pairs.query, np.arange(0, searches + args.batch, args.batch))
    batches = [pairs.X[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, predict in variants.items():
            for X in batches:
                started = time.perf_counter()
                predict(X)
                timings[name].append(time.perf_counter() - started)
    per_batch = {name: round(1e6 * statistics.median(t), 1) for name, t in timings.items()}
    result = {
        "what": "ONNX Runtime fusion models vs the fitting library (parity) and their per-batch cost on the "
        "same features (variants in alternating rounds)",
        "date": date.today().isoformat(),
        "bundle": str(args.bundle),
        "held_out_instances": len(rows),
        "pairs": int(len(pairs.y)),
        "features": list(features),
        "batch_searches": args.batch,
        "batches": len(batches),
        "median_pairs_per_batch": int(np.median([len(X) for X in batches])),
        "rounds": args.rounds,
        "boosted_trees": args.trees,
        "parity_max_abs_vs_library": parity,
        "median_us_per_batch": per_batch,
        "ort_session": "CPUExecutionProvider, intra_op_num_threads 1, inter_op_num_threads 1, sequential",
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "note": "shared 2-core VM, several other jobs running: ratios within this run, not absolute times",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("parity_max_abs_vs_library", "median_us_per_batch")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
