"""Evaluate a bundle directory on a data split, through the service's own search path.

    python -m export.evaluate --bundle bundles/default --data data/debian-sample --split dev \\
        [--out results.json] [--k 100] [--ef 300] [--propensity default|amazon|wikipedia]

The bundle is opened as the server opens it (:func:`engine.load_bundle`) and ranked by a
:class:`engine.Predictor`; the two filter protocols and the metrics are
:mod:`xmc.evaluate`'s. The JSON written with ``--out`` is what the rollout page shows beside a
bundle (``<bundle dir>-eval-<split>.json``, ``make evaluate``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from bundle import CARD_FILE, Figures
from engine import Predictor
from engine.offline import Bundle, load_bundle
from export.card import CardFacts, record
from xmc.command import program
from xmc.data import XMCDataset, load_jsonl_split
from xmc.evaluate import evaluate_predictor, format_table
from xmc.metrics import PROPENSITY_PRESETS, Segments
from xmc.results import write_result


def evaluate_bundle(bundle: Bundle, dataset: XMCDataset, train: XMCDataset, **options) -> dict:
    """:func:`xmc.evaluate.evaluate_predictor` over the bundle as built (no append log)."""
    return evaluate_predictor(Predictor(bundle), dataset, train, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("export.evaluate"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bundle", type=Path, required=True, help="bundle directory to evaluate")
    parser.add_argument("--data", type=Path, required=True, help="data set directory (JSON-lines layout)")
    parser.add_argument("--split", default="dev", help="split to evaluate, with its filter file (default: dev)")
    parser.add_argument("--train-split", default="trn", help="split for label frequencies (PSP, segments)")
    parser.add_argument("--k", type=int, default=100, help="ranking depth (R@k up to it)")
    parser.add_argument("--ef", type=int, default=None, help="HNSW ef (default: the bundle's)")
    parser.add_argument(
        "--propensity", choices=sorted(PROPENSITY_PRESETS), default="default", help="PSP propensity constants A, B"
    )
    parser.add_argument("--segments", default="10,100", help="tail max, torso max training frequency")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    parser.add_argument(
        "--record",
        action="store_true",
        help="also record the figures (both protocols) in the bundle's card (card.json, README.md; same bundle id)",
    )
    args = parser.parse_args(argv)
    tail_max, torso_max = (int(x) for x in args.segments.split(","))
    dataset = load_jsonl_split(args.data, args.split)
    train = load_jsonl_split(args.data, args.train_split, labels=dataset.labels)
    bundle = load_bundle(args.bundle)
    segments = Segments(tail_max, torso_max)
    result = evaluate_bundle(
        bundle, dataset, train, k=args.k, ef=args.ef, propensity=args.propensity, segments=segments
    )
    # when, beside what on which split: the rollout page shows a stored evaluation with its split and date
    evaluated_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result.update({"data": str(args.data), "split": args.split, "evaluated_at": evaluated_at})
    print(format_table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, result)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.record:
        record(args.bundle, CardFacts(figures=evaluation_figures(result, args.split)))
        print(f"recorded in {args.bundle / CARD_FILE}", file=sys.stderr)
    return 0


def evaluation_figures(result: dict, split: str) -> list[Figures]:
    """An evaluation's figures for the bundle's card: both protocols."""

    def figures(metrics: dict) -> dict[str, float]:
        return {name: float(value) for name, value in metrics.items() if isinstance(value, (int, float))}

    return [
        Figures(system="this bundle", split=split, protocol="peers", metrics=figures(result["metrics"])),
        Figures(
            system="this bundle",
            split=split,
            protocol="exclude-before",
            metrics=figures(result["metrics_exclude_before"]),
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
