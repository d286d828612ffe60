"""Batching is invisible, as a test asserts it: :func:`engine.offline.batch_invariance` (every text
ranked alone, then inside random batches of mixed lengths, compared label by label), failing on the
first difference. The tests run it on small bundles; ``python -m studies.batch_invariance`` on the
bundles users serve."""

from __future__ import annotations

from engine import Predictor
from engine.offline import batch_invariance


def assert_batch_invariant(predictor: Predictor, texts: list[str], batches: int, seed: int = 0, k: int = 10) -> int:
    """:func:`batch_invariance`, failing on the first difference; returns how many answers were compared."""
    found = batch_invariance(predictor, texts, batches, seed, k)
    assert found.holds, found.first_difference
    return found.compared
