"""Batching is invisible: every text ranked alone, then inside random batches of mixed lengths,
compared label by label (the requirement: the same labels in the same order, scores within 1e-6).
The tests run it on small bundles; ``python -m bench.batch_invariance`` on the bundles users serve."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import Predictor

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
