"""Negative-mining-aware mini-batches (NGAME Alg. 1) with pick-some-labels sampling (UniDEC §3.1–3.2).

* Queries are grouped by balanced clustering of their current embeddings, so a batch holds
  similar queries whose positives are each other's hard negatives. Cluster size follows a
  curriculum (small clusters = near-random batches first, tighter ones later, NGAME §3.2).
* Per query at most β positives are sampled (PSL) plus η hard negatives drawn from the labels
  an ANNS index over the current label embeddings returns for it (refreshed every τ epochs).
* The batch label pool is the union; every in-pool positive of a query counts as a positive,
  which for most torso/tail queries recovers all of their positives (UniDEC §3.2).
* A training instance's own label (the filter file's same-item pairs) is neither positive nor
  negative: it has the instance's exact text, so pushing it away would fight the encoder, and
  pulling it in teaches nothing. That holds when the label is also one of the instance's
  targets: it is dropped from the targets, never sampled or marked as a positive (a positive
  left out of its own softmax denominator would make the loss unbounded below). An instance
  whose only target is its own label has no positive; the losses skip such a query.
"""

from __future__ import annotations

from dataclasses import dataclass

import hnswlib
import numpy as np
import scipy.sparse as sp


@dataclass
class Batch:
    """One mini-batch.

    Attributes:
        queries: training-instance rows, [Q].
        pool: label ids of the batch label pool, [P].
        positives: [Q, P] bool, the label is a positive of the query; with soft targets
            (Gandalf's label points), float32 target weights in (0, 1], 0 for a non-positive.
        ignore: [Q, P] bool, the label is the query's own item (neither positive nor negative).
        related: [Q, Q] bool, the two queries share a label (RAE loss: not negatives).
    """

    queries: np.ndarray
    pool: np.ndarray
    positives: np.ndarray
    ignore: np.ndarray
    related: np.ndarray


def without_own_labels(Y: sp.csr_matrix, own_labels: list[set[int]]) -> sp.csr_matrix:
    """``Y`` with each instance's own labels (filter-file pairs) removed from its row; the other
    entries keep their order, so sampling from an untouched row draws what it drew before."""
    targets = Y.copy()
    for row, own in enumerate(own_labels):
        if own:
            entries = slice(targets.indptr[row], targets.indptr[row + 1])
            targets.data[entries] *= ~np.isin(targets.indices[entries], list(own))
    targets.eliminate_zeros()
    return targets


