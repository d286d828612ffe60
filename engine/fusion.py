"""Score fusion (NGAME App. C, adapted to an RAE memory): a tree model over what a query's
retrieved keys say about each candidate label, added to its RAE score.

NGAME fuses a label's embedding and classifier scores with a depth-7 regression tree T fitted
on held-out points (target: 1 for a relevant label, 0 otherwise) and ranks by T(d) + the scores.
Here the candidates are the labels the top-b keys of the memory vote for, the base score is the
RAE score p̂_l of the bundle's mode, and the descriptor φ_l (:data:`FEATURES`) is computed from
the keys, similarities and value rows the search already holds:

    fused_l = p̂_l + T(φ_l)

T is an ai.onnx.ml TreeEnsemble model (one regression tree, a regression GBDT or a LambdaMART
ranker, fitted and converted by ``export.fuse``) that ONNX Runtime scores in one call per batch
(:class:`OnnxTreeEnsemble`).

* ``instance_vote``: log(ε + Σ softmax(q·x_i/τ) over the retrieved instance keys i that carry l)
* ``label_match``: log(ε + softmax(q·z_l/τ) over the retrieved label keys); ε when z_l was not retrieved
* ``label_similarity``: q·z_l, or the lowest retrieved label-key similarity when z_l was not retrieved
* ``label_retrieved``: 1 when z_l is among the retrieved keys
* ``log_frequency``: log(1 + training instances of l in the bundle's memory)
* ``log_instance_votes``: log(1 + retrieved instance keys that carry l)
* ``best_instance_similarity``: the highest q·x_i of a retrieved instance carrying l, or the
  lowest retrieved instance similarity
* ``rae_score``: p̂_l

A fusion with a :class:`~engine.lexical.Lexicon` also reads, for every retrieved key, its
lexical similarity to the query (:mod:`engine.lexical`: the idf-weighted cosine of their
word pieces and word-piece pairs), and φ_l then also carries (:data:`LEXICAL_FEATURES`):

* ``instance_lexical_max``: the highest lex(q, x_i) of a retrieved instance carrying l, 0 if none
* ``instance_lexical_sum``: Σ lex(q, x_i) over the retrieved instances carrying l
* ``instance_lexical_vote``: log(ε + Σ softmax(lex(q, x_i) / :data:`LEXICAL_TAU`) over them)
* ``label_lexical``: lex(q, z_l) when l's own key was retrieved, else 0

The dense vectors find the neighbourhood; the lexical signal says which neighbours share the
query's literal pieces, which is what lets the TF-IDF peers rank well on short texts. On
Debian-Related dev it took the fused P@1 / P@5 from 74.5 / 37.1 to 76.0 / 38.1
(bench/results/README.md).

Optional groups of cheap features (:data:`FEATURE_GROUPS`, each kept by ``export.fuse`` only when
the validation split of ``studies.fusion_models`` says it helps) read the same arrays:

* ``ranks``: log(1 + the candidate's rank in its query) by p̂, by instance vote and by label-key
  similarity
* ``thresholds``: log(1 + retrieved instance keys carrying l within m of the query's best instance
  similarity), m in :data:`THRESHOLD_MARGINS`
* ``query``: the query's best retrieved similarity and log(1 + its number of candidates)

A fusion with a sparse linear ranker (:mod:`engine.sparse`, over the lexicon's term space)
has a second source of candidates: each query's top ``depth`` labels by the ranker's margin join
the memory's (a label no near key carries can be found by its literal pieces), and φ gains
(:data:`SPARSE_FEATURES`):

* ``sparse_margin``: the ranker's margin q·w_l + b_l of the candidate
* ``sparse_rank``: log(1 + its rank among the query's margins), log(1 + depth) beyond its top depth

A candidate only the ranker found has p̂ = 0 and the memory's features of a label no key carries.

A fusion with a label-key source (:class:`LabelKeySource`, the label index as a source of its
own) searches the memory ``fetch`` keys deeper than b; each query's nearest ``depth`` label keys
among those join the candidates (the top b holds only the label keys that come before its
instances), and φ gains (:data:`LABEL_KEY_FEATURES`):

* ``label_key_similarity``: q·z_l when z_l is among the query's nearest label keys, else the
  lowest similarity among them
* ``label_key_rank``: log(1 + its rank among them), log(1 + depth) beyond

No feature reads a label's vector or term vector beyond the retrieved keys and the ranker's
weights of the query's terms: the Ray ingress has only what the shards answer and the fusion.

A fusion with a rerank depth M (``FusionParams.rerank_depth``) is a two-stage ranking: T rescores
only each query's top max(M, k) candidates by p̂ (:meth:`ScoreFusion.candidates`), and only those
are returned. φ and T then cost M rows a query instead of every label the keys vote for (several
hundred on Debian-Related), which is what lets a boosted ensemble fit the serving budget;
``export.fuse`` fits T on the same top-M candidates.

Nothing else is read, so every front end that ranks (one process, the Ray ingress, whose shards
answer their keys' lexical similarities) fuses alike. A label added to a live memory after export
has frequency 0, as zero-shot labels had in the fit; a key added to it gets its term vector from
its text, and a label added to it the sparse ranker's weight column a zero-shot label got in the fit
(:meth:`~engine.sparse.SparseRanker.label_columns`). ``export.fuse`` fits T on training
instances the encoder never saw (``TrainParams.holdout``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import scipy.sparse as sp

from bundle import FusionParams, npz_headers
from engine.lexical import BIGRAM_BUCKETS, Lexicon, QueryTerms
from engine.rae import KeptKeys, ValueRows
from engine.sparse import LabelColumns, SparseMargins, SparseRanker, StoredSlots

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
RANK_FEATURES = ("rae_rank", "instance_vote_rank", "label_similarity_rank")
# margins below the query's best instance similarity within which carrying instances are counted
THRESHOLD_MARGINS = (0.02, 0.05, 0.1)
THRESHOLD_FEATURES = tuple(f"instance_votes_within_{m:g}" for m in THRESHOLD_MARGINS)
QUERY_FEATURES = ("query_best_similarity", "query_candidates")
SPARSE_FEATURES = ("sparse_margin", "sparse_rank")
LABEL_KEY_FEATURES = ("label_key_similarity", "label_key_rank")
# the most terms a lexical fusion's idf may hold: the hashed pairs and a vocabulary of up to 2^20
MAX_TERMS = BIGRAM_BUCKETS + (1 << 20)
# φ's column groups, in the order a fusion's columns follow; "rae" is always first
FEATURE_GROUPS: dict[str, tuple[str, ...]] = {
    "rae": FEATURES,
    "lexical": LEXICAL_FEATURES,
    "ranks": RANK_FEATURES,
    "thresholds": THRESHOLD_FEATURES,
    "query": QUERY_FEATURES,
    "sparse": SPARSE_FEATURES,
    "label_keys": LABEL_KEY_FEATURES,
}
# the groups that come with a candidate source, not by choice of features
SOURCE_GROUPS = ("sparse", "label_keys")
# the groups a fusion may add to "rae"
OPTIONAL_GROUPS = tuple(group for group in FEATURE_GROUPS if group not in ("rae", *SOURCE_GROUPS))
# softmax temperature of the lexical vote (lexical cosines spread over [0, 1] like the dense ones)
LEXICAL_TAU = 0.05
# ε of the log features: below any softmax weight that moves a ranking, above float32's zero
LOG_FLOOR = 1e-4


def features_of_groups(groups: Collection[str]) -> tuple[str, ...]:
    """φ's columns for the feature groups ``groups`` (``rae`` is always among them)."""
    unknown = set(groups) - set(FEATURE_GROUPS)
    if unknown:
        raise ValueError(f"unknown feature groups {sorted(unknown)}; known: {list(FEATURE_GROUPS)}")
    return tuple(name for group, names in FEATURE_GROUPS.items() if group == "rae" or group in groups for name in names)


