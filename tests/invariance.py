"""The batch-invariance check: a query's answer must not depend on what it is batched with."""

from __future__ import annotations

import numpy as np

from service.engine.search import Predictor

TOLERANCE = 1e-6


def assert_batch_invariant(predictor: Predictor, texts: list[str], batches: int, seed: int = 0, k: int = 10) -> int:
    """Every text of ``texts`` scored alone, then inside ``batches`` random batches of 1 to 64
    texts of mixed lengths (some made longer, so that padding varies): the same labels in the same
    order and scores within :data:`TOLERANCE`. Returns how many batched answers were compared."""
    rng = np.random.default_rng(seed)
    pool = texts + [f"{text} {text} {text}" for text in texts[: len(texts) // 4]]  # longer neighbours
    alone = {}
    for text in pool:
        ranking = predictor.predict([text], k).rankings[0]
        alone[text] = (ranking.ids.tolist(), ranking.scores)
    compared = 0
    for _ in range(batches):
        batch = [pool[i] for i in rng.choice(len(pool), int(rng.integers(1, 65)), replace=False)]
        for text, ranking in zip(batch, predictor.predict(batch, k).rankings, strict=True):
            ids, scores = alone[text]
            assert ranking.ids.tolist() == ids, f"{text!r}: other labels inside a batch of {len(batch)}"
            worst = float(np.abs(ranking.scores - scores).max(initial=0.0))
            assert worst <= TOLERANCE, f"{text!r}: scores moved by {worst:.2e} inside a batch of {len(batch)}"
            compared += 1
    return compared