def _normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def balanced_clusters(
    embeddings: np.ndarray, cluster_size: int, rng: np.random.Generator, iterations: int = 5
) -> list[np.ndarray]:
    """Recursive balanced spherical 2-means until every cluster has ≤ ``cluster_size`` rows.

    Each split assigns the half of the rows closest (relative to the other centroid) to each
    centroid, so the clusters stay balanced (NGAME's clustering of query embeddings).
    """
    x = _normalize(embeddings.astype(np.float32))
    if cluster_size <= 1:
        return [np.array([i]) for i in rng.permutation(len(x))]
    done, todo = [], [np.arange(len(x))]
    while todo:
        rows = todo.pop()
        if len(rows) <= cluster_size:
            done.append(rows)
            continue
        centres = x[rng.choice(rows, size=2, replace=False)]
        for _ in range(iterations):
            margin = x[rows] @ (centres[0] - centres[1])
            order = np.argsort(-margin, kind="stable")
            halves = order[: len(rows) // 2], order[len(rows) // 2 :]
            centres = np.stack([_normalize(x[rows[h]].sum(axis=0, keepdims=True))[0] for h in halves])
        todo.extend(rows[h] for h in halves)
    return done


def cluster_batches(clusters: list[np.ndarray], batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle the clusters, concatenate them and cut batches of ``batch_size`` queries."""
    order = np.concatenate([clusters[i] for i in rng.permutation(len(clusters))])
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def curriculum_cluster_size(epoch: int, start: int, maximum: int, grow_every: int) -> int:
    """Cluster size doubles every ``grow_every`` epochs from ``start`` up to ``maximum``."""
    if grow_every <= 0:
        return maximum
    return int(min(maximum, start * 2 ** (epoch // grow_every)))


def mine_hard_negatives(
    query_vectors: np.ndarray,
    label_vectors: np.ndarray,
    Y: sp.csr_matrix,
    own_labels: list[set[int]],
    per_query: int,
    ef: int = 200,
    threads: int = 0,
) -> list[np.ndarray]:
    """For each query, its ``per_query`` nearest labels (inner product, HNSW) that are neither
    positives nor its own item: the pool its η hard negatives are drawn from."""
    index = hnswlib.Index(space="ip", dim=label_vectors.shape[1])
    index.init_index(max_elements=len(label_vectors), ef_construction=100, M=16, random_seed=0)
    index.add_items(label_vectors.astype(np.float32), np.arange(len(label_vectors)), num_threads=threads or -1)
    # a margin for the positives and own item that get skipped; a query with more positives
    # near it than that gets fewer negatives, which is harmless
    depth = min(2 * per_query + 32, len(label_vectors))
    index.set_ef(max(ef, depth))
    neighbours, _ = index.knn_query(query_vectors.astype(np.float32), k=depth, num_threads=threads or -1)
    mined = []
    for i, row in enumerate(neighbours):
        banned = set(Y.indices[Y.indptr[i] : Y.indptr[i + 1]].tolist()) | own_labels[i]
        mined.append(np.array([lab for lab in row if lab not in banned][:per_query], dtype=np.int64))
    return mined


class PslBatcher:
    """Builds :class:`Batch` objects: PSL positives + mined hard negatives, pooled.

    Args:
        Y: training label matrix (CSR, n × L); ``related`` reads all of it, positives only the
            targets that are not the instance's own item.
        own_labels: per training instance, the label ids of its own item (filter file).
        positives_per_query: β.
        negatives_per_query: η.
        rng: the run's random generator (seeded).
        soft_targets: ``Y``'s values are target weights (:mod:`training.gandalf`); the batch's
            ``positives`` are then those weights instead of a bool mask.
    """

    def __init__(
        self,
        Y: sp.csr_matrix,
        own_labels: list[set[int]],
        positives_per_query: int,
        negatives_per_query: int,
        rng: np.random.Generator,
        soft_targets: bool = False,
    ):
        self.Y = (Y > 0).astype(np.float32).tocsr()
        self.targets = without_own_labels(Y.astype(np.float32).tocsr() if soft_targets else self.Y, own_labels)
        self.soft_targets = soft_targets
        self.own_labels = own_labels
        self.beta = positives_per_query
        self.eta = negatives_per_query
        self.rng = rng
        self.hard_negatives: list[np.ndarray] | None = None

    def sample_positives(self, row: int) -> np.ndarray:
        labels = self.targets.indices[self.targets.indptr[row] : self.targets.indptr[row + 1]]
        if len(labels) <= self.beta:
            return labels
        return self.rng.choice(labels, size=self.beta, replace=False)

    def sample_negatives(self, row: int) -> np.ndarray:
        if self.hard_negatives is None or self.eta <= 0:
            return np.zeros(0, dtype=np.int64)
        candidates = self.hard_negatives[row]
        if len(candidates) <= self.eta:
            return candidates
        return self.rng.choice(candidates, size=self.eta, replace=False)

    def make(self, queries: np.ndarray) -> Batch:
        picked = [np.concatenate([self.sample_positives(q), self.sample_negatives(q)]) for q in queries]
        pool = np.unique(np.concatenate(picked)).astype(np.int64)
        weights = self.targets[queries][:, pool].toarray()
        positives = weights if self.soft_targets else weights > 0
        column = {int(label): j for j, label in enumerate(pool)}
        ignore = np.zeros(positives.shape, dtype=bool)
        for i, q in enumerate(queries):
            for label in self.own_labels[q]:
                j = column.get(label)
                if j is not None:
                    ignore[i, j] = True
        block = self.Y[queries]
        related = (block @ block.T).toarray() > 0
        return Batch(queries=np.asarray(queries), pool=pool, positives=positives, ignore=ignore, related=related)
