"""Which model and which features should the score fusion have? Chosen on a cross-fitted validation
split of the held-out training instances, never on dev; dev is measured once, for the choice.

    python -m studies.fusion_models --bundle bundles/quality/…-lambda0.3 --run runs/debian-unidec \\
        [--folds 5] [--dev] [--curve]

The pairs are ``export.fuse``'s (both kinds of search of the run's held-out instances, every
feature group of :data:`engine.FEATURE_GROUPS` computed once). The held-out
instances are cut into ``--folds`` folds (an instance's two searches in the same fold); each
candidate is fitted ``--folds`` times on the other folds' pairs and ranks its fold's searches by
p̂ + T(φ), so every held-out instance is ranked by a model that never saw it. Its validation
metrics (P@1, P@5, PSP@5, R@100 under both protocols: the filter-blind searches ranked and
filtered after, as the peers are measured; the excluding searches, as a caller's ``exclude``) are
computed over all of them at once.

The choice, in two steps, by :func:`selection_score` (the mean of P@1 and P@5, filter after):

1. the single regression tree, the regression GBDT and LambdaMART on the default features
   (the RAE and lexical groups), each at every ``--rerank-depths`` (0: every candidate; M: T
   fitted on and rescoring each search's top M by p̂, as ``export.fuse --rerank-depth`` serves it)
   and the ensembles at every ``--ensembles`` size. A candidate is reported but not chosen when
   its model costs more than ``--max-model-ms`` a query in ONNX Runtime, or when one of the
   ``--guard-metrics`` (PSP@5 and R@100) is below that of NGAME's single tree over every candidate
   (the default before; a shallow rerank depth caps R@100);
2. for the best of them, each optional group added alone; a group is kept when it raises the
   validation score by more than ``--min-gain``.

Each candidate's row also says what serving it costs: its last fold's model in ONNX Runtime as the
service runs it (one thread), µs per pair and ms per query on this machine. The bill (batched dev
q/s of the fused bundle ≥ 0.85 × the unfused) is measured by ``studies.fusion_cost`` on the fused
bundle; these figures say which candidates can meet it.

``--curve`` fits the chosen candidate on a growing share of the training folds' instances (does a
bigger holdout help?); ``--dev`` fits it on every pair and evaluates the dev split through the
service's code path (``export.evaluate``), the model in ONNX Runtime as served.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from datetime import date
from pathlib import Path

import numpy as np

from engine.offline import OPTIONAL_GROUPS, ScoreFusion, features_of_groups
from export.evaluate import evaluate_bundle
from export.fusion_fit import (
    BASE_GROUPS,
    DEFAULT_FUSION,
    DEFAULT_PARAMS,
    FuseError,
    FusionChoice,
    depth_name,
    fit_model,
    parse_size,
)
from export.fusion_to_onnx import onnx_fusion_model
from export.fusion_validation import (
    PAIR_GROUPS,
    VALIDATION_METRICS,
    columns_of,
    fold_of_instances,
    selection_score,
    unfused_validation,
    validate,
    with_columns,
)
from export.held_out import SparseSpec, add_held_out_memory_option
from export.sparse_fit import SparseFitParams
from studies.lib.held_out import held_out_features, held_out_instances
from xmc.checkpoint import HOLDOUT_FILE
from xmc.data import label_frequencies, load_jsonl_split
from xmc.results import machine, write_result

DEV_METRICS = ("P@1", "P@3", "P@5", "PSP@5", "R@100")
# The model's share of the serving bill (issue 54: batched q/s >= 0.8x, idle p50 <= 1.25x the
# bundle fused over the memory's candidates alone) on the project's 2-core VM, with a margin for its
# noise. Measured in turns (bench/results/fusion-models-sparse.json, serving_cost, 9 rounds): with
# a sparse ranker's candidates, LambdaMART 60x31 (0.28 ms a query here) served at 0.83x and 1.21x,
# 60x15 (0.23 ms) at 0.80x and 1.23x; the model is the smaller part of the ranker's bill. Before
# the sparse ranker the cap was 0.15 ms, for a bill of 0.85x the unfused memory's q/s.
MAX_MODEL_MS = 0.3
# The candidates of the run that chose export.fuse's default (bench/results/fusion-models.json)
DEFAULT_ENSEMBLES = ("40x15", "40x31", "60x15", "60x31", "100x31")
DEFAULT_RERANK_DEPTHS = (0, 200)
MODELS = ("tree", "gbdt", "lambdarank")


def first_candidates(
    depths: list[int | None], sizes: list[dict], sparse_depth: int | None = None
) -> list[FusionChoice]:
    """Step 1's candidates: the tree, and each ensemble at each size, at each rerank depth (over
    the memory's candidates joined by a sparse ranker's top ``sparse_depth``, its features in φ)."""
    groups = base_groups(sparse_depth)
    candidates = []
    for depth in depths:
        candidates.append(FusionChoice("tree", groups, DEFAULT_PARAMS["tree"], depth, sparse_depth))
        for model in ("gbdt", "lambdarank"):
            for size in sizes:
                candidates.append(FusionChoice(model, groups, DEFAULT_PARAMS[model] | size, depth, sparse_depth))
    return candidates


def base_groups(sparse_depth: int | None) -> tuple[str, ...]:
    """Every candidate's feature groups: the default ones, and a sparse ranker's with one."""
    return BASE_GROUPS + (("sparse",) if sparse_depth else ())


def reference(sparse_depth: int | None = None) -> FusionChoice:
    """The fusion every other candidate must not fall below on the guarded metrics: NGAME's single
    tree over every candidate, the default before this comparison."""
    return FusionChoice("tree", base_groups(sparse_depth), DEFAULT_PARAMS["tree"], None, sparse_depth)


class NoEligibleCandidate(RuntimeError):
    """No candidate's model meets the cost budget with the guarded metrics kept."""


