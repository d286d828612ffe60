"""Which model and which features should the score fusion have? Chosen on a cross-fitted validation
split of the held-out training instances, never on dev; dev is measured once, for the choice.

    python -m bench.fusion_models --bundle bundles/quality/…-lambda0.3 --run runs/debian-unidec \\
        [--folds 5] [--dev] [--curve]

The pairs are ``export.fuse``'s (both kinds of search of the run's held-out instances, every
feature group of :data:`service.engine.fusion.FEATURE_GROUPS` computed once). The held-out
instances are cut into ``--folds`` folds (an instance's two searches in the same fold); each
candidate is fitted ``--folds`` times on the other folds' pairs and ranks its fold's searches by
p̂ + T(φ), so every held-out instance is ranked by a model that never saw it. Its validation
metrics (P@1, P@5, PSP@5, R@100 under both protocols: the filter-blind searches ranked and
filtered after, as the peers are measured; the excluding searches, as a caller's ``exclude``) are
computed over all of them at once.

The choice, in two steps, by :func:`selection_score` (the mean of P@1 and P@5, filter after):

1. the single regression tree, the regression GBDT and LambdaMART on the default features
   (the RAE and lexical groups);
2. for the best of them, each optional group added alone; a group is kept when it raises the
   validation score by more than ``--min-gain``, and the kept groups are then fitted together.

Each candidate's row also says what serving it costs: its last fold's model in ONNX Runtime as the
service runs it (one thread), µs per pair and ms per query on this machine. The bill (batched dev
q/s of the fused bundle ≥ 0.85 × the unfused) is measured by ``bench.fusion_cost`` on the fused
bundle; these figures say which candidates can meet it.

``--curve`` fits the chosen candidate on a growing share of the training folds' instances (does a
bigger holdout help?); ``--dev`` fits it on every pair and evaluates the dev split through the
service's code path (``training.evaluate``), the model in ONNX Runtime as served.
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
import scipy.sparse as sp

from export.fuse import (
    DEFAULT_PARAMS,
    HeldOutPairs,
    check_memory,
    fit_model,
    held_out_pairs,
    onnx_fusion_model,
    unfitted_fusion,
)
from service.engine.fusion import FEATURE_GROUPS, OPTIONAL_GROUPS, ScoreFusion, features_of_groups
from service.engine.lexical import KeyTerms
from service.engine.loading import load_predictor
from training.data import label_frequencies, load_jsonl_split, rows_of_uids
from training.evaluate import evaluate_bundle
from training.metrics import HEADLINE, compute_all
from training.params import HOLDOUT_FILE

VALIDATION_METRICS = HEADLINE
DEV_METRICS = ("P@1", "P@3", "P@5", "PSP@5", "R@100")
DEFAULT_GROUPS = ("rae", "lexical")
MODELS = ("tree", "gbdt", "lambdarank")
# the two searches of each held-out instance, in the order held_out_pairs joins them
PROTOCOL_OF_SEARCH = ("exclude_before", "filter_after")


@dataclasses.dataclass(frozen=True)
class Candidate:
    model: str
    groups: tuple[str, ...]
    params: dict

    @property
    def name(self) -> str:
        extra = "+".join(group for group in self.groups if group not in DEFAULT_GROUPS)
        return f"{self.model}[{'+'.join(g for g in self.groups if g in DEFAULT_GROUPS)}{'+' + extra if extra else ''}]"


def selection_score(validation: dict) -> float:
    """What the choice maximises: the mean of P@1 and P@5 under the peers' protocol."""
    return (validation["filter_after"]["P@1"] + validation["filter_after"]["P@5"]) / 2


def fold_of_instances(instances: int, folds: int, seed: int = 0) -> np.ndarray:
    """Each held-out instance's fold (shuffled, sizes differing by at most one)."""
    return np.random.default_rng(seed).permutation(instances) % folds


def columns_of(groups: tuple[str, ...]) -> np.ndarray:
    """The columns of φ over every group that ``groups``' features are."""
    every = features_of_groups(FEATURE_GROUPS)
    return np.array([every.index(name) for name in features_of_groups(groups)])


def with_columns(pairs: HeldOutPairs, columns: np.ndarray) -> HeldOutPairs:
    return dataclasses.replace(pairs, X=pairs.X[:, columns])


