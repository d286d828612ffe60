"""Which candidate sources should a fused bundle have? An ablation over one trained memory, chosen
on a cross-fitted validation split of the held-out training instances, never on dev.

    python -m studies.candidate_sources --bundle <memory bundle> --run <training run> \\
        [--data ../shared/data/debian-related] [--sparse-depths 50 100] [--dev]

Variants, each the default fusion (:data:`export.fusion_fit.DEFAULT_FUSION`, LambdaMART over the
RAE and lexical features of each search's top 200 by p̂) over its own candidates:

* ``memory``: the memory's candidates alone (the default until now);
* ``memory+sparse@D``: joined by a sparse ranker's top D (:mod:`engine.sparse`, fitted on
  the training texts alone, ``label_texts`` off);
* ``memory+sparse+labels@D``: the same ranker with each label's own text among its texts (the
  lexical match on label text: a zero-shot label gets weights);
* ``memory+keys@K`` and ``memory+sparse+labels@D+keys@K`` (with ``--label-key-depths``): joined by
  each query's nearest K label keys of a search ``--label-key-fetch`` keys deeper than b (the label
  index as a source, :class:`engine.offline.LabelKeySource`).

For each: the validation metrics of :func:`studies.fusion_models.run.validate` (5 folds, both protocols,
the candidates' recall of the relevant labels), and the choice by
:func:`studies.fusion_models.run.selection_score`. With ``--dev``: every variant fitted on all its pairs
and served in the memory's place (the ranker of the whole memory, as ``export.fuse`` writes it),
evaluated on dev through the service's code path (both protocols; P@1/3/5, nDCG@5, PSP@1/3/5,
R@10/100), with the batched q/s of that evaluation (encode + search, 64 a batch) and the idle p50
(one text a call) measured in the same run; the memory alone (p̂, no fusion) beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

from engine import Predictor
from engine.offline import LabelKeySource, features_of_groups, load_bundle
from export.evaluate import evaluate_bundle
from export.fusion_fit import DEFAULT_FUSION, FuseError, fit_model
from export.fusion_to_onnx import onnx_fusion_model
from export.fusion_validation import (
    PAIR_GROUPS,
    columns_of,
    fold_of_instances,
    selection_score,
    unfused_validation,
    validate,
    with_columns,
)
from export.held_out import SparseSpec
from export.sparse_fit import SparseFitParams
from studies.lib.held_out import held_out_features, held_out_instances
from xmc.data import label_frequencies, load_jsonl_split
from xmc.results import write_result

DEV_METRICS = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5", "R@10", "R@100")
IDLE_QUERIES = 200


@dataclasses.dataclass(frozen=True)
class Sources:
    """A variant's candidate sources beside the memory's: a sparse ranker, the label keys."""

    sparse: SparseSpec | None = None
    label_keys: LabelKeySource | None = None

    @property
    def groups(self) -> tuple[str, ...]:
        return (*(("sparse",) if self.sparse else ()), *(("label_keys",) if self.label_keys else ()))


def variants(depths: list[int], label_key_depths: list[int], label_key_fetch: int) -> dict[str, Sources]:
    out: dict[str, Sources] = {"memory": Sources()}
    for depth in depths:
        out[f"memory+sparse@{depth}"] = Sources(SparseSpec(depth, SparseFitParams(label_texts=False)))
        out[f"memory+sparse+labels@{depth}"] = Sources(SparseSpec(depth, SparseFitParams()))
    for keys in label_key_depths:
        source = LabelKeySource(keys, label_key_fetch)
        out[f"memory+keys@{keys}"] = Sources(label_keys=source)
        for depth in depths:
            out[f"memory+sparse+labels@{depth}+keys@{keys}"] = Sources(SparseSpec(depth, SparseFitParams()), source)
    return out


def idle_p50_ms(predictor: Predictor, texts: list[str]) -> float:
    """The median ms of one text a call (an idle server's request, without HTTP)."""
    for text in texts[:10]:
        predictor.predict([text], 10)
    timings = []
    for text in texts:
        started = time.perf_counter()
        predictor.predict([text], 10)
        timings.append(1e3 * (time.perf_counter() - started))
    return round(statistics.median(timings), 3)


def serving_cost(bundles: list[Path], texts: list[str], rounds: int = 3, batch: int = 32) -> dict:
    """Each bundle's batched q/s (``batch`` texts a call, encode + search + fusion) and idle p50
    (one text a call), measured in turns (A B A B …, ``rounds`` times) in one process, so that a
    machine's drift falls on every bundle alike; the median of the rounds."""
    predictors = {str(path): Predictor(load_bundle(path)) for path in bundles}
    figures: dict[str, dict[str, list[float]]] = {name: {"qps": [], "p50": []} for name in predictors}
    for _ in range(rounds):
        for name, predictor in predictors.items():
            started = time.perf_counter()
            for start in range(0, len(texts), batch):
                predictor.predict(texts[start : start + batch], 10)
            figures[name]["qps"].append(len(texts) / (time.perf_counter() - started))
            figures[name]["p50"].append(idle_p50_ms(predictor, texts[:IDLE_QUERIES]))
    return {
        name: {
            "batched_queries_per_second": round(statistics.median(f["qps"]), 1),
            "idle_p50_ms": round(statistics.median(f["p50"]), 3),
            "rounds": rounds,
            "per_round": {"batched_queries_per_second": [round(q, 1) for q in f["qps"]], "idle_p50_ms": f["p50"]},
        }
        for name, f in figures.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--bundle", type=Path, help="the trained rae_memory bundle (unfused; required but with --serving-cost)"
    )
    parser.add_argument("--run", type=Path, help="its training run, holdout.txt (not with --serving-cost)")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/debian-related"), help="dataset dir")
    parser.add_argument("--sparse-depths", type=int, nargs="+", default=[50, 100], help="sparse ranker depths")
    parser.add_argument(
        "--label-key-depths", type=int, nargs="*", default=[], help="label-key source depths (the label index)"
    )
    parser.add_argument(
        "--label-key-fetch", type=int, default=200, help="keys fetched beyond b for the label-key source"
    )
    parser.add_argument("--folds", type=int, default=5, help="cross-fitting folds of the held-out instances")
    parser.add_argument("--dev", action="store_true", help="also evaluate every variant on dev (never for the choice)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/candidate-sources.json"), help="result JSON")
    parser.add_argument(
        "--serving-cost",
        type=Path,
        nargs="+",
        help="instead: these built bundles' batched q/s and idle p50 in turns, added to --out's serving_cost",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of turns for --serving-cost (the median is reported)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.serving_cost:
        texts = load_jsonl_split(args.data, "dev").texts[:1024]
        result = json.loads(args.out.read_text()) if args.out.is_file() else {}
        result["serving_cost"] = {"machine": platform.processor() or platform.machine()}
        result["serving_cost"] |= serving_cost(args.serving_cost, texts, rounds=args.rounds)
        write_result(args.out, result)
        print(json.dumps(result["serving_cost"], indent=2))
        return 0
    if args.bundle is None or args.run is None:
        parser.error("--bundle and --run are required (but with --serving-cost)")
    try:
        train, predictor, rows = held_out_instances(args.bundle, args.run, args.data)
    except FuseError as exc:
        raise SystemExit(f"studies.candidate_sources: {exc}") from None
    frequencies, num_train = label_frequencies(train.Y), len(train)
    fold = fold_of_instances(len(rows), args.folds)
    dev = load_jsonl_split(args.data, "dev", labels=train.labels) if args.dev else None
    results: dict[str, dict] = {}
    if dev is not None:
        memory_only = evaluate_bundle(predictor.bundle, dev, train, k=100)
        results["memory, no fusion"] = {"dev": dev_row(memory_only, idle_p50_ms(predictor, dev.texts[:IDLE_QUERIES]))}
    for name, sources in variants(args.sparse_depths, args.label_key_depths, args.label_key_fetch).items():
        started = time.perf_counter()
        spec = sources.sparse
        served, key_terms, pairs = held_out_features(
            predictor, train, rows, DEFAULT_FUSION.rerank_depth, sparse=spec, label_keys=sources.label_keys
        )
        computed = PAIR_GROUPS + sources.groups
        candidate = dataclasses.replace(
            DEFAULT_FUSION,
            groups=DEFAULT_FUSION.groups + sources.groups,
            sparse_depth=spec.depth if spec is not None else None,
        )
        fitted = validate(candidate, pairs, fold, frequencies, num_train, computed=computed)
        row = {
            "candidate": candidate.name,
            "pairs": len(pairs.y),
            "relevant_among_candidates": round(100 * pairs.found, 2),
            "unfused_validation": unfused_validation(
                with_columns(pairs, columns_of(PAIR_GROUPS, computed)), frequencies, num_train
            ),
            **fitted,
            "score": round(selection_score(fitted["validation"]), 3),
            "pair_seconds": round(time.perf_counter() - started, 1),
        }
        if dev is not None:
            features = features_of_groups(candidate.groups)
            fitting = with_columns(pairs, columns_of(candidate.groups, computed))
            model, _ = onnx_fusion_model(fit_model(candidate.model, fitting, features, candidate.params), fitting.X)
            fusion = dataclasses.replace(served, model=model, features=features)
            fused = Predictor(dataclasses.replace(predictor.bundle, fusion=fusion, key_terms=key_terms))
            evaluation = evaluate_bundle(fused.bundle, dev, train, k=100)
            row["dev"] = dev_row(evaluation, idle_p50_ms(fused, dev.texts[:IDLE_QUERIES]))
        results[name] = row
        print(name, json.dumps({k: row[k] for k in ("relevant_among_candidates", "validation", "score")}), flush=True)
    chosen = max((name for name in results if "score" in results[name]), key=lambda name: results[name]["score"])
    result = {
        "bundle": str(args.bundle),
        "run": str(args.run),
        "data": str(args.data),
        "held_out_instances": len(rows),
        "folds": args.folds,
        "machine": platform.processor() or platform.machine(),
        "chosen": chosen,
        "chosen_by": "validation score (mean of P@1 and P@5, filter after) on the held-out instances",
        "variants": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    args.out.with_suffix(".md").write_text(markdown(result))
    print("chosen", chosen)
    return 0


def markdown(result: dict) -> str:
    """The ablation as the docs show it: validation (the choice) and dev (never used for it)."""
    lines = [
        "Validation: the held-out training instances, 5-fold cross-fitted (P@1 / P@5 / PSP@5 / R@100; "
        "filter after | exclude before); candidates: the share of relevant labels among a search's candidates.",
        "",
        "| variant | candidates | validation, filter after | validation, exclude before | score |",
        "| --- | ---: | --- | --- | ---: |",
    ]
    for name, row in result["variants"].items():
        if "validation" not in row:
            continue
        v = row["validation"]
        cells = [
            " / ".join(f"{v[p][m]:.2f}" for m in ("P@1", "P@5", "PSP@5", "R@100"))
            for p in ("filter_after", "exclude_before")
        ]
        chosen = " **chosen**" if name == result["chosen"] else ""
        found = row["relevant_among_candidates"]
        lines.append(f"| {name}{chosen} | {found:.2f} | {cells[0]} | {cells[1]} | {row['score']:.2f} |")
    dev_rows = [(name, row["dev"]) for name, row in result["variants"].items() if "dev" in row]
    if dev_rows:
        lines += [
            "",
            "Dev (measured after the choice; filter after, then exclude before):",
            "",
            "| variant | protocol | " + " | ".join(DEV_METRICS) + " | batched q/s | idle p50 ms |",
            "| --- | --- |" + " ---: |" * (len(DEV_METRICS) + 2),
        ]
        for name, dev in dev_rows:
            for protocol in ("filter_after", "exclude_before"):
                figures = " | ".join(f"{dev[protocol][m]:.2f}" for m in DEV_METRICS)
                timing = (
                    f"{dev['batched_queries_per_second']} | {dev['idle_p50_ms']}"
                    if protocol == "filter_after"
                    else " | "
                )
                lines.append(f"| {name} | {protocol.replace('_', ' ')} | {figures} | {timing} |")
    return "\n".join(lines) + "\n"


def dev_row(evaluation: dict, idle_p50: float) -> dict:
    return {
        "batched_queries_per_second": evaluation["queries_per_second"],
        "idle_p50_ms": idle_p50,
        "filter_after": {m: evaluation["metrics"][m] for m in DEV_METRICS},
        "exclude_before": {m: evaluation["metrics_exclude_before"][m] for m in DEV_METRICS},
    }


if __name__ == "__main__":
    raise SystemExit(main())
