"""A sparse linear ranker: the second candidate source of a score fusion, beside the memory.

The memory's candidates are the labels its top-b keys vote for: training and fusion reorder them,
they never find a label no near key carries. The classic XMC rankers find labels by their literal
pieces instead (Parabel, Bonsai, XR-Linear: TF-IDF features, one linear model per label). This
ranker is one of them, over the lexical fusion's term space (:mod:`service.engine.lexical`: the
bundle tokenizer's word pieces and hashed pairs, idf-weighted, unit length), so a query's terms
are computed once, from the tokenization the encoder already made:

    margin_l(q) = Σ_t q_t · W[t, l] + b_l

``W`` (terms x labels, CSR) and ``b`` are fitted at export (:mod:`export.sparse_fit`): one-vs-rest
logistic regression on small label sets, each label's centroid of its texts (PECOS's PIFA) on
large ones. A query's margins
are one sparse product over the rows of its own terms, in scipy's compiled code: no Python object
per label, and a query's row depends on nothing else in its batch (each output row is summed over
that query's terms in term order). Its top :attr:`SparseRanker.depth` labels join the fusion's
candidates (:meth:`~service.engine.fusion.ScoreFusion.candidates`), and every candidate's margin
and rank here are features of φ (:data:`~service.engine.fusion.SPARSE_FEATURES`).

Labels added to a live memory after export have no weights: they are never this source's
candidates, and their margin is the lowest bias (what a label no term of the query points to has).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bundle import BundleError, load_csr
from service.engine.lexical import QueryTerms, query_matrix


@dataclass(frozen=True)
class SparseMargins:
    """A batch's margins: ``all``, every label that shares a term with its query (queries x
    labels CSR, label ids sorted per row), and ``top``, each query's best :attr:`SparseRanker.depth`
    of them (excluded labels left out) with their ranks (0: the best), in ``top``'s storage order."""

    all: sp.csr_matrix
    top: sp.csr_matrix
    top_ranks: np.ndarray


