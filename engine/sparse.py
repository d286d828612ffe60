"""A sparse linear ranker: the second candidate source of a score fusion, beside the memory.

The memory's candidates are the labels its top-b keys vote for: training and fusion reorder them,
they never find a label no near key carries. The classic XMC rankers find labels by their literal
pieces instead (Parabel, Bonsai, XR-Linear: TF-IDF features, one linear model per label). This
ranker is one of them, over the lexical fusion's term space (:mod:`engine.lexical`: the
bundle tokenizer's word pieces and hashed pairs, idf-weighted, unit length), so a query's terms
are computed once, from the tokenization the encoder already made:

    margin_l(q) = Σ_t q_t · W[t, l] + v(q) · D[l] + b_l

``W`` (terms x labels, CSR) and ``b`` are fitted at export (:mod:`export.sparse_fit`): one-vs-rest
logistic regression on small label sets, each label's centroid of its texts (PECOS's PIFA) on
large ones. A one-vs-rest ranker may also weigh the query's own dense vector v(q) (the encoder's
unit serving vector, which the search already has): ``D`` (labels x dim, float32) is the dense
half of XR-Transformer's ranker, a linear model per label over TF-IDF ⊕ the fine-tuned encoder's
embedding. Its part of a margin is one matrix-vector product a query (each query's own call, so
a row never depends on its batch), and every fitted label then has a margin. A query's margins
are one sparse product over the rows of its own terms, in scipy's compiled code: no Python object
per label, and a query's row depends on nothing else in its batch (each output row is summed over
that query's terms in term order). Its top :attr:`SparseRanker.depth` labels join the fusion's
candidates (:meth:`~engine.fusion.ScoreFusion.candidates`), and every candidate's margin
and rank here are features of φ (:data:`~engine.fusion.SPARSE_FEATURES`).

Labels the fit never saw (appended to a live memory, or folded into a compacted bundle after its
ranker was fitted) get weight columns from their texts (:class:`LabelColumns`, kept in the memory's
view): the ones the fit gives a label no training instance carries, its own text's term vector
(:meth:`SparseRanker.label_columns`; :func:`centroid_columns` and :func:`pruned` are the fit's own
code). Without them a label appended with a trained label's very text had the floor margin and no
rank here, and ranked below labels it matches as well.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bundle import BundleError, load_csr, npz_headers
from engine.lexical import QueryTerms, query_matrix

# The fit's defaults (export.sparse_fit.SparseFitParams reads them from here): a bundle whose
# manifest predates the fit parameters is given its label columns as it was fitted.
LABEL_WEIGHT = 0.5
PRUNE = 0.05
# The largest magnitude a dense weight may have: a margin sums dim of them times a unit vector's
# entries, so a bundle's weights can never overflow a float32 margin (fitted ones are below 100).
DENSE_MAX = 1e4


class LabelColumns:
    """The weight columns (terms x labels, float32 CSR) and biases of the labels after a ranker's
    fitted ones, in label id order (the first is label :attr:`SparseRanker.labels`).

    Kept as the blocks the appends made (each its labels' columns over the whole term space and
    their biases), side by side: :meth:`extended` adds blocks and touches none of the term space,
    so an append (made under its log's exclusive lock) and a replayed record (one per logged append
    at load) cost their own columns, not a rebuild of every later label's. :attr:`weights` and
    :attr:`bias` are the blocks side by side, built on first use (the first batch that scores a
    view) once per view; two threads that race build equal ones and one is kept."""

    def __init__(self, weights: sp.csr_matrix, bias: np.ndarray):
        weights = weights.tocsr()
        bias = np.asarray(bias, dtype=np.float32)
        if bias.shape != (weights.shape[1],):
            raise ValueError(f"label columns need one bias per column: {weights.shape[1]}, not {bias.shape}")
        self.blocks: tuple[tuple[sp.csr_matrix, np.ndarray], ...] = ((weights, bias),)
        self.terms = weights.shape[0]
        self.labels = weights.shape[1]

    def extended(self, more: LabelColumns) -> LabelColumns:
        """These columns, then ``more``'s (the next label ids): their blocks, none rebuilt."""
        if not more.labels:
            return self
        if more.terms != self.terms:
            raise ValueError(f"label columns over {more.terms} terms cannot follow ones over {self.terms}")
        out = LabelColumns.__new__(LabelColumns)
        out.blocks = tuple(block for block in (*self.blocks, *more.blocks) if block[0].shape[1])
        out.terms, out.labels = self.terms, self.labels + more.labels
        return out

    @cached_property
    def weights(self) -> sp.csr_matrix:
        """The blocks' columns side by side (terms x labels, float32 CSR, indices sorted). Built
        from their entries, in O(entries + terms): a CSR hstack walks every term row of every
        block, which for a view of 10^4 appends over 10^6 terms is 10^10 steps."""
        if len(self.blocks) == 1:
            return self.blocks[0][0]
        rows, columns, data, offset = [], [], [], 0
        for weights, _ in self.blocks:
            entries = weights.tocoo()
            rows.append(entries.row)
            columns.append(entries.col.astype(np.int64) + offset)
            data.append(entries.data.astype(np.float32, copy=False))
            offset += weights.shape[1]
        out = sp.csr_matrix(
            (np.concatenate(data), (np.concatenate(rows), np.concatenate(columns))),
            shape=(self.terms, self.labels),
            dtype=np.float32,
        )
        out.sort_indices()
        return out

    @cached_property
    def bias(self) -> np.ndarray:
        """The blocks' biases in label id order (float32)."""
        if len(self.blocks) == 1:
            return self.blocks[0][1]
        return np.concatenate([bias for _, bias in self.blocks]).astype(np.float32)


