"""Synthetic unit vectors in clusters, as many and as wide as a benchmark asks, and their exact
nearest neighbours (the reference of an ANN index's recall).
"""

from __future__ import annotations

import numpy as np

DIM = 64


def clustered_vectors(n: int, rng: np.random.Generator, points_per_cluster: int = 40, spread: float = 0.55):
    """``n`` unit vectors in heavy-tailed clusters, plus the cluster model to draw queries from."""
    clusters = max(1, n // points_per_cluster)
    weights = rng.lognormal(0.0, 1.0, clusters)
    weights /= weights.sum()
    centres = rng.standard_normal((clusters, DIM)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    return draw(centres, weights, n, rng, spread), (centres, weights, spread)


def draw(centres, weights, n, rng, spread) -> np.ndarray:
    which = rng.choice(len(centres), size=n, p=weights)
    x = centres[which] + spread * rng.standard_normal((n, DIM)).astype(np.float32) / np.sqrt(DIM)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def exact_top10(labels: np.ndarray, queries: np.ndarray, block: int = 200_000) -> np.ndarray:
    best_ids = np.zeros((len(queries), 0), dtype=np.int64)
    best_sims = np.zeros((len(queries), 0), dtype=np.float32)
    for start in range(0, len(labels), block):
        sims = queries @ labels[start : start + block].T
        top = np.argpartition(-sims, 10, axis=1)[:, :10]
        best_ids = np.concatenate([best_ids, top + start], axis=1)
        best_sims = np.concatenate([best_sims, np.take_along_axis(sims, top, axis=1)], axis=1)
        keep = np.argsort(-best_sims, axis=1)[:, :10]
        best_ids = np.take_along_axis(best_ids, keep, axis=1)
        best_sims = np.take_along_axis(best_sims, keep, axis=1)
    return best_ids