def ranked_by(pairs: HeldOutPairs, scores: np.ndarray, k: int = 100) -> np.ndarray:
    """Each search's candidate labels by ``scores``, best first, ``k`` wide (−1 padded)."""
    searches = len(pairs.relevant)
    order = np.lexsort((-scores, pairs.query))
    query = pairs.query[order]
    position = np.arange(len(order)) - np.searchsorted(query, query)
    ranked = np.full((searches, k), -1, dtype=np.int64)
    top = position < k
    ranked[query[top], position[top]] = pairs.labels[order][top]
    return ranked


def relevant_matrix(pairs: HeldOutPairs, labels: int) -> sp.csr_matrix:
    rows = np.repeat(np.arange(len(pairs.relevant)), [len(r) for r in pairs.relevant])
    cols = np.concatenate(pairs.relevant) if pairs.relevant else np.zeros(0, dtype=np.int64)
    return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(pairs.relevant), labels))


def validate(
    candidate: Candidate,
    pairs: HeldOutPairs,
    fold: np.ndarray,
    frequencies: np.ndarray,
    num_train: int,
    share: float = 1.0,
) -> dict:
    """``candidate``'s cross-fitted validation metrics per protocol (``share``: of the training
    folds' instances it is fitted on)."""
    instances = len(fold)
    features = features_of_groups(candidate.groups)
    pairs = with_columns(pairs, columns_of(candidate.groups))
    rae_score = pairs.X[:, features.index("rae_score")]
    out_of_fold = np.zeros(len(pairs.y))
    rng = np.random.default_rng(1)
    started = time.perf_counter()
    for f in range(fold.max() + 1):
        fitting = np.flatnonzero(fold != f)
        if share < 1.0:
            fitting = rng.choice(fitting, max(1, round(share * len(fitting))), replace=False)
        searches = np.concatenate([fitting + s * instances for s in range(len(PROTOCOL_OF_SEARCH))])
        model = fit_model(candidate.model, pairs.subset(searches), features, candidate.params)
        held = np.isin(pairs.query % instances, np.flatnonzero(fold == f))
        out_of_fold[held] = model.predict(pairs.X[held])
    seconds = time.perf_counter() - started
    # what serving it costs: the last fold's model in ONNX Runtime as the service runs it, on its fold
    onnx_model, _ = onnx_fusion_model(model, pairs.X[held])
    timings = []
    for _ in range(3):
        timed = time.perf_counter()
        onnx_model.predict(pairs.X[held])
        timings.append(time.perf_counter() - timed)
    ranked = ranked_by(pairs, rae_score + out_of_fold)
    Y = relevant_matrix(pairs, len(frequencies))
    validation = {}
    for s, protocol in enumerate(PROTOCOL_OF_SEARCH):
        rows = slice(s * instances, (s + 1) * instances)
        metrics = compute_all(ranked[rows], Y[rows], frequencies, num_train, ks=(1, 5), recall_ks=(100,))
        validation[protocol] = {name: round(metrics[name], 2) for name in VALIDATION_METRICS}
    us_per_pair = 1e6 * min(timings) / max(int(held.sum()), 1)
    pairs_per_search = len(pairs.y) / len(pairs.relevant)
    return {
        "validation": validation,
        "fit_seconds": round(seconds, 1),
        "onnx_us_per_pair": round(us_per_pair, 4),
        "onnx_ms_per_query": round(us_per_pair * pairs_per_search / 1e3, 4),
    }


