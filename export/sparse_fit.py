"""Fit a sparse linear ranker (:mod:`service.engine.sparse`) over the lexical fusion's unit term
vectors: one weight vector per label, W (terms x labels), and a bias b. Two fits
(:data:`~bundle.SparseFitKind`):

* ``one_vs_rest``: one-vs-rest logistic regression, the classic linear baseline,

      minimise  Σ_i Σ_l  log(1 + exp(−s_il · (x_i·w_l + b_l)))  +  λ/2 ‖W‖²,   s_il = ±1

  over every (text, label) pair, solved for all labels at once by full-batch AdaGrad (the margins
  of all pairs are one sparse x dense product over the terms the texts use). For label sets of a
  few thousand (``SparseFitParams.one_vs_rest_max_labels``).
* ``centroid``: each label's weights are the unit mean of its texts' term vectors, its own
  text's added with weight ``label_weight`` (PECOS's PIFA label representation, a Rocchio
  classifier), b = 0: a closed form whose cost grows with the instances, not with instances x
  labels, and whose weights hold wherever a query lands. Weights below ``prune`` are dropped,
  which is what keeps a query's product to the few labels its terms point to.

A discriminative fit restricted to each instance's positives and a shortlist of hard negatives
(XR-Linear's ranker trained on its matcher's negatives) was measured on Debian-Related and
dropped: served flat, without the matcher that made its shortlists, it scored labels it was never
trained against (dev P@1 39.4, R@100 42.8, against the centroid's 37.0 / 64.4; docs/training-and-quality.md).

Each label's own text is one of its texts (``label_texts``): a label no training instance carries
(zero-shot) still has weights, the lexical match on label text of the classic tail-label fallback.
A label appended to a live memory later gets the column a zero-shot label gets here, from its text
(:meth:`~service.engine.sparse.SparseRanker.label_columns`, the same code: the centroid and the
pruning live in :mod:`service.engine.sparse`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import scipy.sparse as sp
from tqdm import tqdm

from bundle import SparseFitKind
from service.engine.offline import LABEL_WEIGHT, PRUNE, Lexicon, SparseRanker, centroid_columns, pruned

log = logging.getLogger("xmcserve.sparse_fit")


@dataclass(frozen=True)
class SparseFitParams:
    """How a sparse ranker is fitted (the defaults were chosen on Debian-Related's held-out
    training instances; docs/training-and-quality.md).

    Attributes:
        method: ``one_vs_rest``, ``centroid`` or ``auto`` (one-vs-rest up to
            ``one_vs_rest_max_labels`` labels, centroid beyond)
        epochs: AdaGrad steps over all pairs (one-vs-rest)
        learning_rate: AdaGrad's step (one-vs-rest)
        l2: λ, the weights' L2 penalty (one-vs-rest)
        label_weight: the weight of a label's own text in its centroid
        prune: weights of smaller magnitude are dropped from the served W
        label_texts: each label's text is one of its texts
    """

    method: Literal["auto", "one_vs_rest", "centroid"] = "auto"
    one_vs_rest_max_labels: int = 2000
    epochs: int = 100
    learning_rate: float = 0.5
    l2: float = 1e-4
    label_weight: float = LABEL_WEIGHT
    prune: float = PRUNE
    label_texts: bool = True

    def kind(self, labels: int) -> SparseFitKind:
        if self.method != "auto":
            return self.method
        return "one_vs_rest" if labels <= self.one_vs_rest_max_labels else "centroid"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SparseFit:
    weights: sp.csr_matrix  # terms x labels
    bias: np.ndarray
    kind: SparseFitKind
    pairs: int
    seconds: float


def fit_sparse_ranker(
    X: sp.csr_matrix, Y: sp.csr_matrix, label_rows: sp.csr_matrix | None, params: SparseFitParams
) -> SparseFit:
    """W (terms x labels) and b fitted to the instances' unit term vectors ``X`` and their labels
    ``Y`` (instances x labels), with ``label_rows`` (each label's own term vector, labels x terms)
    as positives of their labels when ``params.label_texts``."""
    started = time.perf_counter()
    labels = Y.shape[1]
    kind = params.kind(labels)
    X, Y = X.astype(np.float32).tocsr(), (Y > 0).astype(np.float32).tocsr()
    if kind == "centroid":
        weights, bias, pairs = _centroid(X, Y, label_rows if params.label_texts else None, params)
    else:
        if params.label_texts and label_rows is not None:
            X = sp.vstack([X, label_rows.astype(np.float32)]).tocsr()
            Y = sp.vstack([Y, sp.identity(labels, format="csr", dtype=np.float32)]).tocsr()
        weights, bias, pairs = _one_vs_rest(X, Y, params)
    weights = pruned(weights, params.prune)
    seconds = time.perf_counter() - started
    log.info("sparse ranker (%s) fitted on %d pairs in %.1f s: %d weights", kind, pairs, seconds, weights.nnz)
    return SparseFit(weights.astype(np.float32), bias.astype(np.float32), kind, pairs, seconds)


def _adagrad(params: SparseFitParams, w: np.ndarray, b: np.ndarray, gradient, what: str) -> None:
    """``params.epochs`` AdaGrad steps of (w, b) in place; ``gradient(w, b)`` → (loss, gw, gb)."""
    g2w, g2b = np.zeros_like(w), np.zeros_like(b)
    steps = tqdm(range(params.epochs), desc=what, unit="epoch", leave=False)
    for _ in steps:
        loss, gw, gb = gradient(w, b)
        gw += params.l2 * w
        g2w += gw * gw
        g2b += gb * gb
        w -= params.learning_rate * gw / (np.sqrt(g2w) + 1e-8)
        b -= params.learning_rate * gb / (np.sqrt(g2b) + 1e-8)
        steps.set_postfix(loss=f"{loss:.4f}", refresh=False)


def _sigmoid(s: np.ndarray) -> np.ndarray:
    return (0.5 * (1.0 + np.tanh(0.5 * s))).astype(np.float32)


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def _one_vs_rest(X: sp.csr_matrix, Y: sp.csr_matrix, params: SparseFitParams):
    """Every (instance, label) pair, dense over the terms the texts use."""
    used = np.unique(X.indices)
    Xu = X[:, used].tocsr()
    XuT = Xu.T.tocsr()
    labels = Y.shape[1]
    w = np.zeros((len(used), labels), dtype=np.float32)
    b = np.full(labels, -np.log(labels), dtype=np.float32)  # a label's prior odds: most pairs are negative
    Yd = Y.toarray()

    def gradient(w, b):
        p = _sigmoid(Xu @ w + b)
        r = p - Yd
        return _log_loss(p, Yd), np.asarray(XuT @ r, dtype=np.float32), r.sum(axis=0)

    _adagrad(params, w, b, gradient, "one-vs-rest")
    rows, cols = np.nonzero(w)
    weights = sp.csr_matrix((w[rows, cols], (used[rows], cols)), shape=(X.shape[1], labels))
    return weights, b, X.shape[0] * labels


def _centroid(X: sp.csr_matrix, Y: sp.csr_matrix, label_rows: sp.csr_matrix | None, params: SparseFitParams):
    """Each label's unit mean of its texts' rows, its own text's row added at ``label_weight``: the
    runtime's code, which gives a label appended to a live memory its column alike
    (:meth:`~service.engine.sparse.SparseRanker.label_columns`)."""
    weights = centroid_columns((Y.T @ X).tocsr(), label_rows, params.label_weight)
    return weights, np.zeros(Y.shape[1], dtype=np.float32), Y.nnz


def fit_for_memory(
    lexicon: Lexicon,
    texts: list[str],
    Y: sp.csr_matrix,
    label_texts: list[str],
    depth: int,
    params: SparseFitParams,
) -> tuple[SparseRanker, SparseFit]:
    """The sparse ranker of a memory whose instances are ``texts`` (labels ``Y``) and whose labels'
    texts are ``label_texts``, over ``lexicon``'s term space, serving ``depth`` candidates a query."""
    fit = fit_sparse_ranker(lexicon.rows(texts), Y, lexicon.rows(label_texts), params)
    return SparseRanker(fit.weights, fit.bias, depth, fit.kind, params.as_dict()), fit
