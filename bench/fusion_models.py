"""Which model should the score fusion be? The single regression tree of NGAME App. C (what
``export.fuse`` fits) against gradient-boosted trees, fitted on the same held-out pairs and
measured on the dev split with everything else of the served bundle unchanged.

    python -m bench.fusion_models --bundle bundles/quality/…-lambda0.3-fused --run runs/debian-unidec

The pairs are ``export.fuse``'s (both kinds of search of the run's held-out instances, the
bundle's own fusion features, lexical ones included); each model replaces the bundle's tree in
memory and ``training.evaluate`` ranks the dev split through the service's code path. Boosted
models are scored by scikit-learn here: the service has no ensemble walk yet, so the queries per
second of those rows are scikit-learn's, not what a served ensemble would cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.tree import DecisionTreeRegressor

from export.fuse import pairs_of
from service.engine.bundle import load_bundle
from service.engine.search import Predictor
from training.data import load_jsonl_split, rows_of_uids
from training.evaluate import evaluate_bundle
from training.params import HOLDOUT_FILE

HEADLINE = ("P@1", "P@3", "P@5", "PSP@5", "R@100")


def candidate_models() -> dict[str, object]:
    """The fitted bundle's own model first, then boosted ensembles of growing capacity."""

    def boosted(trees: int, depth: int, min_leaf: int = 20) -> HistGradientBoostingRegressor:
        return HistGradientBoostingRegressor(
            max_iter=trees, max_depth=depth, min_samples_leaf=min_leaf, learning_rate=0.1, random_state=0
        )

    return {
        "tree-d7-leaf50 (export.fuse)": DecisionTreeRegressor(max_depth=7, min_samples_leaf=50, random_state=0),
        "boosted-50x-d4": boosted(50, 4),
        "boosted-100x-d6": boosted(100, 6),
        "boosted-100x-d6-leaf500": boosted(100, 6, 500),
        "boosted-300x-d6": boosted(300, 6),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="a fused rae_memory bundle (export.fuse's output)")
    parser.add_argument("--run", type=Path, required=True, help=f"the training run whose {HOLDOUT_FILE} to fit on")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/debian-related"), help="dataset dir")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fusion-models.json"), help="result JSON")
    args = parser.parse_args(argv)
    train, dev = load_jsonl_split(args.data, "trn"), load_jsonl_split(args.data, "dev")
    bundle = load_bundle(args.bundle)
    if bundle.fusion is None:
        raise SystemExit(f"{args.bundle} has no score fusion")
    predictor = Predictor(bundle)
    rows = rows_of_uids(train, (args.run / HOLDOUT_FILE).read_text().split())
    parts = [
        pairs_of(predictor, train, rows, bundle.fusion, bundle.key_terms, excluding) for excluding in (True, False)
    ]
    X, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    results = {}
    for name, model in candidate_models().items():
        started = time.perf_counter()
        model.fit(X, y)
        fit_seconds = time.perf_counter() - started
        # in the tree's place: the fusion only calls tree.predict(φ), as a fitted scikit-learn model does
        fused = dataclasses.replace(bundle, fusion=dataclasses.replace(bundle.fusion, tree=model))
        evaluation = evaluate_bundle(fused, dev, train, k=100)
        results[name] = {
            "fit_seconds": round(fit_seconds, 1),
            "queries_per_second": evaluation["queries_per_second"],
            "filter_after": {m: evaluation["metrics"][m] for m in HEADLINE},
            "exclude_before": {m: evaluation["metrics_exclude_before"][m] for m in HEADLINE},
        }
        print(name, json.dumps(results[name]), flush=True)
    result = {
        "what": "score fusion model on the same held-out pairs, dev split, both protocols",
        "date": date.today().isoformat(),
        "bundle": str(args.bundle),
        "pairs": int(len(y)),
        "positives": int(y.sum()),
        "features": list(bundle.fusion.features),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "models": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