def groups_of(features: Collection[str]) -> tuple[str, ...]:
    """The feature groups whose columns ``features`` are, in :data:`FEATURE_GROUPS` order; a
    ValueError for any other list (a fusion fitted on features this service does not compute)."""
    features = tuple(features)
    groups = tuple(group for group, names in FEATURE_GROUPS.items() if group == "rae" or names[0] in features)
    if features_of_groups(groups) != features:
        raise ValueError(
            f"fusion features {list(features)} are not the groups {list(FEATURE_GROUPS)} in order "
            f"(rae first, each group whole)"
        )
    return groups


class FusionModel(Protocol):
    """T: one score per row of φ."""

    def predict(self, X: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class OnnxTreeEnsemble:
    """T as an ai.onnx.ml TreeEnsemble model (``fusion.onnx``) run by ONNX Runtime: one
    ``InferenceSession.run`` per batch over φ as float32 (the precision ``export.fuse`` fitted it at).

    The session has one intra-op and one inter-op thread: under load the search thread runs beside
    the encoder's session, which takes every core, so a second fusion thread (1.5x faster on a batch
    of 12,800 pairs, docs/score-fusion.md) would take its time from the encoder."""

    serialized: bytes
    session: object = field(repr=False, compare=False)
    input_name: str

    @classmethod
    def from_bytes(cls, serialized: bytes, width: int) -> OnnxTreeEnsemble:
        """The model in ``serialized``, which must take one ``[batch, width]`` float input."""
        import onnxruntime as ort  # the serving process's runtime (xmcserve[cpu] or [gpu])

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session = ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if len(inputs) != 1 or inputs[0].type != "tensor(float)" or inputs[0].shape[-1] != width:
            described = [(i.name, i.type, i.shape) for i in inputs]
            raise ValueError(f"the fusion model must take one float input [batch, {width}], it takes {described}")
        if len(outputs) != 1:
            raise ValueError(f"the fusion model must have one output, it has {len(outputs)}")
        return cls(serialized, session, inputs[0].name)

    def predict(self, X: np.ndarray) -> np.ndarray:
        if not len(X):
            return np.zeros(0)
        (out,) = self.session.run(None, {self.input_name: np.ascontiguousarray(X, dtype=np.float32)})
        return out.reshape(-1).astype(np.float64)


@dataclass(frozen=True)
class LabelKeyHits:
    """Each query's nearest label keys (:meth:`LabelKeySource.hits`): ``top``, a queries x labels
    CSR of their similarities (label ids sorted per row); ``ranks``, each stored entry's rank among
    its query's label keys (0: the nearest); ``floor``, each query's lowest similarity among them
    (0 without any)."""

    top: sp.csr_matrix
    ranks: np.ndarray
    floor: np.ndarray


@dataclass(frozen=True)
class LabelKeySource:
    """The label index as a candidate source: the memory searched ``fetch`` keys deeper than its
    top b, and each query's nearest ``depth`` label keys among them (its excluded labels' left out)."""

    depth: int
    fetch: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.fetch < 0:
            raise ValueError(f"a label-key source needs a depth of at least 1 and a fetch of 0 or more: {self}")

    def hits(
        self, labels: np.ndarray, sims: np.ndarray, exclude: Sequence[Collection[int]], width: int
    ) -> LabelKeyHits:
        """:class:`LabelKeyHits` of a batch's fetched keys (``labels``: each key's label id, −1 for
        an instance key or none; ``sims``: their similarities; both ``nq x n``, best first), over a
        label space ``width`` wide. A label has one key, so a query's hits are distinct labels."""
        ids, values, ranks, indptr = [], [], [], [0]
        floor = np.zeros(len(labels))
        for i, excluded in enumerate(exclude):
            keep = labels[i] >= 0
            if excluded:
                keep &= ~np.isin(labels[i], np.fromiter(excluded, dtype=np.int64))
            row_labels, row_sims = labels[i][keep][: self.depth], sims[i][keep][: self.depth]
            order = np.argsort(row_labels, kind="stable")
            ids.append(row_labels[order])
            values.append(row_sims[order])
            ranks.append(order)
            indptr.append(indptr[-1] + len(order))
            floor[i] = row_sims.min() if len(row_sims) else 0.0
        top = sp.csr_matrix(
            (
                np.concatenate(values).astype(np.float32) if values else np.zeros(0, np.float32),
                np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64),
                np.array(indptr, dtype=np.int64),
            ),
            shape=(len(labels), width),
        )
        top.has_sorted_indices = True
        return LabelKeyHits(top, np.concatenate(ranks) if ranks else np.zeros(0, np.int64), floor)


