"""XMC ranking metrics: P@k, nDCG@k, PSP@k, R@k and macro-F1@k over label-frequency segments.

All functions take ``ranked``: an ``n x K`` int array of label ids, best first, padded with
``-1`` where fewer than ``K`` labels were returned, and ``Y``: the ``n x L`` CSR ground truth.
Instances with no positive label count as 0 for P, nDCG and R (they are kept in the mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from xmc.data import XMCDataset, label_frequencies

# The four figures every quality comparison leads with (the peers' tables report these), and the
# wider set an embedding evaluation and a training run's model selection read.
HEADLINE = ("P@1", "P@5", "PSP@5", "R@100")
DETAILED = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@5", "R@10", "R@100")

# Jain et al. (2016) propensity parameters (A, B) used by the XMC repository.
PROPENSITY_PRESETS: dict[str, tuple[float, float]] = {
    "default": (0.55, 1.5),
    "amazon": (0.6, 2.6),
    "wikipedia": (0.5, 0.4),
}


def inverse_propensity(train_freq: np.ndarray, num_train: int, a: float = 0.55, b: float = 1.5) -> np.ndarray:
    """Inverse propensity 1/p_l of Jain et al. (2016).

    p_l = 1 / (1 + C·(N_l + B)^(−A)),  C = (ln N − 1)·(B + 1)^A,
    where N_l is the label's training frequency and N the number of training instances.
    """
    c = (np.log(num_train) - 1.0) * (b + 1.0) ** a
    return 1.0 + c * (np.asarray(train_freq, dtype=np.float64) + b) ** (-a)


def hits_matrix(ranked: np.ndarray, Y: sp.csr_matrix) -> np.ndarray:
    """``n x K`` bool: whether ``ranked[i, j]`` is a positive of instance ``i``."""
    ranked = np.asarray(ranked)
    hits = np.zeros(ranked.shape, dtype=bool)
    Y = Y.tocsr()
    for i in range(ranked.shape[0]):
        positives = Y.indices[Y.indptr[i] : Y.indptr[i + 1]][Y.data[Y.indptr[i] : Y.indptr[i + 1]] > 0]
        if positives.size:
            hits[i] = np.isin(ranked[i], positives) & (ranked[i] >= 0)
    return hits


def _num_positives(Y: sp.csr_matrix) -> np.ndarray:
    return np.asarray((Y > 0).sum(axis=1)).ravel()


def precision_at_k(hits: np.ndarray, k: int) -> float:
    """P@k = mean over instances of |top-k ∩ positives| / k."""
    return float(hits[:, :k].sum(axis=1).mean() / k)


def recall_at_k(hits: np.ndarray, Y: sp.csr_matrix, k: int) -> float:
    """R@k = mean over instances of |top-k ∩ positives| / |positives|."""
    npos = _num_positives(Y)
    found = hits[:, :k].sum(axis=1)
    return float(np.divide(found, npos, out=np.zeros(len(npos)), where=npos > 0).mean())


def ndcg_at_k(hits: np.ndarray, Y: sp.csr_matrix, k: int) -> float:
    """nDCG@k with binary gains: DCG = Σ_j hit_j / log2(j + 2), normalised by the ideal DCG
    over min(k, |positives|) positions."""
    discounts = 1.0 / np.log2(np.arange(k) + 2.0)
    dcg = (hits[:, :k] * discounts[: hits[:, :k].shape[1]]).sum(axis=1)
    ideal_cum = np.concatenate([[0.0], np.cumsum(discounts)])
    idcg = ideal_cum[np.minimum(_num_positives(Y), k)]
    return float(np.divide(dcg, idcg, out=np.zeros(len(dcg)), where=idcg > 0).mean())


def psp_at_k(ranked: np.ndarray, hits: np.ndarray, Y: sp.csr_matrix, inv_prop: np.ndarray, k: int) -> float:
    """Propensity-scored precision, normalised by the best achievable value (as in pyxclib).

    PSP@k = Σ_i Σ_{j<k} hit_ij / p_{ranked_ij}  /  Σ_i Σ_{top-k of i's positives by 1/p} 1/p_l
    """
    top = ranked[:, :k]
    gained = np.where(hits[:, :k], inv_prop[np.maximum(top, 0)], 0.0).sum()
    Y = Y.tocsr()
    best = 0.0
    for i in range(Y.shape[0]):
        cols = Y.indices[Y.indptr[i] : Y.indptr[i + 1]]
        if cols.size:
            best += np.sort(inv_prop[cols])[::-1][:k].sum()
    return float(gained / best) if best > 0 else 0.0


@dataclass(frozen=True)
class Segments:
    """Label-frequency segments by training frequency: tail ≤ edges[0] < torso ≤ edges[1] < head.

    Zero-shot labels (frequency 0) fall into the tail.
    """

    tail_max: int = 10
    torso_max: int = 100

    def assign(self, train_freq: np.ndarray) -> dict[str, np.ndarray]:
        f = np.asarray(train_freq)
        return {
            "head": f > self.torso_max,
            "torso": (f > self.tail_max) & (f <= self.torso_max),
            "tail": f <= self.tail_max,
        }


def macro_f1_at_k(
    ranked: np.ndarray, hits: np.ndarray, Y: sp.csr_matrix, train_freq: np.ndarray, k: int, segments: Segments
) -> dict[str, float]:
    """Macro-averaged F1@k per segment (RAE-XMC appendix): F1_l = 2·TP_l / (2·TP_l + FP_l + FN_l).

    Averaged over the segment's labels that have at least one positive in the evaluated split.
    """
    num_labels = Y.shape[1]
    top = ranked[:, :k]
    valid = top >= 0
    predicted = np.bincount(top[valid], minlength=num_labels)
    true_pos = np.bincount(top[hits[:, :k]], minlength=num_labels)
    positives = np.asarray((Y > 0).sum(axis=0)).ravel()
    f1 = np.divide(2.0 * true_pos, predicted + positives, out=np.zeros(num_labels), where=positives > 0)
    out = {}
    for name, mask in segments.assign(train_freq).items():
        members = mask & (positives > 0)
        out[name] = float(f1[members].mean()) if members.any() else float("nan")
    return out


def compute_all(
    ranked: np.ndarray,
    Y: sp.csr_matrix,
    train_freq: np.ndarray,
    num_train: int,
    ks: tuple[int, ...] = (1, 3, 5),
    recall_ks: tuple[int, ...] = (10, 100),
    propensity: tuple[float, float] = PROPENSITY_PRESETS["default"],
    segments: Segments | None = None,
    f1_k: int = 5,
) -> dict[str, float]:
    """Every metric at once, as percentages keyed like ``"P@1"``, ``"PSP@5"``, ``"F1@5/tail"``."""
    ranked = np.asarray(ranked, dtype=np.int64)
    hits = hits_matrix(ranked, Y)
    inv_prop = inverse_propensity(train_freq, num_train, *propensity)
    out: dict[str, float] = {}
    for k in ks:
        out[f"P@{k}"] = 100 * precision_at_k(hits, k)
    for k in ks:
        out[f"nDCG@{k}"] = 100 * ndcg_at_k(hits, Y, k)
    for k in ks:
        out[f"PSP@{k}"] = 100 * psp_at_k(ranked, hits, Y, inv_prop, k)
    for k in recall_ks:
        out[f"R@{k}"] = 100 * recall_at_k(hits, Y, k)
    for name, value in macro_f1_at_k(ranked, hits, Y, train_freq, f1_k, segments or Segments()).items():
        out[f"F1@{f1_k}/{name}"] = 100 * value
    return out


def drop_excluded(candidates, exclude: list[set[int]], k: int) -> np.ndarray:
    """The first ``k`` of each row's best-first ``candidates`` that are not in its ``exclude``
    set, as a [rows, k] array padded with −1 (what the metrics read): the "filter after ranking"
    protocol, the peers' (:mod:`xmc.evaluate`)."""
    ranked = np.full((len(candidates), k), -1, dtype=np.int64)
    for i, row in enumerate(candidates):
        kept = [lab for lab in row if lab not in exclude[i]][:k] if exclude[i] else list(row[:k])
        ranked[i, : len(kept)] = kept
    return ranked


def score_ranking(ranked: np.ndarray, dev: XMCDataset, train: XMCDataset) -> dict[str, float]:
    """The :data:`DETAILED` metrics of a ranking of ``dev``, rounded; PSP's propensities from ``train``."""
    metrics = compute_all(ranked, dev.Y, label_frequencies(train.Y), len(train), recall_ks=(10, 100))
    return {name: round(metrics[name], 2) for name in DETAILED if name in metrics}
