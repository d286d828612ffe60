"""Fit a sparse linear ranker (:mod:`engine.sparse`) over the lexical fusion's unit term
vectors: one weight vector per label, W (terms x labels), and a bias b. Two fits
(:data:`~bundle.SparseFitKind`):

* ``one_vs_rest``: one-vs-rest L2 logistic regression, the classic linear baseline, each label
  solved alone by liblinear (dual coordinate descent, C ``c``, the bias a regularised feature),
  the solver and settings of ``studies.peers``' TF-IDF + one-vs-rest LR peer. With ``dense_weight``
  (the default) each text's features are its term vector ⊕ ``dense_weight`` · its dense vector
  (the encoder's unit serving vector: the memory's key of the text), XR-Transformer's ranker over
  TF-IDF ⊕ the encoder's embedding; the dense half of the weights is ``D`` (labels x dim), read at
  serving from the query's own vector. For label sets of a few thousand
  (``SparseFitParams.one_vs_rest_max_labels``): every label is a pass over every text.
* ``centroid``: each label's weights are the unit mean of its texts' term vectors, its own
  text's added with weight ``label_weight`` (PECOS's PIFA label representation, a Rocchio
  classifier), b = 0: a closed form whose cost grows with the instances, not with instances x
  labels, and whose weights hold wherever a query lands. Weights below ``prune`` are dropped,
  which is what keeps a query's product to the few labels its terms point to.

Until issue 68 the one-vs-rest weights were fitted by 100 full-batch AdaGrad steps, far from the
optimum: on Cooking-StackExchange (712 tags) the same trained memory and held-out instances fused
with it read tst P@1 / P@5 73.94 / 31.66, with liblinear's 74.33 / 33.27 (docs/training-and-quality.md).
Whether the dense half is kept is chosen per data set on the held-out instances (``export.fuse``).

A discriminative fit restricted to each instance's positives and a shortlist of hard negatives
(XR-Linear's ranker trained on its matcher's negatives) was measured on Debian-Related and
dropped: served flat, without the matcher that made its shortlists, it scored labels it was never
trained against (dev P@1 39.4, R@100 42.8, against the centroid's 37.0 / 64.4; docs/training-and-quality.md).

Each label's own text is one of its texts (``label_texts``): a label no training instance carries
(zero-shot) still has weights, the lexical match on label text of the classic tail-label fallback.
A label appended to a live memory later gets the column a zero-shot label gets here, from its text
(:meth:`~engine.sparse.SparseRanker.label_columns`, the same code: the centroid and the
pruning live in :mod:`engine.sparse`).
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
from engine.offline import LABEL_WEIGHT, PRUNE, Lexicon, SparseRanker, centroid_columns, pruned
from export.baseline import solve_label

log = logging.getLogger("xmcserve.sparse_fit")


@dataclass(frozen=True)
class SparseFitParams:
    """How a sparse ranker is fitted (the defaults were chosen on Debian-Related's held-out
    training instances; docs/training-and-quality.md).

    Attributes:
        method: ``one_vs_rest``, ``centroid`` or ``auto`` (one-vs-rest up to
            ``one_vs_rest_max_labels`` labels, centroid beyond)
        c: liblinear's C, the inverse of the L2 penalty (one-vs-rest; the peer's 10)
        dense_weight: the scale of each text's dense vector beside its term vector (one-vs-rest;
            0: term vectors only)
        label_weight: the weight of a label's own text in its centroid
        prune: weights of smaller magnitude are dropped from the served W
        label_texts: each label's text is one of its texts
    """

    method: Literal["auto", "one_vs_rest", "centroid"] = "auto"
    one_vs_rest_max_labels: int = 2000
    c: float = 10.0
    dense_weight: float = 1.0
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
    dense: np.ndarray | None = None  # labels x dim: the weights of the query's dense vector


def fit_sparse_ranker(
    X: sp.csr_matrix,
    Y: sp.csr_matrix,
    label_rows: sp.csr_matrix | None,
    params: SparseFitParams,
    vectors: np.ndarray | None = None,
    label_vectors: np.ndarray | None = None,
) -> SparseFit:
    """W (terms x labels) and b fitted to the instances' unit term vectors ``X`` and their labels
    ``Y`` (instances x labels), with ``label_rows`` (each label's own term vector, labels x terms)
    as positives of their labels when ``params.label_texts``; a one-vs-rest fit with
    ``params.dense_weight`` also weighs the instances' dense ``vectors`` (instances x dim) and the
    labels' (``label_vectors``, with ``label_rows``), giving D."""
    started = time.perf_counter()
    labels = Y.shape[1]
    kind = params.kind(labels)
    X, Y = X.astype(np.float32).tocsr(), (Y > 0).astype(np.float32).tocsr()
    dense = None
    if kind == "centroid":
        weights, bias, pairs = _centroid(X, Y, label_rows if params.label_texts else None, params)
    else:
        with_labels = params.label_texts and label_rows is not None
        if with_labels:
            X = sp.vstack([X, label_rows.astype(np.float32)]).tocsr()
            Y = sp.vstack([Y, sp.identity(labels, format="csr", dtype=np.float32)]).tocsr()
        V = None
        if params.dense_weight:
            if vectors is None or (with_labels and label_vectors is None):
                raise ValueError("a one-vs-rest fit with dense_weight needs the texts' dense vectors")
            V = np.vstack([vectors, label_vectors]) if with_labels else np.asarray(vectors)
            if V.shape[0] != X.shape[0]:
                raise ValueError(f"one dense vector a text: {X.shape[0]} texts, {V.shape[0]} vectors")
            V = params.dense_weight * V.astype(np.float32)
        weights, dense, bias, pairs = _one_vs_rest(X, Y, V, params)
    weights = pruned(weights, params.prune)
    seconds = time.perf_counter() - started
    log.info("sparse ranker (%s) fitted on %d pairs in %.1f s: %d weights", kind, pairs, seconds, weights.nnz)
    return SparseFit(weights.astype(np.float32), bias.astype(np.float32), kind, pairs, seconds, dense)


def _one_vs_rest(X: sp.csr_matrix, Y: sp.csr_matrix, V: np.ndarray | None, params: SparseFitParams):
    """Each label's L2 logistic regression over the terms the texts use (⊕ ``V``), by liblinear's
    dual coordinate descent (``-s 7``): (W, D or None, b, pairs). D is scaled back to the raw
    dense vector (a served query's) so the margin reads v(q) itself."""
    from liblinear.liblinear import parameter, problem

    used = np.unique(X.indices)
    features = X[:, used].astype(np.float64)
    if V is not None:
        features = sp.hstack([features, sp.csr_matrix(V.astype(np.float64))])
    features = features.tocsr()
    features.sum_duplicates()
    labels, width = Y.shape[1], features.shape[1]
    positives = Y.tocsc()
    positives.eliminate_zeros()
    prob = problem(np.zeros(features.shape[0]), features, bias=1)
    options = parameter(f"-s 7 -c {params.c:g} -B 1 -q")
    w = np.zeros((width, labels), dtype=np.float32)
    b = np.zeros(labels, dtype=np.float32)
    for label in tqdm(range(labels), desc="one-vs-rest", unit="label", leave=False):
        coef, b[label] = solve_label(prob, positives, label, options)
        w[: len(coef), label] = coef
    terms = len(used)
    rows, cols = np.nonzero(w[:terms])
    weights = sp.csr_matrix((w[rows, cols], (used[rows], cols)), shape=(X.shape[1], labels))
    dense = None
    if V is not None:
        dense = np.ascontiguousarray((w[terms:] * params.dense_weight).T, dtype=np.float32)
    return weights, dense, b, X.shape[0] * labels


def _centroid(X: sp.csr_matrix, Y: sp.csr_matrix, label_rows: sp.csr_matrix | None, params: SparseFitParams):
    """Each label's unit mean of its texts' rows, its own text's row added at ``label_weight``: the
    runtime's code, which gives a label appended to a live memory its column alike
    (:meth:`~engine.sparse.SparseRanker.label_columns`)."""
    weights = centroid_columns((Y.T @ X).tocsr(), label_rows, params.label_weight)
    return weights, np.zeros(Y.shape[1], dtype=np.float32), Y.nnz


def fit_for_memory(
    lexicon: Lexicon,
    texts: list[str],
    Y: sp.csr_matrix,
    label_texts: list[str],
    depth: int,
    params: SparseFitParams,
    vectors: np.ndarray | None = None,
    label_vectors: np.ndarray | None = None,
) -> tuple[SparseRanker, SparseFit]:
    """The sparse ranker of a memory whose instances are ``texts`` (labels ``Y``) and whose labels'
    texts are ``label_texts``, over ``lexicon``'s term space, serving ``depth`` candidates a query;
    ``vectors`` and ``label_vectors``: their keys' dense vectors (a one-vs-rest fit with dense
    weights reads them)."""
    fit = fit_sparse_ranker(lexicon.rows(texts), Y, lexicon.rows(label_texts), params, vectors, label_vectors)
    return SparseRanker(fit.weights, fit.bias, depth, fit.kind, params.as_dict(), fit.dense), fit
