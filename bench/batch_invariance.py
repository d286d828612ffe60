"""Batching is invisible: every text of a dev sample ranked alone and inside random batches.

    python -m bench.batch_invariance --bundle bundles/default --bundle bundles/debian-unidec \
        [--data ../shared/data/debian-related] [--texts 400] [--batches 60] \
        [--out bench/results/batch-invariance.json]

For each bundle, each text (and a longer variant of a quarter of them, so padding varies) is
ranked alone, then inside random batches of 1 to 64 texts of mixed lengths; the JSON records how
many batched answers were compared, how many had other labels or another order, and the largest
score difference (the requirement: none, and at most 1e-6). The tests run the same check on small
bundles (``tests/service/engine/test_batch_invariance.py``); this runs it on the bundles users
serve, the trained fused one included, which are too slow to build in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from service.engine import Predictor
from service.engine.offline import load_bundle
from xmc.data import load_jsonl_split

TOLERANCE = 1e-6


@dataclass
class Invariance:
    compared: int = 0
    other_labels: int = 0
    max_abs_score_diff: float = 0.0
    first_difference: str | None = None

    @property
    def holds(self) -> bool:
        return self.other_labels == 0 and self.max_abs_score_diff <= TOLERANCE


def batch_invariance(predictor: Predictor, texts: list[str], batches: int, seed: int = 0, k: int = 10) -> Invariance:
    """Every text of ``texts`` ranked alone, then inside ``batches`` random batches of 1 to 64
    texts of mixed lengths (some made longer, so that padding varies), compared label by label."""
    rng = np.random.default_rng(seed)
    pool = texts + [f"{text} {text} {text}" for text in texts[: len(texts) // 4]]  # longer neighbours
    alone = {}
    for text in pool:
        ranking = predictor.predict([text], k).rankings[0]
        alone[text] = (ranking.ids.tolist(), ranking.scores)
    found = Invariance()
    for _ in range(batches):
        size = int(rng.integers(1, min(64, len(pool)) + 1))
        batch = [pool[i] for i in rng.choice(len(pool), size, replace=False)]
        for text, ranking in zip(batch, predictor.predict(batch, k).rankings, strict=True):
            ids, scores = alone[text]
            found.compared += 1
            if ranking.ids.tolist() != ids:
                found.other_labels += 1
                found.first_difference = (
                    found.first_difference or f"{text!r}: other labels inside a batch of {len(batch)}"
                )
                continue
            worst = float(np.abs(ranking.scores - scores).max(initial=0.0))
            if worst > TOLERANCE and found.first_difference is None:
                found.first_difference = f"{text!r}: scores moved by {worst:.2e} inside a batch of {len(batch)}"
            found.max_abs_score_diff = max(found.max_abs_score_diff, worst)
    return found


def assert_batch_invariant(predictor: Predictor, texts: list[str], batches: int, seed: int = 0, k: int = 10) -> int:
    """:func:`batch_invariance`, failing on the first difference; returns how many answers were compared."""
    found = batch_invariance(predictor, texts, batches, seed, k)
    assert found.holds, found.first_difference
    return found.compared


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
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "data": str(args.data),
        "texts": len(texts),
        "batches": args.batches,
        "tolerance": TOLERANCE,
        "bundles": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
