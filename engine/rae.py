"""RAE-XMC aggregation (Retrieval-augmented Encoders for XMC, eq. 7 and Alg. 1).

Given the top-b keys of the knowledge memory K = [X_trn ; Z_labels] for each query,

    p̂ = softmax(q·K_topbᵀ / τ) · V_topb,    V = [λ·Y_trn ; (1−λ)·I_L]

computed as one sparse product for the whole batch. Keys whose label the caller excluded are
removed *before* the softmax, so a same-item key cannot take the probability mass.

Two weightings of the retrieved keys (the bundle's ``rae.mode``):

* ``joint`` (RAE-XMC eq. 7): one softmax over all top-b keys, instances and labels together;
* ``split``: one softmax over the retrieved instance keys and one over the retrieved label
  keys, so p̂ = λ·softmax(q·X_b/τ)·Y + (1−λ)·softmax(q·Z_b/τ): λ is then the exact share of
  the mass the instance memory gets, however many of the top-b keys are instances.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple, get_args

import numpy as np
import scipy.sparse as sp

from bundle import RaeMode


def softmax(similarities: np.ndarray, tau: float) -> np.ndarray:
    z = similarities.astype(np.float64) / tau
    z -= z.max()
    w = np.exp(z)
    return w / w.sum()


RAE_MODES = get_args(RaeMode)


def key_weights(key_labels: np.ndarray, sims: np.ndarray, tau: float, mode: str) -> np.ndarray:
    """Aggregation weights of one query's retrieved keys (see the module docstring);
    ``key_labels``: the label id of each key, −1 for an instance key."""
    if mode == "joint":
        return softmax(sims, tau)
    weights = np.zeros(len(key_labels), dtype=np.float64)
    for side in (key_labels < 0, key_labels >= 0):
        if side.any():
            weights[side] = softmax(sims[side], tau)
    return weights


def labels_of_keys(keys: np.ndarray, num_train: int) -> np.ndarray:
    """The label id of each key of a memory laid out [instances ; labels]; −1 for an instance
    key and for no key (−1)."""
    return np.where(keys >= num_train, keys - num_train, -1)


@dataclass(frozen=True)
class ValueRows:
    """V as a bundle's rows plus rows appended to a live memory (the bundle's matrix is never
    copied); ``appended`` is as wide as the label set has grown."""

    base: sp.csr_matrix
    appended: sp.csr_matrix | None = None

    @property
    def num_labels(self) -> int:
        return (self.appended if self.appended is not None else self.base).shape[1]

    @property
    def num_rows(self) -> int:
        return self.base.shape[0] + (self.appended.shape[0] if self.appended is not None else 0)

    def weigh(self, W: sp.csr_matrix) -> sp.csr_matrix:
        """W·V for the key weights W (queries x rows): label scores, queries x labels."""
        if self.appended is None:
            return (W @ self.base).tocsr()
        rows = self.base.shape[0]
        scores = widen((W[:, :rows] @ self.base).tocsr(), self.num_labels)
        return (scores + W[:, rows:] @ self.appended).tocsr()

    def row_labels(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The label ids stored in each of ``rows`` (concatenated, in row order) and how many each
        row holds: a gather over the CSR arrays, without building a matrix."""
        parts = [(self.base, 0)] + ([(self.appended, self.base.shape[0])] if self.appended is not None else [])
        labels, _, counts = gather_rows(parts, rows)
        return labels, counts

    def extended(self, rows: sp.csr_matrix) -> ValueRows:
        """These rows followed by ``rows`` (whose width is the new label count)."""
        parts = [widen(self.appended, rows.shape[1])] if self.appended is not None else []
        return ValueRows(self.base, sp.vstack([*parts, rows], format="csr"))


