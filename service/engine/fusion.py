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

A fusion with a :class:`~service.engine.lexical.Lexicon` also reads, for every retrieved key, its
lexical similarity to the query (:mod:`service.engine.lexical`: the idf-weighted cosine of their
word pieces and word-piece pairs), and φ_l then also carries (:data:`LEXICAL_FEATURES`):

* ``instance_lexical_max``: the highest lex(q, x_i) of a retrieved instance carrying l, 0 if none
* ``instance_lexical_sum``: Σ lex(q, x_i) over the retrieved instances carrying l
* ``instance_lexical_vote``: log(ε + Σ softmax(lex(q, x_i) / :data:`LEXICAL_TAU`) over them)
* ``label_lexical``: lex(q, z_l) when l's own key was retrieved, else 0

The dense vectors find the neighbourhood; the lexical signal says which neighbours share the
query's literal pieces, which is what lets the TF-IDF peers rank well on short texts. On
Debian-Related dev it took the fused P@1 / P@5 from 74.5 / 37.1 to 76.0 / 38.1
(bench/results/README.md).

Nothing else is read, so every front end that ranks (one process, the Ray ingress, whose shards
answer their keys' lexical similarities) fuses alike. A label added to a live memory after export
has frequency 0, as zero-shot labels had in the fit; a key added to it gets its term vector from
its text. ``export.fuse`` fits T on training instances the encoder never saw (``TrainParams.holdout``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from service.engine.lexical import Lexicon
from service.engine.rae import KeptKeys, ValueRows

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
LEXICAL_FEATURES = ("instance_lexical_max", "instance_lexical_sum", "instance_lexical_vote", "label_lexical")
# the feature lists a fusion may have: without and with the keys' lexical similarities
FEATURE_SETS = (FEATURES, FEATURES + LEXICAL_FEATURES)
# softmax temperature of the lexical vote (lexical cosines spread over [0, 1] like the dense ones)
LEXICAL_TAU = 0.05
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
        if np.any((self.feature[inner] < 0) | (self.feature[inner] >= len(FEATURE_SETS[-1]))):
            raise ValueError("tree splits on an unknown feature")
        if not np.all(np.isfinite(self.value)) or not np.all(np.isfinite(self.threshold[inner])):
            raise ValueError("tree values and thresholds must be finite")

    @classmethod
    def constant(cls, value: float) -> RegressionTree:
        """A single leaf: every label gets ``value`` (a fusion's features before its tree is fitted)."""
        return cls(*(np.array([x]) for x in (0, 0.0, -1, -1)), value=np.array([float(value)]))

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
    """The fitted tree, the memory's label frequencies (log(1 + count), label id order) and, for
    the lexical features, the lexicon the query terms come from."""

    tree: RegressionTree
    log_frequency: np.ndarray
    lexicon: Lexicon | None = None

    @property
    def features(self) -> tuple[str, ...]:
        return FEATURE_SETS[self.lexicon is not None]

    def save(self, path: Path) -> None:
        t = self.tree
        lexical = {"idf": self.lexicon.idf} if self.lexicon is not None else {}
        np.savez_compressed(
            path,
            feature=t.feature,
            threshold=t.threshold,
            left=t.left,
            right=t.right,
            value=t.value,
            log_frequency=self.log_frequency,
            **lexical,
        )

    @classmethod
    def load(cls, path: Path, num_labels: int, tokenizer: tuple[Path, int] | None = None) -> ScoreFusion:
        """The fusion in ``path``, checked against the bundle's label count; ``tokenizer`` (the
        bundle's tokenizer file and max length) for a fusion with lexical features."""
        with np.load(path, allow_pickle=False) as z:
            tree = RegressionTree(
                feature=z["feature"].astype(np.int64),
                threshold=z["threshold"].astype(np.float64),
                left=z["left"].astype(np.int64),
                right=z["right"].astype(np.int64),
                value=z["value"].astype(np.float64),
            )
            log_frequency = z["log_frequency"].astype(np.float32)
            idf = z.get("idf")
        if log_frequency.shape != (num_labels,) or not np.all(np.isfinite(log_frequency)):
            raise ValueError(f"log_frequency must be {num_labels} finite values")
        if idf is not None and tokenizer is None:
            raise ValueError("a lexical fusion needs the bundle's tokenizer")
        fusion = cls(tree, log_frequency, Lexicon(*tokenizer, idf) if idf is not None else None)
        if np.any(tree.feature[tree.left >= 0] >= len(fusion.features)):
            raise ValueError("the tree splits on a feature this fusion does not compute")
        return fusion

    def rescore(self, scores: sp.csr_matrix, kept: list[KeptKeys], values: ValueRows, tau: float) -> sp.csr_matrix:
        """``scores`` (:func:`~service.engine.rae.aggregate_kept` of ``kept``) with every stored
        score replaced by its fused score."""
        fused = scores.copy()
        # one walk of the tree for the whole batch (the rows of φ follow scores' storage)
        fused.data = fused.data + self.tree.predict(self.features_of(scores, kept, values, tau))
        return fused

    def features_of(self, scores: sp.csr_matrix, kept: list[KeptKeys], values: ValueRows, tau: float) -> np.ndarray:
        """φ (columns :attr:`features`) of every label stored in ``scores``, in its storage order."""
        if self.lexicon is not None and any(row.lexical is None for row in kept):
            raise ValueError("this fusion's lexical features need the retrieved keys' lexical similarities")
        return batch_features(scores, kept, values, tau, self.log_frequency, self.lexicon is not None)


def batch_features(
    scores: sp.csr_matrix,
    kept: list[KeptKeys],
    values: ValueRows,
    tau: float,
    log_frequency: np.ndarray,
    lexical: bool = False,
) -> np.ndarray:
    """φ (columns :data:`FEATURES`, then :data:`LEXICAL_FEATURES` with ``lexical``) of every
    label stored in ``scores``, in its storage order, from the kept keys
    (:func:`~service.engine.rae.keep_keys`) that gave ``scores``. One pass over the whole batch:
    every query's keys are laid end to end and each feature is one grouped numpy operation, so a
    batch costs about what one query does."""
    batch = _BatchKeys.of(kept)
    slots = _StoredSlots(scores)
    n, nq = scores.nnz, len(kept)
    instance, label = batch.labels < 0, batch.labels >= 0
    # the features weigh instances and labels apart ("split"), whatever the bundle's mode
    weights = grouped_softmax(batch.sims, tau, 2 * batch.query + label, 2 * nq)

    carried, per_key = values.row_labels(batch.keys[instance])
    at, hit = slots(np.repeat(batch.query[instance], per_key), carried)

    def carried_by(x: np.ndarray) -> np.ndarray:
        """``x`` of each instance key, once per candidate label it carries."""
        return np.repeat(x, per_key)[hit]

    vote = np.bincount(at, weights=carried_by(weights[instance]), minlength=n)
    votes = np.bincount(at, minlength=n).astype(np.float64)
    # a label no retrieved key of a side carries gets that side's lowest similarity (of any key
    # when the query retrieved none of the side, 0 when it retrieved none at all)
    lowest_key = lowest_per_query(batch.sims, batch.query, nq, 0.0)
    best_instance = lowest_per_query(batch.sims[instance], batch.query[instance], nq, lowest_key)[slots.rows]
    np.maximum.at(best_instance, at, carried_by(batch.sims[instance]))

    own_at, own_hit = slots(batch.query[label], batch.labels[label])
    match = np.zeros(n)
    match[own_at] = weights[label][own_hit]
    similarity = lowest_per_query(batch.sims[label], batch.query[label], nq, lowest_key)[slots.rows]
    similarity[own_at] = batch.sims[label][own_hit]
    retrieved = np.zeros(n)
    retrieved[own_at] = 1.0

    candidates = scores.indices
    known = candidates < len(log_frequency)
    frequency = np.zeros(n)
    frequency[known] = log_frequency[candidates[known]]
    columns = [
        np.log(LOG_FLOOR + vote),
        np.log(LOG_FLOOR + match),
        similarity,
        retrieved,
        frequency,
        np.log1p(votes),
        best_instance,
        scores.data.astype(np.float64),
    ]
    if lexical:
        lex = batch.lexical
        best_lexical = np.zeros(n)
        np.maximum.at(best_lexical, at, carried_by(lex[instance]))
        lexical_weights = grouped_softmax(lex[instance], LEXICAL_TAU, batch.query[instance], nq)
        own_lexical = np.zeros(n)
        own_lexical[own_at] = lex[label][own_hit]
        columns += [
            best_lexical,
            np.bincount(at, weights=carried_by(lex[instance]), minlength=n),
            np.log(LOG_FLOOR + np.bincount(at, weights=carried_by(lexical_weights), minlength=n)),
            own_lexical,
        ]
    return np.stack(columns, axis=1)


@dataclass(frozen=True)
class _BatchKeys:
    """The kept keys of a batch's queries laid end to end, with the query each belongs to."""

    query: np.ndarray
    keys: np.ndarray
    sims: np.ndarray
    labels: np.ndarray
    lexical: np.ndarray | None

    @classmethod
    def of(cls, kept: list[KeptKeys]) -> _BatchKeys:
        def joined(arrays: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)

        lexical = None
        if all(row.lexical is not None for row in kept):
            lexical = joined([row.lexical for row in kept], np.float64)
        return cls(
            query=np.repeat(np.arange(len(kept)), [len(row.keys) for row in kept]),
            keys=joined([row.keys for row in kept], np.int64),
            sims=joined([row.sims for row in kept], np.float64),
            labels=joined([row.labels for row in kept], np.int64),
            lexical=lexical,
        )


class _StoredSlots:
    """Where (query, label) pairs are stored in a batch's score matrix."""

    def __init__(self, scores: sp.csr_matrix):
        self.width = scores.shape[1]
        self.rows = np.repeat(np.arange(scores.shape[0], dtype=np.int64), np.diff(scores.indptr))  # of each entry
        stored = self.rows * self.width + scores.indices
        self.order = np.argsort(stored, kind="stable")
        self.sorted = stored[self.order]

    def __call__(self, query: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The storage positions of those pairs ``(query[j], labels[j])`` that are stored, and
        which pairs are."""
        if not len(self.sorted):
            return np.zeros(0, dtype=np.int64), np.zeros(len(labels), dtype=bool)
        wanted = query.astype(np.int64) * self.width + labels
        at = np.minimum(np.searchsorted(self.sorted, wanted), len(self.sorted) - 1)
        hit = (self.sorted[at] == wanted) & (labels < self.width)
        return self.order[at[hit]], hit


def grouped_softmax(x: np.ndarray, tau: float, group: np.ndarray, groups: int) -> np.ndarray:
    """softmax(x / τ) within each group of ``x`` (group ids below ``groups``)."""
    z = x.astype(np.float64) / tau
    top = np.full(groups, -np.inf)
    np.maximum.at(top, group, z)
    w = np.exp(z - top[group])
    return w / np.bincount(group, weights=w, minlength=groups)[group]


def lowest_per_query(sims: np.ndarray, query: np.ndarray, nq: int, none: float | np.ndarray) -> np.ndarray:
    """Each query's lowest of ``sims`` (``query[j]``: the query of ``sims[j]``); ``none`` (per
    query, or one value) for a query with none of them."""
    lowest = np.full(nq, np.inf)
    np.minimum.at(lowest, query, sims)
    return np.where(np.isinf(lowest), none, lowest)


def memory_log_frequency(values: sp.csr_matrix, num_train: int) -> np.ndarray:
    """log(1 + training instances per label) of a bundle's value matrix (its first ``num_train``
    rows are the instances' λ·y rows)."""
    counts = np.bincount(values[:num_train].indices, minlength=values.shape[1])
    return np.log1p(counts).astype(np.float32)
