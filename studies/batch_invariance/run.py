"""Batching is invisible: every text of a dev sample ranked alone and inside random batches.

    python -m studies.batch_invariance --bundle bundles/default --bundle bundles/debian-unidec \
        [--data ../shared/data/debian-related] [--texts 400] [--batches 60] \
        [--out bench/results/batch-invariance.json]

For each bundle, each text (and a longer variant of a quarter of them, so padding varies) is
ranked alone, then inside random batches of 1 to 64 texts of mixed lengths; the JSON records how
many batched answers were compared, how many had other labels or another order, and the largest
score difference (the requirement: none, and at most 1e-6). The tests run the same check on small
bundles (``tests/engine/test_batch_invariance.py``); this runs it on the bundles users
serve, the trained fused one included, which are too slow to build in the tests.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from engine import Predictor
from engine.offline import BATCH_TOLERANCE, batch_invariance, load_bundle
from xmc.data import load_jsonl_split
from xmc.results import machine, write_result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, action="append", required=True, help="a bundle to check (repeatable)")
    parser.add_argument(
        "--data", type=Path, default=Path("../shared/data/debian-related"), help="data set whose dev texts are ranked"
    )
    parser.add_argument("--texts", type=int, default=400, help="dev texts in the sample")
    parser.add_argument("--batches", type=int, default=60, help="random batches of 1-64 texts")
    parser.add_argument("--out", type=Path, default=Path("bench/results/batch-invariance.json"), help="result JSON")
    args = parser.parse_args(argv)
    texts = load_jsonl_split(args.data, "dev").texts[: args.texts]
    results = {}
    for path in args.bundle:
        bundle = load_bundle(path)
        found = batch_invariance(Predictor(bundle), texts, args.batches)
        results[str(path)] = {
            "bundle_id": bundle.bundle_id,
            "index_kind": bundle.manifest.index_kind,
            "quantize": bundle.manifest.params.get("quantize", "none"),
            "fusion": bundle.fusion is not None,
            **asdict(found),
            "holds": found.holds,
        }
        print(json.dumps({str(path): results[str(path)]}), flush=True)
    result = {
        "machine": machine(),
        "data": str(args.data),
        "texts": len(texts),
        "batches": args.batches,
        "tolerance": BATCH_TOLERANCE,
        "bundles": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