@dataclass(frozen=True)
class ScoreFusion:
    """T, the memory's label frequencies (log(1 + count), label id order), for the lexical
    features the lexicon the query terms come from, φ's columns (by default the RAE features,
    and the lexical ones with a lexicon) and the rerank depth (None: T rescores every candidate)."""

    model: FusionModel | None  # None: φ alone (the features a fit reads)
    log_frequency: np.ndarray
    lexicon: Lexicon | None = None
    features: tuple[str, ...] = ()
    rerank_depth: int | None = None
    sparse: SparseRanker | None = None  # a second candidate source, over the lexicon's term space
    label_keys: LabelKeySource | None = None  # a third: the label index

    def __post_init__(self) -> None:
        if not self.features:
            groups = ["lexical"] if self.lexicon is not None else []
            groups += ["sparse"] if self.sparse else []
            groups += ["label_keys"] if self.label_keys else []
            object.__setattr__(self, "features", features_of_groups(groups))
        if ("label_keys" in groups_of(self.features)) != (self.label_keys is not None):
            raise ValueError("a fusion has the label-key features exactly when it has a label-key source")
        if ("lexical" in groups_of(self.features)) != (self.lexicon is not None):
            raise ValueError("a fusion has the lexical features exactly when it has a lexicon")
        if ("sparse" in groups_of(self.features)) != (self.sparse is not None):
            raise ValueError("a fusion has the sparse features exactly when it has a sparse ranker")
        if self.sparse is not None and self.lexicon is None:
            raise ValueError("a sparse ranker scores the lexicon's term vectors: it needs a lexicon")
        if self.rerank_depth is not None and self.rerank_depth < 1:
            raise ValueError(f"a rerank depth must be at least 1, not {self.rerank_depth}")

    @property
    def groups(self) -> tuple[str, ...]:
        return groups_of(self.features)

    def save(self, directory: Path, params: FusionParams) -> None:
        """``params.file`` (label frequencies, the lexicon's idf) and ``params.model`` (the ONNX
        model) into ``directory``."""
        if not isinstance(self.model, OnnxTreeEnsemble):
            raise ValueError("a fusion is saved with its model as ONNX (OnnxTreeEnsemble)")
        arrays = {"log_frequency": self.log_frequency}
        if self.lexicon is not None:
            arrays["idf"] = self.lexicon.idf
        (directory / params.model).write_bytes(self.model.serialized)
        np.savez_compressed(directory / params.file, **arrays)
        if (self.sparse is not None) != (params.sparse is not None):
            raise ValueError("a fusion with a sparse ranker is saved with its parameters, and only one")
        if self.sparse is not None:
            self.sparse.save(directory / params.sparse.file)

    @classmethod
    def load(
        cls, directory: Path, params: FusionParams, num_labels: int, tokenizer: tuple[Path, int] | None = None
    ) -> ScoreFusion:
        """The fusion ``params`` describes in ``directory``, checked against the bundle's label
        count; ``tokenizer`` (the bundle's tokenizer file and max length) for a lexical fusion."""
        features = tuple(params.features)
        groups_of(features)
        # sized from the .npy headers before anything is inflated: a compressed member declaring
        # more values than a label table or a term space holds is refused, not allocated
        headers = npz_headers(directory / params.file)
        if headers.get("log_frequency", ((), None))[0] != (num_labels,):
            raise ValueError(f"log_frequency must be {num_labels} finite values")
        if "idf" in headers and (len(headers["idf"][0]) != 1 or headers["idf"][0][0] > MAX_TERMS):
            raise ValueError(f"idf must be one weight a term, at most {MAX_TERMS} terms")
        with np.load(directory / params.file, allow_pickle=False) as z:
            with np.errstate(over="ignore"):  # an overflow to inf is refused just below
                log_frequency = z["log_frequency"].astype(np.float32)
            idf = z.get("idf")
        if log_frequency.shape != (num_labels,) or not np.all(np.isfinite(log_frequency)):
            raise ValueError(f"log_frequency must be {num_labels} finite values")
        if idf is not None and tokenizer is None:
            raise ValueError("a lexical fusion needs the bundle's tokenizer")
        model = OnnxTreeEnsemble.from_bytes((directory / params.model).read_bytes(), len(features))
        lexicon = Lexicon(*tokenizer, idf) if idf is not None else None
        sparse = None
        if params.sparse is not None:
            if idf is None:
                raise ValueError("a sparse ranker needs the lexical fusion's term space")
            ranker = params.sparse
            sparse = SparseRanker.load(
                directory / ranker.file,
                len(idf),
                ranker.labels,
                ranker.depth,
                ranker.fit,
                ranker.fit_params,
                ranker.dense_dim,
            )
        keys = params.label_keys
        label_keys = LabelKeySource(keys.depth, keys.fetch) if keys is not None else None
        return cls(model, log_frequency, lexicon, features, params.rerank_depth, sparse, label_keys)

    def later_label_columns(self, label_texts: Sequence[str]) -> LabelColumns | None:
        """The sparse ranker's columns of the labels of ``label_texts`` (a bundle's, label id
        order) after its fitted ones (a compaction folds appended labels in past them), made from
        their texts as an append makes them; None without a ranker. Every front end that ranks
        starts its memory's view with them."""
        if self.sparse is None:
            return None
        later = [label_texts[i] for i in range(self.sparse.labels, len(label_texts))]
        return self.sparse.label_columns(self.lexicon.rows(later))

    @property
    def extra_fetch(self) -> int:
        """Keys a query's search fetches beyond the RAE top b for this fusion (its label-key source)."""
        return self.label_keys.fetch if self.label_keys is not None else 0

    def label_key_hits(
        self, labels: np.ndarray, sims: np.ndarray, exclude: Sequence[Collection[int]], width: int
    ) -> LabelKeyHits | None:
        """The label-key source's hits of a batch's fetched keys (None without one)."""
        return self.label_keys.hits(labels, sims, exclude, width) if self.label_keys is not None else None

    def sparse_margins(
        self,
        terms: list[QueryTerms] | None,
        width: int,
        exclude: Sequence[Collection[int]],
        later: LabelColumns | None = None,
        vectors: np.ndarray | None = None,
    ) -> SparseMargins | None:
        """The sparse ranker's margins of a batch's queries (None without a ranker), over a label
        space ``width`` wide, each query's ``exclude`` labels left out of its top; ``later``: the
        columns of the labels after the fitted ones (a live memory's); ``vectors``: the queries'
        dense vectors, which a ranker with dense weights reads."""
        if self.sparse is None:
            return None
        if terms is None or len(terms) != len(exclude):
            raise ValueError("this fusion's sparse ranker needs one term vector per query")
        return self.sparse.margins(terms, width, exclude, later, vectors if self.sparse.dense is not None else None)

    def candidates(
        self,
        scores: sp.csr_matrix,
        ks: Sequence[int] | None = None,
        margins: SparseMargins | None = None,
        hits: LabelKeyHits | None = None,
    ) -> sp.csr_matrix:
        """The candidates T rescores: with a rerank depth M, each query's top max(M, k) of
        ``scores`` by p̂ (``ks``: each query's k; None: M), ties broken by label id as
        :func:`~engine.rae.top_k_of_row` breaks them; without one, all of ``scores``.
        With ``margins`` (a sparse ranker's) and ``hits`` (a label-key source's), joined by each
        query's top labels by margin and its nearest label keys, whose p̂ is their stored score, 0
        for a label the memory's top b keys do not carry."""
        if self.rerank_depth is None:
            chosen = scores
        else:
            widths = [self.rerank_depth] * scores.shape[0] if ks is None else [max(self.rerank_depth, k) for k in ks]
            chosen = top_of_rows(scores, widths)
        if margins is not None:
            chosen = joined_candidates(scores, chosen, margins.top)
        if hits is not None:
            chosen = joined_candidates(scores, chosen, hits.top)
        return chosen

    def rescore(
        self,
        scores: sp.csr_matrix,
        kept: list[KeptKeys],
        values: ValueRows,
        tau: float,
        ks: Sequence[int] | None = None,
        margins: SparseMargins | None = None,
        hits: LabelKeyHits | None = None,
    ) -> sp.csr_matrix:
        """:meth:`candidates` of ``scores`` (:func:`~engine.rae.aggregate_kept` of
        ``kept``; ``margins``: the sparse ranker's, ``hits``: the label-key source's, with them),
        each stored score replaced by its fused score."""
        fused = self.candidates(scores, ks, margins, hits)
        if fused is scores:
            fused = scores.copy()
        # one call of the model for the whole batch (the rows of φ follow scores' storage)
        fused.data = fused.data + self.model.predict(self.features_of(fused, kept, values, tau, margins, hits))
        return fused

    def features_of(
        self,
        scores: sp.csr_matrix,
        kept: list[KeptKeys],
        values: ValueRows,
        tau: float,
        margins: SparseMargins | None = None,
        hits: LabelKeyHits | None = None,
    ) -> np.ndarray:
        """φ (columns :attr:`features`) of every label stored in ``scores``, in its storage order."""
        if self.lexicon is not None and any(row.lexical is None for row in kept):
            raise ValueError("this fusion's lexical features need the retrieved keys' lexical similarities")
        columns = [batch_features(scores, kept, values, tau, self.log_frequency, self.groups)]
        query = np.repeat(np.arange(scores.shape[0], dtype=np.int64), np.diff(scores.indptr))
        labels = scores.indices.astype(np.int64)
        if self.sparse is not None:
            if margins is None:
                raise ValueError("this fusion's sparse features need the sparse ranker's margins")
            rank = np.full(len(labels), float(self.sparse.depth))
            at, found = StoredSlots(margins.top)(query, labels)
            rank[found] = margins.top_ranks[at]
            columns.append(np.stack([self.sparse.margin_of(margins, query, labels), np.log1p(rank)], axis=1))
        if self.label_keys is not None:
            if hits is None:
                raise ValueError("this fusion's label-key features need the label-key source's hits")
            similarity = hits.floor[query].astype(np.float64)
            rank = np.full(len(labels), float(self.label_keys.depth))
            at, found = StoredSlots(hits.top)(query, labels)
            similarity[found] = hits.top.data[at]
            rank[found] = hits.ranks[at]
            columns.append(np.stack([similarity, np.log1p(rank)], axis=1))
        return np.concatenate(columns, axis=1) if len(columns) > 1 else columns[0]