def gather_rows(parts: list[tuple[sp.csr_matrix, int]], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stored (column indices, values) of each of ``rows`` of a matrix kept in consecutive
    CSR parts, ``(part, its first row)`` in row order, concatenated in row order; and how many
    each row holds. A gather over the CSR arrays: no row slicing, no matrix built."""
    counts = np.zeros(len(rows), dtype=np.int64)
    starts = np.zeros(len(rows), dtype=np.int64)
    owner = np.zeros(len(rows), dtype=np.int64)
    bounds = [first for _, first in parts[1:]] + [np.iinfo(np.int64).max]
    for part, ((matrix, first), end) in enumerate(zip(parts, bounds, strict=True)):
        mine = (rows >= first) & (rows < end)
        local = rows[mine] - first
        starts[mine] = matrix.indptr[local]
        counts[mine] = matrix.indptr[local + 1] - matrix.indptr[local]
        owner[mine] = part
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    positions = offsets + np.arange(counts.sum())
    indices = np.empty(len(positions), dtype=np.int64)
    data = np.empty(len(positions), dtype=np.float32)
    which = np.repeat(owner, counts)
    for part, (matrix, _) in enumerate(parts):
        here = which == part
        indices[here] = matrix.indices[positions[here]]
        data[here] = matrix.data[positions[here]]
    return indices, data, counts


def widen(matrix: sp.csr_matrix, columns: int) -> sp.csr_matrix:
    """The same rows with more (empty) columns, sharing the arrays."""
    if matrix.shape[1] == columns:
        return matrix
    return sp.csr_matrix((matrix.data, matrix.indices, matrix.indptr), shape=(matrix.shape[0], columns))


class KeptKeys(NamedTuple):
    """One query's retrieved keys after its exclusions, best first: key ids, similarities, label
    ids (−1: an instance key) and, when the score fusion reads them, lexical similarities."""

    keys: np.ndarray
    sims: np.ndarray
    labels: np.ndarray
    lexical: np.ndarray | None = None


def drop_excluded_keys(
    keys: np.ndarray,
    sims: np.ndarray,
    key_labels: np.ndarray,
    excluded: Collection[int],
    top_b: int,
    lexical: np.ndarray | None = None,
) -> KeptKeys:
    """Remove label keys whose label is excluded (and no-keys, −1); keep the best ``top_b``."""
    valid = keys >= 0
    if excluded:
        valid &= ~np.isin(key_labels, np.fromiter(excluded, dtype=np.int64)) | (key_labels < 0)
    kept = (a[valid][:top_b] for a in (keys, sims, key_labels))
    return KeptKeys(*kept, lexical[valid][:top_b] if lexical is not None else None)


def keep_keys(
    keys: np.ndarray,
    sims: np.ndarray,
    key_labels: np.ndarray,
    excluded: Sequence[Collection[int]],
    top_b: int,
    lexical: np.ndarray | None = None,
) -> list[KeptKeys]:
    """Per query of a batch (``nq x m``, best first), the keys its aggregation weighs."""
    return [
        drop_excluded_keys(
            keys[i], sims[i], key_labels[i], excluded[i], top_b, lexical[i] if lexical is not None else None
        )
        for i in range(keys.shape[0])
    ]


def aggregate(
    keys: np.ndarray,
    sims: np.ndarray,
    key_labels: np.ndarray,
    values: ValueRows,
    tau: float,
    top_b: int,
    excluded: Sequence[Collection[int]],
    mode: str = "joint",
) -> sp.csr_matrix:
    """Label scores for a batch: ``keys``/``sims`` are ``nq x m`` (m ≥ top_b) best-first, −1 for
    no key; ``key_labels`` (same shape) the label id of each key, −1 for an instance key.

    Returns an ``nq x L`` CSR matrix whose row i is softmax(sims_i / τ) · V[keys_i], with the
    excluded labels of query i removed from both the keys and the result.
    """
    return aggregate_kept(keep_keys(keys, sims, key_labels, excluded, top_b), values, tau, excluded, mode)


def aggregate_kept(
    kept: list[KeptKeys], values: ValueRows, tau: float, excluded: Sequence[Collection[int]], mode: str = "joint"
) -> sp.csr_matrix:
    """:func:`aggregate` over keys already kept by :func:`keep_keys` (a caller that reads them
    again, such as the score fusion, keeps them once)."""
    rows_keys = [row.keys for row in kept]
    rows_weights = [key_weights(row.labels, row.sims, tau, mode) if row.keys.size else np.zeros(0) for row in kept]
    indptr = np.concatenate([[0], np.cumsum([k.size for k in rows_keys])])
    W = sp.csr_matrix(
        (np.concatenate(rows_weights).astype(np.float32), np.concatenate(rows_keys), indptr),
        shape=(len(kept), values.num_rows),
    )
    scores = values.weigh(W)
    return _zero_excluded(scores, excluded)


def _zero_excluded(scores: sp.csr_matrix, excluded: Sequence[Collection[int]]) -> sp.csr_matrix:
    if not any(excluded):
        return scores
    for i, labels in enumerate(excluded):
        if labels:
            start, end = scores.indptr[i], scores.indptr[i + 1]
            hit = np.isin(scores.indices[start:end], np.fromiter(labels, dtype=np.int64))
            scores.data[start:end][hit] = 0.0
    scores.eliminate_zeros()
    return scores


def top_k_of_row(scores: sp.csr_matrix, row: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best (label id, score) of one CSR row, best first; ties broken by label id."""
    start, end = scores.indptr[row], scores.indptr[row + 1]
    ids, vals = scores.indices[start:end], scores.data[start:end]
    if ids.size > k:
        part = np.argpartition(-vals, k - 1)[:k]
        ids, vals = ids[part], vals[part]
    order = np.lexsort((ids, -vals))
    return ids[order].astype(np.int64), vals[order].astype(np.float32)