@dataclass(frozen=True)
class SparseRanker:
    """``weights`` (terms x labels, float32 CSR), ``bias`` (one per label, float32) and the
    number of labels each query's margins add to the candidates (``depth``)."""

    weights: sp.csr_matrix
    bias: np.ndarray
    depth: int

    def __post_init__(self) -> None:
        if self.bias.shape != (self.weights.shape[1],) or not np.all(np.isfinite(self.bias)):
            raise ValueError(f"the bias must be {self.weights.shape[1]} finite values, one per label")
        if self.depth < 1:
            raise ValueError(f"a sparse ranker's depth must be at least 1, not {self.depth}")

    @property
    def labels(self) -> int:
        return self.weights.shape[1]

    @property
    def floor(self) -> float:
        """The margin of a label without weights (appended after export): the lowest bias."""
        return float(self.bias.min()) if len(self.bias) else 0.0

    def save(self, path: Path) -> None:
        weights = self.weights.astype(np.float32).tocsr()
        weights.sort_indices()
        np.savez_compressed(
            path,
            format=np.array("csr"),
            shape=np.array(weights.shape),
            indptr=weights.indptr,
            indices=weights.indices,
            data=weights.data,
            bias=self.bias.astype(np.float32),
        )

    @classmethod
    def load(cls, path: Path, terms: int, labels: int, depth: int) -> SparseRanker:
        """The ranker in ``path`` (written by :meth:`save`), refused unless its weights are a sound
        ``terms x labels`` CSR matrix and its bias ``labels`` finite values."""
        weights = load_csr(path, (terms, labels), "sparse ranker weights")
        try:
            with np.load(path, allow_pickle=False) as npz:
                bias = npz["bias"]
        except (KeyError, OSError, ValueError) as exc:
            raise BundleError(f"{path}: sparse ranker refused: no readable bias ({exc})") from None
        if bias.shape != (labels,) or bias.dtype.kind != "f" or not np.all(np.isfinite(bias)):
            raise BundleError(f"{path}: sparse ranker refused: the bias is not {labels} finite values")
        weights.sort_indices()
        return cls(weights, bias.astype(np.float32), depth)

    def margins(self, queries: list[QueryTerms], width: int, exclude: Sequence[Collection[int]]) -> SparseMargins:
        """The margins of ``queries`` over a label space ``width`` wide (a live memory's, which may
        have more labels than the weights), and each query's top :attr:`depth` of them, its
        ``exclude`` labels left out."""
        products = (query_matrix(queries, self.weights.shape[0]) @ self.weights).tocsr()
        products.sort_indices()  # the product's rows come out in the order its accumulator met the labels
        data = (products.data + self.bias[products.indices]).astype(np.float32)
        all_margins = sp.csr_matrix(
            (data, products.indices, products.indptr), shape=(len(queries), max(width, self.labels))
        )
        top, ranks = top_margins(all_margins, self.depth, exclude)
        return SparseMargins(all_margins, top, ranks)

    def margin_of(self, margins: SparseMargins, query: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The margin of each pair ``(query[j], labels[j])``: its stored margin, the label's bias
        when no term of the query points to it, :attr:`floor` for a label without weights."""
        out = np.full(len(labels), self.floor, dtype=np.float64)
        known = labels < self.labels
        out[known] = self.bias[labels[known]]
        at, found = StoredSlots(margins.all)(query, labels)
        out[found] = margins.all.data[at]
        return out


def top_margins(
    margins: sp.csr_matrix, depth: int, exclude: Sequence[Collection[int]]
) -> tuple[sp.csr_matrix, np.ndarray]:
    """Each row's ``depth`` highest entries (ties: the lower label id first), its ``exclude`` labels
    left out, as a CSR of the same shape (label ids sorted per row), and each kept entry's rank."""
    rows, keep, ranks = [], [], []
    for i in range(margins.shape[0]):
        start, end = margins.indptr[i], margins.indptr[i + 1]
        labels, values = margins.indices[start:end], margins.data[start:end]
        allowed = np.arange(start, end)
        if exclude[i]:
            mask = ~np.isin(labels, np.fromiter(exclude[i], dtype=np.int64))
            allowed, labels, values = allowed[mask], labels[mask], values[mask]
        if len(values) > depth:
            # the depth-th highest margin in O(n), then exactly the entries a full sort would keep:
            # every one above it and, of those equal to it, the lowest label ids (labels are sorted)
            kth = np.partition(values, len(values) - depth)[len(values) - depth]
            above = np.flatnonzero(values > kth)
            tied = np.flatnonzero(values == kth)[: depth - len(above)]
            chosen = np.concatenate([above, tied])
            allowed, labels, values = allowed[chosen], labels[chosen], values[chosen]
        order = np.lexsort((labels, -values))
        by_label = np.argsort(labels[order], kind="stable")
        keep.append(allowed[order][by_label])
        ranks.append(by_label)  # the j-th kept entry (label order) is order[by_label[j]]: that rank
        rows.append(len(order))
    at = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    top = sp.csr_matrix((margins.data[at], margins.indices[at], indptr), shape=margins.shape)
    return top, (np.concatenate(ranks).astype(np.int64) if ranks else np.zeros(0, dtype=np.int64))


class StoredSlots:
    """Where (query, label) pairs are stored in a queries x labels CSR matrix, whatever its storage
    order: a batch's p̂ (aggregated in key order) and the ranker's margins (label ids sorted per
    row, which spares the sort) are looked up alike."""

    def __init__(self, matrix: sp.csr_matrix):
        self.width = matrix.shape[1]
        self.rows = np.repeat(np.arange(matrix.shape[0], dtype=np.int64), np.diff(matrix.indptr))  # of each entry
        stored = self.rows * self.width + matrix.indices
        if matrix.has_sorted_indices:  # increasing already: rows in order, label ids sorted within each
            self.order, self.sorted = None, stored
        else:
            self.order = np.argsort(stored, kind="stable")
            self.sorted = stored[self.order]

    def __call__(self, query: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The storage positions of those pairs ``(query[j], labels[j])`` that are stored, and
        which pairs are (a mask)."""
        if not len(self.sorted):
            return np.zeros(0, dtype=np.int64), np.zeros(len(labels), dtype=bool)
        wanted = query.astype(np.int64) * self.width + labels
        at = np.minimum(np.searchsorted(self.sorted, wanted), len(self.sorted) - 1)
        hit = (self.sorted[at] == wanted) & (labels < self.width)
        return (at[hit] if self.order is None else self.order[at[hit]]), hit