def batch_features(
    scores: sp.csr_matrix,
    kept: list[KeptKeys],
    values: ValueRows,
    tau: float,
    log_frequency: np.ndarray,
    groups: Collection[str] = ("rae",),
) -> np.ndarray:
    """φ (the columns of :func:`features_of_groups` ``groups``) of every label stored in
    ``scores``, in its storage order, from the kept keys (:func:`~engine.rae.keep_keys`)
    that gave ``scores``. One pass over the whole batch:
    every query's keys are laid end to end and each feature is one grouped numpy operation, so a
    batch costs about what one query does."""
    batch = _BatchKeys.of(kept)
    slots = StoredSlots(scores)
    n, nq = scores.nnz, len(kept)
    instance, label = batch.labels < 0, batch.labels >= 0
    # the features weigh instances and labels apart ("split"), whatever the bundle's mode
    weights = grouped_softmax(batch.sims, tau, 2 * batch.query + label, 2 * nq)

    carried, per_key = values.row_labels(batch.keys[instance])
    at, hit = slots(np.repeat(batch.query[instance], per_key), carried)

    carrier = np.repeat(np.arange(len(per_key)), per_key)[hit]

    def carried_by(x: np.ndarray) -> np.ndarray:
        """``x`` of each instance key, once per candidate label it carries."""
        return x[carrier]

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
    if "lexical" in groups:
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
    if "ranks" in groups:
        columns += [np.log1p(ranks_within_rows(scores.indptr, x)) for x in (scores.data, vote, similarity)]
    if "thresholds" in groups:
        best_of_query = np.full(nq, -np.inf)
        np.maximum.at(best_of_query, batch.query[instance], batch.sims[instance])
        gap = carried_by(best_of_query[batch.query[instance]] - batch.sims[instance])
        columns += [np.log1p(np.bincount(at, weights=gap <= margin, minlength=n)) for margin in THRESHOLD_MARGINS]
    if "query" in groups:
        top = np.full(nq, -np.inf)
        np.maximum.at(top, batch.query, batch.sims)
        columns += [np.where(np.isinf(top), 0.0, top)[slots.rows], np.log1p(np.diff(scores.indptr))[slots.rows]]
    return np.stack(columns, axis=1)