@dataclass(frozen=True)
class SparseMargins:
    """A batch's margins: ``all``, every label that shares a term with its query (queries x
    labels CSR, label ids sorted per row), and ``top``, each query's best :attr:`SparseRanker.depth`
    of them (excluded labels left out) with their ranks (0: the best), in ``top``'s storage order;
    ``bias``: the bias of every label with weights (the fitted ones, then any :class:`LabelColumns`)."""

    all: sp.csr_matrix
    top: sp.csr_matrix
    top_ranks: np.ndarray
    bias: np.ndarray | None = None


@dataclass(frozen=True)
class SparseRanker:
    """``weights`` (terms x labels, float32 CSR), ``bias`` (one per label, float32), the
    number of labels each query's margins add to the candidates (``depth``), and how the weights
    were fitted (``fit``, ``fit_params``: the manifest's), which the columns of later labels follow;
    ``dense``: the weights of the query's dense vector (labels x dim, float32; None: none)."""

    weights: sp.csr_matrix
    bias: np.ndarray
    depth: int
    fit: str = "centroid"
    fit_params: Mapping = field(default_factory=dict)
    dense: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.bias.shape != (self.weights.shape[1],) or not np.all(np.isfinite(self.bias)):
            raise ValueError(f"the bias must be {self.weights.shape[1]} finite values, one per label")
        if self.depth < 1:
            raise ValueError(f"a sparse ranker's depth must be at least 1, not {self.depth}")
        if self.dense is not None:
            dense = self.dense
            if dense.ndim != 2 or dense.shape[0] != self.labels or dense.dtype != np.float32:
                raise ValueError(f"dense weights must be float32, one row per label ({self.labels}), not {dense.shape}")
            if not np.all(np.abs(dense) <= DENSE_MAX):
                raise ValueError(f"dense weights must be finite and at most {DENSE_MAX:g} in magnitude")

    @property
    def dense_dim(self) -> int:
        """The dimension of the query vector the dense weights read (0: none)."""
        return 0 if self.dense is None else self.dense.shape[1]

    @property
    def labels(self) -> int:
        return self.weights.shape[1]

    @property
    def floor(self) -> float:
        """The margin of a label without weights (past its :class:`LabelColumns`): the lowest bias."""
        return float(self.bias.min()) if len(self.bias) else 0.0

    def label_columns(self, label_rows: sp.csr_matrix) -> LabelColumns:
        """The weight columns of labels the fit did not see, from their own texts' unit term vectors
        ``label_rows`` (labels x terms, as :meth:`~engine.lexical.Lexicon.rows` gives them).

        A centroid fit's column of a label no training instance carries is exactly this: the unit
        sum of its (no) texts and its own text's row at ``label_weight``, pruned (the fit's code,
        :func:`centroid_columns`, :func:`pruned`), bias 0. One-vs-rest has no closed form for a
        label fitted on its text alone: its row is scaled to the fitted columns' median norm and
        given their median bias, so on its own text its margin is a typical fitted label's on a
        text its weights point to. A fit without label texts gave a zero-shot label no weights:
        neither does it give these (their margin is their bias). Dense weights are only fitted:
        these labels' margins have no dense part (0, the value a label the query's vector says
        nothing about gets), which keeps an append's cost its own columns."""
        terms = self.weights.shape[0]
        label_rows = label_rows.astype(np.float32).tocsr()
        if label_rows.shape[1] != terms:
            raise ValueError(f"label rows must have the ranker's {terms} terms, not {label_rows.shape[1]}")
        labels = label_rows.shape[0]
        if not self.fit_params.get("label_texts", True):
            label_rows = sp.csr_matrix((labels, terms), dtype=np.float32)
        prune = float(self.fit_params.get("prune", PRUNE))
        if self.fit == "one_vs_rest":
            scale, bias = self._one_vs_rest_scale
            weights = pruned((label_rows * scale).T.tocsr(), prune)
            return LabelColumns(weights, np.full(labels, bias, dtype=np.float32))
        no_instances = sp.csr_matrix((labels, terms), dtype=np.float32)
        label_weight = float(self.fit_params.get("label_weight", LABEL_WEIGHT))
        weights = pruned(centroid_columns(no_instances, label_rows, label_weight), prune)
        return LabelColumns(weights, np.zeros(labels, dtype=np.float32))

    @cached_property
    def _one_vs_rest_scale(self) -> tuple[float, float]:
        """The fitted columns' median norm and median bias (a one-vs-rest ranker's later labels')."""
        norms = np.sqrt(np.asarray(self.weights.multiply(self.weights).sum(axis=0), dtype=np.float64).ravel())
        if not len(norms):
            return 1.0, 0.0
        return float(np.median(norms)), float(np.median(self.bias))

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
            **({"dense": np.ascontiguousarray(self.dense, dtype=np.float32)} if self.dense is not None else {}),
        )

    @classmethod
    def load(
        cls,
        path: Path,
        terms: int,
        labels: int,
        depth: int,
        fit: str = "centroid",
        fit_params: Mapping | None = None,
        dense_dim: int = 0,
    ) -> SparseRanker:
        """The ranker in ``path`` (written by :meth:`save`), refused unless its weights are a sound
        ``terms x labels`` CSR matrix, its bias ``labels`` finite values and, with ``dense_dim``,
        its dense weights ``labels x dense_dim`` values of magnitude at most :data:`DENSE_MAX`
        (none without); ``fit``, ``fit_params``: how it was fitted (the manifest's)."""
        weights = load_csr(path, (terms, labels), "sparse ranker weights")
        headers = npz_headers(path)  # sizes from the headers before anything is inflated
        bias = _member(path, headers, "bias", (labels,), f"the bias is not {labels} finite float32 values")
        if not np.all(np.isfinite(bias)):
            raise BundleError(f"{path}: sparse ranker refused: the bias is not {labels} finite float32 values")
        dense = None
        if dense_dim:
            what = f"the dense weights are not {labels} x {dense_dim} values of magnitude at most {DENSE_MAX:g}"
            dense = np.ascontiguousarray(_member(path, headers, "dense", (labels, dense_dim), what))
            if not np.all(np.abs(dense) <= DENSE_MAX):  # NaN fails this too
                raise BundleError(f"{path}: sparse ranker refused: {what}")
        elif "dense" in headers:
            raise BundleError(f"{path}: sparse ranker refused: dense weights the manifest does not declare")
        weights.sort_indices()
        return cls(weights, bias, depth, fit, dict(fit_params or {}), dense)

    def margins(
        self,
        queries: list[QueryTerms],
        width: int,
        exclude: Sequence[Collection[int]],
        later: LabelColumns | None = None,
        vectors: np.ndarray | None = None,
    ) -> SparseMargins:
        """The margins of ``queries`` over a label space ``width`` wide (a live memory's, which may
        have more labels than the weights), and each query's top :attr:`depth` of them, its
        ``exclude`` labels left out; ``later``: the columns of the labels after the fitted ones (a
        live memory's view holds them), scored and ranked like the fitted ones; ``vectors``: the
        queries' dense vectors (nq x :attr:`dense_dim`), which a ranker with dense weights reads."""
        terms = query_matrix(queries, self.weights.shape[0])
        products, bias = (terms @ self.weights).tocsr(), self.bias
        if self.dense is not None:
            products = self._with_dense(products, vectors)
        if later is not None and later.labels:
            # each query's row is still its own terms' product, label ids in order: batch invariant
            products = sp.hstack([products, (terms @ later.weights).tocsr()], format="csr")
            bias = np.concatenate([self.bias, later.bias])
        products.sort_indices()  # the product's rows come out in the order its accumulator met the labels
        data = (products.data + bias[products.indices]).astype(np.float32)
        all_margins = sp.csr_matrix(
            (data, products.indices, products.indptr), shape=(len(queries), max(width, len(bias)))
        )
        top, ranks = top_margins(all_margins, self.depth, exclude)
        return SparseMargins(all_margins, top, ranks, bias)

    def _with_dense(self, products: sp.csr_matrix, vectors: np.ndarray | None) -> sp.csr_matrix:
        """The term products plus each query's dense part, every fitted label stored (CSR)."""
        nq = products.shape[0]
        if vectors is None or vectors.shape != (nq, self.dense_dim):
            got = None if vectors is None else vectors.shape
            raise ValueError(f"this sparse ranker weighs the query vectors: needs {nq} x {self.dense_dim}, not {got}")
        full = products.toarray()
        vectors = np.asarray(vectors, dtype=np.float32)
        for i in range(nq):  # one matrix-vector product a query: its row never depends on its batch
            full[i] += self.dense @ vectors[i]
        labels = self.labels
        indptr = np.arange(0, (nq + 1) * labels, labels, dtype=np.int64)
        indices = np.tile(np.arange(labels, dtype=np.int32), nq)
        return sp.csr_matrix((full.ravel(), indices, indptr), shape=(nq, labels))

    def margin_of(self, margins: SparseMargins, query: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The margin of each pair ``(query[j], labels[j])``: its stored margin, the label's bias
        when no term of the query points to it, :attr:`floor` for a label without weights."""
        bias = self.bias if margins.bias is None else margins.bias
        out = np.full(len(labels), self.floor, dtype=np.float64)
        known = labels < len(bias)
        out[known] = bias[labels[known]]
        at, found = StoredSlots(margins.all)(query, labels)
        out[found] = margins.all.data[at]
        return out


def _member(path: Path, headers: Mapping, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """The npz member ``name`` as float32, refused (naming ``what``) unless its header says a
    float array of ``shape`` (checked before it is inflated)."""
    refused = BundleError(f"{path}: sparse ranker refused: {what}")
    stored, dtype = headers.get(name, ((), np.dtype(object)))
    if tuple(stored) != shape or dtype.kind != "f":
        raise refused
    try:
        with np.load(path, allow_pickle=False) as npz:
            values = npz[name]
    except (KeyError, OSError, ValueError) as exc:
        raise BundleError(f"{path}: sparse ranker refused: no readable {name} ({exc})") from None
    # finite in the dtype margins are computed in: a float64 1e39 is inf as float32
    with np.errstate(over="ignore"):
        values = values.astype(np.float32)
    if values.shape != shape:
        raise refused
    return values


def centroid_columns(sums: sp.csr_matrix, label_rows: sp.csr_matrix | None, label_weight: float) -> sp.csr_matrix:
    """A centroid fit's weights (terms x labels): each label's unit sum of its texts' term vectors
    (``sums``, labels x terms), its own text's row (``label_rows``) added at ``label_weight``, unit
    again. The fit (:mod:`export.sparse_fit`) and a live memory's later labels compute them alike."""
    centroids = unit_rows(sums.tocsr())
    if label_rows is not None:
        centroids = unit_rows((centroids + label_weight * label_rows.astype(np.float32)).tocsr())
    return centroids.T.tocsr()


def unit_rows(M: sp.csr_matrix) -> sp.csr_matrix:
    """``M``'s rows scaled to norm 1 (a zero row stays zero), float32."""
    norms = np.sqrt(np.asarray(M.multiply(M).sum(axis=1)).ravel())
    norms[norms == 0] = 1.0
    return (sp.diags(1.0 / norms) @ M).astype(np.float32).tocsr()


def pruned(weights: sp.csr_matrix, prune: float) -> sp.csr_matrix:
    """``weights`` without the entries of magnitude below ``prune`` (what keeps a query's product to
    the few labels its terms point to), indices sorted, float32."""
    weights = weights.tocsr(copy=True)
    weights.data[np.abs(weights.data) < prune] = 0.0
    weights.eliminate_zeros()
    weights.sort_indices()
    return weights.astype(np.float32)


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
