"""Exact-search evaluation of embeddings during training (the per-epoch dev check).

The numbers a run reports as final come from its exported bundle through the service's search
path (:mod:`xmc.evaluate`); this module scores the same vectors by exact search so a
training run can track DE⊕CLF, DE, CLF and RAE quality every epoch in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from engine import ValueRows, aggregate, labels_of_keys, top_k_of_row
from xmc.data import XMCDataset
from xmc.metrics import drop_excluded, score_ranking

# Scores held at once by the brute-force search: queries go in blocks of at most this many
# (query, key) pairs, so 10^6 keys take ~16 queries a block instead of a 1,024 × 10^6 matrix.
SCORES_PER_BLOCK = 2**24


def exact_top(queries: np.ndarray, keys: np.ndarray, depth: int, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Best-first (ids, inner products) of the ``depth`` nearest keys, by brute force, in blocks
    of at most ``chunk`` queries and :data:`SCORES_PER_BLOCK` scores."""
    depth = min(depth, len(keys))
    chunk = max(1, min(chunk, SCORES_PER_BLOCK // max(len(keys), 1)))
    ids = np.empty((len(queries), depth), dtype=np.int64)
    sims = np.empty((len(queries), depth), dtype=np.float32)
    for start in range(0, len(queries), chunk):
        scores = queries[start : start + chunk] @ keys.T
        part = np.argpartition(-scores, depth - 1, axis=1)[:, :depth]
        part_scores = np.take_along_axis(scores, part, axis=1)
        order = np.argsort(-part_scores, axis=1, kind="stable")
        ids[start : start + chunk] = np.take_along_axis(part, order, axis=1)
        sims[start : start + chunk] = np.take_along_axis(part_scores, order, axis=1)
    return ids, sims


def rank_labels(
    queries: np.ndarray, labels: np.ndarray, k: int, exclude: list[set[int]], chunk: int = 1024
) -> np.ndarray:
    """Top-k label ids per query by exact inner product, with each query's ``exclude`` removed."""
    widest = max((len(e) for e in exclude), default=0)
    ids, _ = exact_top(queries, labels, k + widest, chunk)
    return drop_excluded(ids, exclude, k)


def rank_rae(
    queries: np.ndarray,
    memory_keys: np.ndarray,
    values: sp.csr_matrix,
    num_train: int,
    tau: float,
    top_b: int,
    k: int,
    exclude: list[set[int]],
    mode: str = "joint",
) -> np.ndarray:
    """RAE-XMC top-k (softmax over the exact top-b keys / τ, times V), excluded labels removed
    before the softmax as the service does."""
    widest = max((len(e) for e in exclude), default=0)
    keys, sims = exact_top(queries, memory_keys, top_b + widest)
    ranked = np.full((len(queries), k), -1, dtype=np.int64)
    for start in range(0, len(queries), 512):
        rows = slice(start, start + 512)
        key_labels = labels_of_keys(keys[rows], num_train)
        scores = aggregate(keys[rows], sims[rows], key_labels, ValueRows(values), tau, top_b, exclude[rows], mode)
        for i in range(scores.shape[0]):
            ids, _ = top_k_of_row(scores, i, k)
            ranked[start + i, : len(ids)] = ids
    return ranked


@dataclass
class DevVectors:
    """The served vectors (:class:`training.embedder.Embedder`, as export writes them) of the dev
    queries, the labels and the training instances; the RAE memory is training instances + labels."""

    query: np.ndarray
    label: np.ndarray
    train: np.ndarray
    de_dim: int

    @property
    def memory(self) -> np.ndarray:
        return np.concatenate([self.train, self.label])

    def half(self, vectors: np.ndarray, name: str) -> np.ndarray:
        """The DE (``de``) or CLF (``clf``) block on its own: each block of a served vector is
        unit-norm and scaled by 1/√2, so a slice times √2 is that half's own vector."""
        block = vectors[:, : self.de_dim] if name == "de" else vectors[:, self.de_dim :]
        return block * math.sqrt(2.0)


def score_dev_systems(
    v: DevVectors,
    dev: XMCDataset,
    train: XMCDataset,
    values: sp.csr_matrix,
    k: int,
    rae_tau: float,
    rae_top_b: int,
) -> dict[str, dict[str, float]]:
    """Exact-search dev metrics of the four systems a run tracks: DE⊕CLF, DE, CLF and RAE
    (``values`` = the RAE memory's label values, :func:`bundle.build_values`)."""
    exclude = dev.filter_sets()
    rankings = {
        "de+clf": rank_labels(v.query, v.label, k, exclude),
        "de": rank_labels(v.half(v.query, "de"), v.half(v.label, "de"), k, exclude),
        "clf": rank_labels(v.half(v.query, "clf"), v.half(v.label, "clf"), k, exclude),
        "rae": rank_rae(v.query, v.memory, values, len(train), rae_tau, rae_top_b, k, exclude),
    }
    return {name: score_ranking(ranked, dev, train) for name, ranked in rankings.items()}