def joined_candidates(scores: sp.csr_matrix, chosen: sp.csr_matrix, extra: sp.csr_matrix) -> sp.csr_matrix:
    """The union of ``chosen`` (a cut of ``scores``) and ``extra``'s labels per row, label ids
    sorted per row, each stored with its value in ``scores`` (0 where ``scores`` has none: an
    explicit entry, so that it is a candidate)."""
    width = max(scores.shape[1], extra.shape[1])
    rows = np.concatenate(
        [np.repeat(np.arange(m.shape[0], dtype=np.int64), np.diff(m.indptr)) for m in (chosen, extra)]
    )
    labels = np.concatenate([chosen.indices, extra.indices]).astype(np.int64)
    pairs = np.unique(rows * width + labels)
    query, label = pairs // width, pairs % width
    values = np.zeros(len(pairs), dtype=scores.dtype)
    at, found = StoredSlots(scores)(query, label)  # scores' storage needs no sorting, nor a copy
    values[found] = scores.data[at]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(query, minlength=scores.shape[0]))]).astype(np.int64)
    return sp.csr_matrix((values, label.astype(np.int32), indptr), shape=(scores.shape[0], width))


def top_of_rows(scores: sp.csr_matrix, widths: Sequence[int]) -> sp.csr_matrix:
    """``scores`` with row i cut to its ``widths[i]`` highest entries (ties: the lower label id
    first), storage order kept."""
    keep = []
    for i, width in enumerate(widths):
        start, end = scores.indptr[i], scores.indptr[i + 1]
        if end - start <= width:
            keep.append(np.arange(start, end))
        else:
            best = np.lexsort((scores.indices[start:end], -scores.data[start:end]))[:width]
            keep.append(start + np.sort(best))
    at = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum([len(k) for k in keep])])
    return sp.csr_matrix((scores.data[at], scores.indices[at], indptr), shape=scores.shape)


def ranks_within_rows(indptr: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Each stored entry's rank (0: the highest) by ``x`` among the entries of its row of a CSR
    matrix with row pointers ``indptr`` (``x[j]``: of its j-th stored entry); ties in storage order.

    The entries are laid out as a dense (rows x longest row) grid, so that every row's sort is one
    numpy call along the grid's second axis: a batch's rows are a few hundred entries each, and
    each row's sort stays in cache (a lexsort of the whole batch by (row, x) is twice as slow)."""
    x = np.asarray(x, dtype=np.float64)
    ranks = np.empty(len(x), dtype=np.int64)
    if len(indptr) <= 2:  # one row (an idle server's query): a plain sort
        ranks[np.argsort(-x, kind="stable")] = np.arange(len(x))
        return ranks
    lengths = np.diff(indptr)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(x)) - indptr[:-1][rows]
    grid = np.full((len(lengths), int(lengths.max())), np.inf)
    grid[rows, position] = -x  # cells past a row's end sort after its entries
    order = np.argsort(grid, axis=1, kind="stable")
    grid_ranks = np.empty_like(order)
    np.put_along_axis(grid_ranks, order, np.arange(order.shape[1])[None, :], axis=1)
    return grid_ranks[rows, position]


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
