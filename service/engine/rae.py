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
from typing import get_args

import numpy as np
import scipy.sparse as sp

from service.engine.manifest import RaeMode


def softmax(similarities: np.ndarray, tau: float) -> np.ndarray:
    z = similarities.astype(np.float64) / tau
    z -= z.max()
    w = np.exp(z)
    return w / w.sum()


RAE_MODES = get_args(RaeMode)


def key_weights(keys: np.ndarray, sims: np.ndarray, num_train: int, tau: float, mode: str) -> np.ndarray:
    """Aggregation weights of one query's retrieved keys (see the module docstring)."""
    if mode == "joint":
        return softmax(sims, tau)
    weights = np.zeros(len(keys), dtype=np.float64)
    for side in (keys < num_train, keys >= num_train):
        if side.any():
            weights[side] = softmax(sims[side], tau)
    return weights


def build_values(Y_train: sp.csr_matrix, lam: float) -> sp.csr_matrix:
    """V = [λ·Y_trn ; (1−λ)·I_L] as float32 CSR, shape (N + L) x L (RAE-XMC eq. 4)."""
    num_labels = Y_train.shape[1]
    Y = (Y_train > 0).astype(np.float32)
    V = sp.vstack([lam * Y, (1.0 - lam) * sp.identity(num_labels, dtype=np.float32, format="csr")])
    return V.tocsr().astype(np.float32)


def drop_excluded_keys(
    keys: np.ndarray, sims: np.ndarray, num_train: int, excluded: Collection[int], top_b: int
) -> tuple[np.ndarray, np.ndarray]:
    """Remove label keys (ids ≥ num_train) whose label is excluded; keep the best ``top_b``."""
    valid = keys >= 0
    if excluded:
        label_of_key = keys - num_train
        is_excluded_label = (keys >= num_train) & np.isin(label_of_key, np.fromiter(excluded, dtype=np.int64))
        valid &= ~is_excluded_label
    return keys[valid][:top_b], sims[valid][:top_b]


def aggregate(
    keys: np.ndarray,
    sims: np.ndarray,
    values: sp.csr_matrix,
    num_train: int,
    tau: float,
    top_b: int,
    excluded: Sequence[Collection[int]],
    mode: str = "joint",
) -> sp.csr_matrix:
    """Label scores for a batch: ``keys``/``sims`` are ``nq x m`` (m ≥ top_b) best-first.

    Returns an ``nq x L`` CSR matrix whose row i is softmax(sims_i / τ) · V[keys_i], with the
    excluded labels of query i removed from both the keys and the result.
    """
    nq = keys.shape[0]
    rows_keys, rows_weights = [], []
    for i in range(nq):
        if excluded[i]:
            kept_keys, kept_sims = drop_excluded_keys(keys[i], sims[i], num_train, excluded[i], top_b)
        else:
            valid = keys[i] >= 0
            kept_keys, kept_sims = keys[i][valid][:top_b], sims[i][valid][:top_b]
        rows_keys.append(kept_keys)
        rows_weights.append(key_weights(kept_keys, kept_sims, num_train, tau, mode) if kept_keys.size else np.zeros(0))
    indptr = np.concatenate([[0], np.cumsum([k.size for k in rows_keys])])
    W = sp.csr_matrix(
        (np.concatenate(rows_weights).astype(np.float32), np.concatenate(rows_keys), indptr),
        shape=(nq, values.shape[0]),
    )
    scores = (W @ values).tocsr()
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