def choose(pairs, fold, frequencies, num_train, params, min_gain, report) -> tuple[Candidate, dict]:
    """The two-step choice of the module docstring (groups added greedily, each kept only when it
    raises the current choice's validation score by more than ``min_gain``); every candidate's
    figures in the result."""
    results: dict[str, dict] = {}

    def run(candidate: Candidate) -> float:
        result = validate(candidate, pairs, fold, frequencies, num_train)
        result |= {"model": candidate.model, "features": list(candidate.groups), "params": candidate.params}
        results[candidate.name] = result
        report(candidate.name, result)
        return selection_score(result["validation"])

    models = [Candidate(m, DEFAULT_GROUPS, DEFAULT_PARAMS[m] | params.get(m, {})) for m in MODELS]
    best, chosen = max(((run(candidate), candidate) for candidate in models), key=lambda scored: scored[0])
    for group in (g for g in OPTIONAL_GROUPS if g not in DEFAULT_GROUPS):
        trial = dataclasses.replace(chosen, groups=tuple(g for g in FEATURE_GROUPS if g in chosen.groups + (group,)))
        score = run(trial)
        if score > best + min_gain:
            chosen, best = trial, score
    return chosen, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="an rae_memory bundle (fused or not)")
    parser.add_argument("--run", type=Path, required=True, help=f"the training run whose {HOLDOUT_FILE} to fit on")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/debian-related"), help="dataset dir")
    parser.add_argument("--folds", type=int, default=5, help="cross-fitting folds of the held-out instances")
    parser.add_argument("--trees", type=int, help="boosting rounds of gbdt / lambdarank (default: export.fuse's)")
    parser.add_argument("--leaves", type=int, help="max leaves per tree of gbdt / lambdarank (default: export.fuse's)")
    parser.add_argument(
        "--min-gain", type=float, default=0.05, help="validation score points an optional feature group must add"
    )
    parser.add_argument("--curve", action="store_true", help="also fit the choice on 25/50/100%% of the instances")
    parser.add_argument("--dev", action="store_true", help="evaluate the chosen candidate on the dev split, once")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fusion-models.json"), help="result JSON")
    args = parser.parse_args(argv)
    train = load_jsonl_split(args.data, "trn")
    predictor = load_predictor(args.bundle)
    check_memory(predictor, train)
    rows = rows_of_uids(train, (args.run / HOLDOUT_FILE).read_text().split())
    started = time.perf_counter()
    unfitted, key_rows = unfitted_fusion(predictor, train, tuple(FEATURE_GROUPS))
    key_terms = KeyTerms(key_rows)
    pairs = held_out_pairs(predictor, train, rows, unfitted, key_terms, "both")
    pair_seconds = time.perf_counter() - started
    frequencies, num_train = label_frequencies(train.Y), len(train)
    fold = fold_of_instances(len(rows), args.folds)
    given = {name: value for name, value in (("trees", args.trees), ("leaves", args.leaves)) if value is not None}
    params = {m: given for m in ("gbdt", "lambdarank")}

    def report(name: str, result: dict) -> None:
        print(name, json.dumps(result["validation"]), f"{result['fit_seconds']} s", flush=True)

    chosen, results = choose(pairs, fold, frequencies, num_train, params, args.min_gain, report)
    result = {
        "what": "score fusion model and features chosen on a cross-fitted validation split of the held-out "
        "training instances (filter_after: the peers' protocol); dev only for the choice",
        "date": date.today().isoformat(),
        "bundle": str(args.bundle),
        "run": str(args.run),
        "held_out_instances": len(rows),
        "folds": args.folds,
        "pairs": int(len(pairs.y)),
        "positives": int(pairs.y.sum()),
        "positives_among_candidates": round(pairs.found, 4),
        "pair_seconds": round(pair_seconds, 1),
        "selection": "mean of validation P@1 and P@5, filter_after; an optional group kept above +min_gain",
        "min_gain": args.min_gain,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "candidates": results,
        "chosen": chosen.name,
    }
    if args.curve:
        result["curve"] = {
            f"{share:g}": validate(chosen, pairs, fold, frequencies, num_train, share)["validation"]
            for share in (0.25, 0.5, 1.0)
        }
    if args.dev:
        result["dev"] = evaluate_choice(chosen, predictor, pairs, unfitted, key_terms, args.data, train)
        print("dev", json.dumps(result["dev"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def evaluate_choice(chosen: Candidate, predictor, pairs, unfitted: ScoreFusion, key_terms, data: Path, train) -> dict:
    """The chosen candidate fitted on every pair, served as ONNX in the bundle's place, on dev."""
    features = features_of_groups(chosen.groups)
    fitting = with_columns(pairs, columns_of(chosen.groups))
    model, parity = onnx_fusion_model(fit_model(chosen.model, fitting, features, chosen.params), fitting.X)
    fusion = ScoreFusion(model, unfitted.log_frequency, unfitted.lexicon, features)
    bundle = dataclasses.replace(predictor.bundle, fusion=fusion, key_terms=key_terms)
    evaluation = evaluate_bundle(bundle, load_jsonl_split(data, "dev"), train, k=100)
    return {
        "candidate": chosen.name,
        "onnx_parity_max_abs": parity,
        "queries_per_second": evaluation["queries_per_second"],
        "filter_after": {m: evaluation["metrics"][m] for m in DEV_METRICS},
        "exclude_before": {m: evaluation["metrics_exclude_before"][m] for m in DEV_METRICS},
    }


if __name__ == "__main__":
    raise SystemExit(main())
