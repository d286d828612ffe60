"""Do the held-out training searches the score fusion is fitted on look like dev searches?
Adversarial validation of their (query, candidate label) pairs.

    python -m studies.fusion_shift --bundle bundles/debian-unidec-memory --run runs/debian-unidec \\
        [--data ../shared/data/debian-related] [--queries 1000] [--rerank-depth 200]

``export.fuse`` fits the fusion on the run's held-out training instances, searched with their own
memory key left out; the service meets dev (and live) queries, which are not in the memory. If the
two kinds of pairs come from the same distribution, no classifier tells them apart. This fits one
(LightGBM, 50 trees) on half of a balanced sample of held-out and dev pairs and reports its ROC
AUC on the other half (split by query), separately for relevant and irrelevant pairs, and the
features it used most:
0.5 means indistinguishable; the higher, the less a validation on held-out pairs says about dev.
Both sides are the filter-blind search (the peers' protocol) of the same number of queries.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import numpy as np

from engine.offline import KeyTerms
from export.fusion_fit import DEFAULT_FUSION, FuseError
from export.held_out import HeldOutPairs, HeldOutSearch, add_held_out_memory_option, pairs_of, unfitted_fusion
from studies.lib.held_out import held_out_instances
from xmc.data import load_jsonl_split
from xmc.results import machine, write_result


def shift(held: HeldOutPairs, dev: HeldOutPairs, relevant: bool, features: tuple[str, ...], seed: int = 0) -> dict:
    """ROC AUC of a classifier telling the ``relevant`` (or irrelevant) pairs of ``held`` from those
    of ``dev`` (balanced sample), fitted on the pairs of half of each side's queries and scored on
    the other half's, and its features by total gain. Split by query, not by pair: a query's pairs
    share query-level values (its lowest retrieved similarity, for one), which a split by pair lets
    the classifier recognise."""
    import lightgbm
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(seed)

    kept = [np.flatnonzero(pairs.y == relevant) for pairs in (held, dev)]
    n = min(len(kept[0]), len(kept[1]), 200_000)

    def side(pairs: HeldOutPairs, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.sort(rng.choice(at, n, replace=False))
        return pairs.X[at], pairs.query[at] % 2 == 0  # even queries fit, odd ones score

    (Xh, fit_h), (Xd, fit_d) = side(held, kept[0]), side(dev, kept[1])
    X, y = np.vstack([Xh, Xd]), np.r_[np.ones(n), np.zeros(n)]
    fit = np.flatnonzero(np.r_[fit_h, fit_d])
    score = np.flatnonzero(~np.r_[fit_h, fit_d])
    model = lightgbm.LGBMClassifier(n_estimators=50, random_state=seed, verbose=-1).fit(X[fit], y[fit])
    gains = model.booster_.feature_importance("gain")
    total = float(gains.sum()) or 1.0
    return {
        "pairs_each": int(n),
        "auc": round(float(roc_auc_score(y[score], model.predict_proba(X[score])[:, 1])), 3),
        "gain_share": {features[j]: round(float(gains[j]) / total, 3) for j in np.argsort(-gains)[:5]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="an rae_memory bundle of the run's training split")
    parser.add_argument("--run", type=Path, required=True, help="the training run whose held-out instances to compare")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/debian-related"), help="dataset dir")
    parser.add_argument("--queries", type=int, default=1000, help="held-out and dev queries searched, each")
    parser.add_argument(
        "--rerank-depth", type=int, default=0, help="the candidates per search (export.fuse --rerank-depth; 0: all)"
    )
    add_held_out_memory_option(parser)
    parser.add_argument("--out", type=Path, default=Path("bench/results/fusion-shift.json"), help="result JSON")
    args = parser.parse_args(argv)
    try:
        train, predictor, rows = held_out_instances(args.bundle, args.run, args.data)
    except FuseError as exc:
        raise SystemExit(f"studies.fusion_shift: {exc}") from None
    dev = load_jsonl_split(args.data, "dev", labels=train.labels)
    depth = args.rerank_depth or None
    # the held-out queries searched as export.fuse searches them; dev as the service does
    served, key_rows = unfitted_fusion(predictor, train, DEFAULT_FUSION.groups, depth)
    search = HeldOutSearch.of(predictor, train, rows, (served, key_rows), args.held_out_memory)
    held = pairs_of(
        predictor, train, rows[: args.queries], search.unfitted, search.key_terms, excluding=False, hidden=search.hidden
    )
    queries = np.arange(min(args.queries, len(dev)))
    devs = pairs_of(predictor, dev, queries, served, KeyTerms(key_rows), excluding=False, in_memory=False)
    features = served.features
    result = {
        "what": "adversarial validation: can a classifier tell the fusion's held-out training pairs from dev pairs? "
        "(0.5: no)",
        "date": date.today().isoformat(),
        "bundle": str(args.bundle),
        "run": str(args.run),
        "queries": {"held_out": len(held.relevant), "dev": len(devs.relevant)},
        "rerank_depth": depth,
        "held_out_memory": args.held_out_memory,
        "pairs_per_query": {
            "held_out": round(len(held.y) / len(held.relevant), 1),
            "dev": round(len(devs.y) / len(devs.relevant), 1),
        },
        "relevant_among_candidates": {"held_out": round(held.found, 4), "dev": round(devs.found, 4)},
        "relevant_pairs": shift(held, devs, True, features),
        "irrelevant_pairs": shift(held, devs, False, features),
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