def choose(
    pairs_at: dict,
    fold,
    frequencies,
    num_train,
    candidates,
    min_gain,
    max_model_ms,
    guarded,
    report,
    computed: tuple[str, ...] = PAIR_GROUPS,
) -> tuple[FusionChoice, dict]:
    """The two-step choice of the module docstring (groups added greedily, each kept only when it
    raises the current choice's validation score by more than ``min_gain``); a candidate is never
    chosen when its model costs more than ``max_model_ms`` a query, or when one of the ``guarded``
    validation metrics (filter after) is below :func:`reference`'s (when it is among ``candidates``).
    Every candidate's figures in the result. ``pairs_at``: the held-out pairs at each rerank depth,
    their columns the ``computed`` groups'."""
    results: dict[str, dict] = {}
    floor: dict[str, float] = {}
    reference_fusion = reference(candidates[0].sparse_depth if candidates else None)  # over the same candidates

    def run(candidate: FusionChoice) -> float:
        result = validate(candidate, pairs_at[candidate.rerank_depth], fold, frequencies, num_train, computed=computed)
        figures = result["validation"]["filter_after"]
        why = [
            f"{metric} below {reference_fusion.name}'s" for metric in guarded if figures[metric] < floor.get(metric, -1)
        ]
        if max_model_ms is not None and result["onnx_ms_per_query"] > max_model_ms:
            why.append(f"model over {max_model_ms} ms a query")
        result |= {
            "model": candidate.model,
            "features": list(candidate.groups),
            "params": candidate.params,
            "rerank_depth": candidate.rerank_depth,
            "eligible": not why,
            "ineligible_because": why,
        }
        results[candidate.name] = result
        report(candidate.name, result)
        return -np.inf if why else selection_score(result["validation"])

    if reference_fusion in candidates:  # first: it sets the floor of the guarded metrics
        candidates = [reference_fusion] + [c for c in candidates if c != reference_fusion]
        scored = [(run(reference_fusion), reference_fusion)]
        floor.update({m: results[reference_fusion.name]["validation"]["filter_after"][m] for m in guarded})
        scored += [(run(candidate), candidate) for candidate in candidates[1:]]
    else:
        scored = [(run(candidate), candidate) for candidate in candidates]
    best, chosen = max(scored, key=lambda pair: pair[0])
    if best == -np.inf:
        raise NoEligibleCandidate(
            f"no candidate's model costs at most {max_model_ms} ms a query with "
            f"{list(guarded)} not below {reference_fusion.name}'s"
        )
    for group in (g for g in OPTIONAL_GROUPS if g not in BASE_GROUPS):
        trial = dataclasses.replace(chosen, groups=tuple(g for g in computed if g in chosen.groups + (group,)))
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
    parser.add_argument(
        "--ensembles",
        type=parse_size,
        nargs="+",
        default=[parse_size(size) for size in DEFAULT_ENSEMBLES],
        help=f"sizes TREESxLEAVES of the gbdt / lambdarank candidates (default {' '.join(DEFAULT_ENSEMBLES)})",
    )
    parser.add_argument(
        "--rerank-depths",
        type=int,
        nargs="+",
        default=list(DEFAULT_RERANK_DEPTHS),
        help="rerank depths to try (export.fuse --rerank-depth; 0: every candidate; default "
        f"{' '.join(map(str, DEFAULT_RERANK_DEPTHS))})",
    )
    parser.add_argument(
        "--guard-metrics",
        nargs="*",
        default=["PSP@5", "R@100"],
        choices=VALIDATION_METRICS,
        help="validation metrics (filter after) no chosen candidate may have below the single tree over every "
        "candidate (when --rerank-depths has 0)",
    )
    parser.add_argument(
        "--max-model-ms",
        type=float,
        default=MAX_MODEL_MS,
        help="never choose a candidate whose model costs more ONNX Runtime ms a query on this machine "
        f"(default {MAX_MODEL_MS}: the model's share of the fusion's bill on the project's 2-core VM)",
    )
    parser.add_argument(
        "--min-gain", type=float, default=0.05, help="validation score points an optional feature group must add"
    )
    parser.add_argument("--curve", action="store_true", help="also fit the choice on 25/50/100%% of the instances")
    parser.add_argument("--dev", action="store_true", help="evaluate the chosen candidate on the dev split, once")
    parser.add_argument(
        "--dev-all",
        action="store_true",
        help="after the choice, also evaluate the memory alone and every first-step candidate on dev: does the "
        "validation predict dev? (reported beside the choice, never used for it)",
    )
    parser.add_argument(
        "--sparse-depth",
        type=int,
        default=0,
        help="join each search's candidates with a sparse ranker's top N (fitted as export.fuse fits it, label "
        "texts among its texts; 0: the memory's candidates alone; the default fusion's: "
        f"{DEFAULT_FUSION.sparse_depth})",
    )
    add_held_out_memory_option(parser)
    parser.add_argument("--out", type=Path, default=Path("bench/results/fusion-models.json"), help="result JSON")
    args = parser.parse_args(argv)
    try:
        train, predictor, rows = held_out_instances(args.bundle, args.run, args.data)
    except FuseError as exc:
        raise SystemExit(f"studies.fusion_models: {exc}") from None
    depths = [depth or None for depth in args.rerank_depths]
    sparse_depth = args.sparse_depth or None
    sparse = SparseSpec(sparse_depth, SparseFitParams()) if sparse_depth else None
    computed = PAIR_GROUPS + (("sparse",) if sparse else ())
    held_out, pair_seconds = {}, {}
    for depth in depths:
        started = time.perf_counter()
        held_out[depth] = held_out_features(predictor, train, rows, depth, args.held_out_memory, sparse=sparse)
        pair_seconds[depth_name(depth)] = round(time.perf_counter() - started, 1)
    pairs_at = {depth: pairs for depth, (_, _, pairs) in held_out.items()}
    frequencies, num_train = label_frequencies(train.Y), len(train)
    fold = fold_of_instances(len(rows), args.folds)

    def report(name: str, result: dict) -> None:
        print(name, json.dumps(result["validation"]), f"{result['fit_seconds']} s",
              f"{result['onnx_ms_per_query']} ms/query", flush=True)  # fmt: skip

    candidates = first_candidates(depths, args.ensembles, sparse_depth)
    try:
        chosen, results = choose(
            pairs_at,
            fold,
            frequencies,
            num_train,
            candidates,
            args.min_gain,
            args.max_model_ms,
            args.guard_metrics,
            report,
            computed,
        )
    except NoEligibleCandidate as exc:
        raise SystemExit(f"studies.fusion_models: {exc}") from None
    unfitted, key_terms, pairs = held_out[chosen.rerank_depth]
    result = {
        "what": "score fusion model and features chosen on a cross-fitted validation split of the held-out "
        "training instances (filter_after: the peers' protocol); dev only for the choice",
        "date": date.today().isoformat(),
        "bundle": str(args.bundle),
        "run": str(args.run),
        "held_out_instances": len(rows),
        "held_out_memory": args.held_out_memory,
        "sparse_depth": sparse_depth,
        "folds": args.folds,
        "pairs": {depth_name(d): int(len(p.y)) for d, p in pairs_at.items()},
        "positives": {depth_name(d): int(p.y.sum()) for d, p in pairs_at.items()},
        "positives_among_candidates": {depth_name(d): round(p.found, 4) for d, p in pairs_at.items()},
        "pair_seconds": pair_seconds,
        "selection": "mean of validation P@1 and P@5, filter_after, among candidates whose model costs at most "
        "max_model_ms a query and whose guard_metrics are not below the single tree's over every candidate; "
        "an optional group kept above +min_gain",
        "min_gain": args.min_gain,
        "max_model_ms": args.max_model_ms,
        "guard_metrics": args.guard_metrics,
        "machine": machine(),
        "unfused": {
            "validation": unfused_validation(
                with_columns(pairs_at[depths[0]], columns_of(PAIR_GROUPS, computed)), frequencies, num_train
            )
        },
        "candidates": results,
        "chosen": chosen.name,
    }
    print("unfused", json.dumps(result["unfused"]["validation"]), flush=True)
    if args.curve:
        result["curve"] = {
            f"{share:g}": validate(chosen, pairs, fold, frequencies, num_train, share, computed)["validation"]
            for share in (0.25, 0.5, 1.0)
        }
    if args.dev:
        result["dev"] = evaluate_choice(chosen, predictor, pairs, unfitted, key_terms, args.data, train, computed)
        print("dev", json.dumps(result["dev"]), flush=True)
    if args.dev_all:
        result["unfused"]["dev"] = dev_figures(
            evaluate_bundle(predictor.bundle, load_jsonl_split(args.data, "dev"), train)
        )
        for candidate in [c for c in candidates if c.name in results]:
            served, key_terms, pairs = held_out[candidate.rerank_depth]
            results[candidate.name]["dev"] = evaluate_choice(
                candidate, predictor, pairs, served, key_terms, args.data, train, computed
            )
            print(candidate.name, "dev", json.dumps(results[candidate.name]["dev"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    return 0


def evaluate_choice(
    chosen: FusionChoice,
    predictor,
    pairs,
    unfitted: ScoreFusion,
    key_terms,
    data: Path,
    train,
    computed: tuple[str, ...] = PAIR_GROUPS,
) -> dict:
    """The chosen candidate fitted on every pair, served as ONNX in the bundle's place (with the
    unfitted fusion's counts, lexicon and sources), on dev."""
    features = features_of_groups(chosen.groups)
    fitting = with_columns(pairs, columns_of(chosen.groups, computed))
    model, parity = onnx_fusion_model(fit_model(chosen.model, fitting, features, chosen.params), fitting.X)
    fusion = dataclasses.replace(unfitted, model=model, features=features, rerank_depth=chosen.rerank_depth)
    bundle = dataclasses.replace(predictor.bundle, fusion=fusion, key_terms=key_terms)
    evaluation = evaluate_bundle(bundle, load_jsonl_split(data, "dev"), train, k=100)
    return {"candidate": chosen.name, "onnx_parity_max_abs": parity} | dev_figures(evaluation)


def dev_figures(evaluation: dict) -> dict:
    """What the result keeps of a ``export.evaluate`` dev evaluation."""
    return {
        "queries_per_second": evaluation["queries_per_second"],
        "filter_after": {m: evaluation["metrics"][m] for m in DEV_METRICS},
        "exclude_before": {m: evaluation["metrics_exclude_before"][m] for m in DEV_METRICS},
    }


if __name__ == "__main__":
    raise SystemExit(main())
