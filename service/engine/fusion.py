"""Score fusion (NGAME App. C, adapted to an RAE memory): a regression tree over what a query's
retrieved keys say about each candidate label, added to its RAE score.

NGAME fuses a label's embedding and classifier scores with a depth-7 regression tree T fitted
on held-out points (target: 1 for a relevant label, 0 otherwise) and ranks by T(d) + the scores.
Here the candidates are the labels the top-b keys of the memory vote for, the base score is the
RAE score p̂_l of the bundle's mode, and the descriptor φ_l (:data:`FEATURES`) is computed from
the keys, similarities and value rows the search already holds:

    fused_l = p̂_l + T(φ_l)

* ``instance_vote``: log(ε + Σ softmax(q·x_i/τ) over the retrieved instance keys i that carry l)
* ``label_match``: log(ε + softmax(q·z_l/τ) over the retrieved label keys); ε when z_l was not retrieved
* ``label_similarity``: q·z_l, or the lowest retrieved label-key similarity when z_l was not retrieved
* ``label_retrieved``: 1 when z_l is among the retrieved keys
* ``log_frequency``: log(1 + training instances of l in the bundle's memory)
* ``log_instance_votes``: log(1 + retrieved instance keys that carry l)
* ``best_instance_similarity``: the highest q·x_i of a retrieved instance carrying l, or the
  lowest retrieved instance similarity
* ``rae_score``: p̂_l

Nothing else is read, so every front end that ranks (one process, the Ray ingress) fuses alike.
A label added to a live memory after export has frequency 0, as zero-shot labels had in the fit.
``export.fuse`` fits T on training instances the encoder never saw (``TrainParams.holdout``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from service.engine.rae import KeptKeys, ValueRows, key_weights

FEATURES = (
    "instance_vote",
    "label_match",
    "label_similarity",
    "label_retrieved",
    "log_frequency",
    "log_instance_votes",
    "best_instance_similarity",
    "rae_score",
)
# ε of the log features: below any softmax weight that moves a ranking, above float32's zero
LOG_FLOOR = 1e-4


@dataclass(frozen=True)
class RegressionTree:
    """A binary regression tree as arrays (scikit-learn's ``tree_`` layout): node j splits on
    ``feature[j] <= threshold[j]`` to ``left[j]`` / ``right[j]``; a leaf has ``left == -1``
    and predicts ``value[j]``."""

    feature: np.ndarray
    threshold: np.ndarray
    left: np.ndarray
    right: np.ndarray
    value: np.ndarray

    def __post_init__(self) -> None:
        nodes = len(self.value)
        if nodes == 0 or any(len(a) != nodes for a in (self.feature, self.threshold, self.left, self.right)):
            raise ValueError("tree arrays must be non-empty and of one length")
        inner = self.left >= 0
        ids = np.arange(nodes)
        # children after their parent: every walk ends within `nodes` steps
        if not (np.all(self.left[inner] > ids[inner]) and np.all(self.right[inner] > ids[inner])):
            raise ValueError("tree children must come after their parent")
        if np.any(self.left[inner] >= nodes) or np.any(self.right[inner] >= nodes):
            raise ValueError("tree child out of range")
        if np.any((self.feature[inner] < 0) | (self.feature[inner] >= len(FEATURES))):
            raise ValueError("tree splits on an unknown feature")
        if not np.all(np.isfinite(self.value)) or not np.all(np.isfinite(self.threshold[inner])):
            raise ValueError("tree values and thresholds must be finite")

    @functools.cached_property
    def depth(self) -> int:
        depth = np.zeros(len(self.value), dtype=np.int64)
        for node in np.flatnonzero(self.left >= 0):  # parents first (children come after)
            depth[[self.left[node], self.right[node]]] = depth[node] + 1
        return int(depth.max())

    def predict(self, X: np.ndarray) -> np.ndarray:
        node = np.zeros(len(X), dtype=np.int64)
        rows = np.arange(len(X))
        for _ in range(self.depth):
            inner = self.left[node] >= 0
            go_left = X[rows, np.maximum(self.feature[node], 0)] <= self.threshold[node]
            node = np.where(inner, np.where(go_left, self.left[node], self.right[node]), node)
        return self.value[node]


@dataclass(frozen=True)
class ScoreFusion:
    """The fitted tree and the memory's label frequencies (log(1 + count), label id order)."""

    tree: RegressionTree
    log_frequency: np.ndarray

    def save(self, path: Path) -> None:
        t = self.tree
        np.savez(
            path,
            feature=t.feature,
            threshold=t.threshold,
            left=t.left,
            right=t.right,
            value=t.value,
            log_frequency=self.log_frequency,
        )

    @classmethod
    def load(cls, path: Path, num_labels: int) -> ScoreFusion:
        with np.load(path, allow_pickle=False) as z:
            tree = RegressionTree(
                feature=z["feature"].astype(np.int64),
                threshold=z["threshold"].astype(np.float64),
                left=z["left"].astype(np.int64),
                right=z["right"].astype(np.int64),
                value=z["value"].astype(np.float64),
            )
            log_frequency = z["log_frequency"].astype(np.float32)
        if log_frequency.shape != (num_labels,) or not np.all(np.isfinite(log_frequency)):
            raise ValueError(f"log_frequency must be {num_labels} finite values")
        return cls(tree, log_frequency)

    def rescore(self, scores: sp.csr_matrix, kept: list[KeptKeys], values: ValueRows, tau: float) -> sp.csr_matrix:
        """``scores`` (:func:`~service.engine.rae.aggregate_kept` of ``kept``) with every stored
        score replaced by its fused score."""
        features = batch_features(scores, kept, values, tau, self.log_frequency)
        fused = scores.copy()
        # one walk of the tree for the whole batch (the rows of `features` follow scores' storage)
        fused.data = fused.data + self.tree.predict(np.concatenate([np.zeros((0, len(FEATURES))), *features]))
        return fused


def batch_features(
    scores: sp.csr_matrix, kept: list[KeptKeys], values: ValueRows, tau: float, log_frequency: np.ndarray
) -> list[np.ndarray]:
    """Per query, φ of each label stored in its row of ``scores`` (in the row's order), from the
    same kept keys (:func:`~service.engine.rae.keep_keys`) that gave ``scores``."""
    features = []
    for i, (row_keys, row_sims, row_labels) in enumerate(kept):
        start, end = scores.indptr[i], scores.indptr[i + 1]
        carried = values.row_labels(row_keys[row_labels < 0])
        features.append(
            query_features(
                scores.indices[start:end], scores.data[start:end], row_sims, row_labels, carried, tau, log_frequency
            )
        )
    return features


def query_features(
    candidates: np.ndarray,
    rae_scores: np.ndarray,
    sims: np.ndarray,
    key_labels: np.ndarray,
    instance_labels: tuple[np.ndarray, np.ndarray],
    tau: float,
    log_frequency: np.ndarray,
) -> np.ndarray:
    """φ (``len(candidates) x len(FEATURES)``) of one query's candidate labels from its kept keys'
    similarities and label ids (−1: an instance key) and the labels its instance keys carry
    (:meth:`~service.engine.rae.ValueRows.row_labels`: concatenated, and a count per key)."""
    order = np.argsort(candidates, kind="stable")
    sorted_candidates = candidates[order]

    def slots(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions (in ``candidates``) of those of ``labels`` that are candidates, and which."""
        at = np.minimum(np.searchsorted(sorted_candidates, labels), max(len(candidates) - 1, 0))
        hit = sorted_candidates[at] == labels if len(candidates) else np.zeros(len(labels), dtype=bool)
        return order[at[hit]], hit

    n = len(candidates)
    instance, label = key_labels < 0, key_labels >= 0
    weights = key_weights(key_labels, sims, tau, "split") if len(sims) else np.zeros(0)

    vote, votes = np.zeros(n), np.zeros(n)
    lowest_instance = sims[instance].min() if instance.any() else (sims.min() if len(sims) else 0.0)
    best_instance = np.full(n, lowest_instance, dtype=np.float64)
    if instance.any():
        carried, per_key = instance_labels
        at, hit = slots(carried)
        vote = np.bincount(at, weights=np.repeat(weights[instance], per_key)[hit], minlength=n)
        votes = np.bincount(at, minlength=n).astype(np.float64)
        np.maximum.at(best_instance, at, np.repeat(sims[instance], per_key)[hit])

    match = np.zeros(n)
    lowest_label = sims[label].min() if label.any() else (sims.min() if len(sims) else 0.0)
    similarity = np.full(n, lowest_label, dtype=np.float64)
    retrieved = np.zeros(n)
    if label.any():
        at, hit = slots(key_labels[label])
        match[at] = weights[label][hit]
        similarity[at] = sims[label][hit]
        retrieved[at] = 1.0

    known = candidates < len(log_frequency)
    frequency = np.zeros(n)
    frequency[known] = log_frequency[candidates[known]]
    return np.stack(
        [
            np.log(LOG_FLOOR + vote),
            np.log(LOG_FLOOR + match),
            similarity,
            retrieved,
            frequency,
            np.log1p(votes),
            best_instance,
            rae_scores.astype(np.float64),
        ],
        axis=1,
    )


def memory_log_frequency(values: sp.csr_matrix, num_train: int) -> np.ndarray:
    """log(1 + training instances per label) of a bundle's value matrix (its first ``num_train``
    rows are the instances' λ·y rows)."""
    counts = np.bincount(values[:num_train].indices, minlength=values.shape[1])
    return np.log1p(counts).astype(np.float32)
