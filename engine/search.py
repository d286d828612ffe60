"""The one search path: texts -> vectors -> HNSW -> (RAE aggregation) -> top-k label ids.

The HTTP service and the offline ``evaluate`` command both call :class:`Predictor`, so the
numbers ``evaluate`` prints are the numbers the service gives; the Ray Serve ingress fetches
the nearest keys from its shards instead and ranks them with the same :func:`rank_batch`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.sparse as sp

from bundle import Manifest
from engine.append_log import AppendLog
from engine.bundle import Bundle
from engine.encoder import EncodeTimes
from engine.fusion import ScoreFusion
from engine.lexical import QueryTerms
from engine.memory import AppendBatch, AppendOutcome, Memory, MemoryView, base_view
from engine.rae import KeptKeys, ValueRows, aggregate_kept, keep_keys, top_k_of_row
from engine.shards import ShardAnswer, merge_answers
from engine.sparse import LabelColumns

# Texts per encoder call when encoding an append: a request queued behind one waits for at most
# this many texts' encoding.
APPEND_ENCODE_CHUNK = 8

RunChunk = Callable[[Callable[[], np.ndarray]], np.ndarray]


@dataclass
class StageTimes:
    """Seconds spent per stage for one batch."""

    tokenize: float = 0.0
    encode: float = 0.0
    search: float = 0.0
    aggregate: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"tokenize": self.tokenize, "encode": self.encode, "search": self.search, "aggregate": self.aggregate}

    def add_encoding(self, times: EncodeTimes) -> None:
        """Fill in the encode stage's times (a search measures only its own stages)."""
        self.tokenize, self.encode = times.tokenize_s, times.encode_s


@dataclass
class Ranking:
    """Top-k of one query: label ids and scores, best first."""

    ids: np.ndarray
    scores: np.ndarray


@dataclass
class Prediction:
    """Rankings in query order, the stage times, and the HNSW ef the search ran at (the asked
    ef or the bundle's default, raised to the number of neighbours fetched when that is larger):
    ``ef`` the widest, ``efs`` each query's."""

    rankings: list[Ranking]
    times: StageTimes = field(default_factory=StageTimes)
    ef: int = 0
    view: MemoryView | None = None  # the labels the ids refer to (a live memory grows)
    efs: list[int] = field(default_factory=list)


class Predictor:
    """Search over one loaded bundle and its live memory (:mod:`engine.memory`).
    Thread-safe: searches and appends may run concurrently."""

    def __init__(self, bundle: Bundle, append_log: AppendLog | None = None):
        self.bundle = bundle
        manifest = bundle.manifest
        view = base_view(
            bundle.label_uids,
            bundle.label_texts,
            manifest.counts.memory_rows,
            bundle.values,
            manifest.append_ids,
            bundle.uid_lookup,
        )
        # a lexical score fusion's lexicon (None without one): the term vectors of queries and appended keys
        self.lexicon = bundle.fusion.lexicon if bundle.fusion is not None else None
        lam = manifest.rae.lam if manifest.rae else None
        rows_of_texts = self.lexicon.rows if self.lexicon is not None else None
        ranker = bundle.fusion.sparse if bundle.fusion is not None else None
        label_columns_of = ranker.label_columns if ranker is not None else None
        if ranker is not None:
            view = replace(view, sparse_columns=bundle.fusion.later_label_columns(bundle.label_texts))
        self.memory = Memory(bundle.index, view, lam, append_log, rows_of_texts, label_columns_of)

    @property
    def default_ef(self) -> int:
        """The bundle's search breadth (:attr:`~engine.manifest.Manifest.search_breadth`)."""
        return self.bundle.manifest.search_breadth

    @property
    def view(self) -> MemoryView:
        """The memory as of the last append: labels (uid → id), keys, values."""
        return self.memory.view

    def latest_view(self) -> MemoryView:
        """:attr:`view` after applying what the other processes of a group appended (a batch's
        memory: one ``stat`` when there is nothing new, nothing at all in a server of one process)."""
        self.memory.follow()
        return self.memory.view

    def append(self, batch: AppendBatch, run_chunk: RunChunk | None = None) -> AppendOutcome:
        """Add labels and instances to the memory, durably when it has a log: :meth:`prepare_append`
        then ``memory.commit`` (a server calls the two apart, so it holds its locks only for the
        commit)."""
        return self.memory.commit(batch, self.prepare_append(batch, run_chunk))

    def prepare_append(self, batch: AppendBatch, run_chunk: RunChunk | None = None) -> np.ndarray | None:
        """Check ``batch`` and encode its texts in chunks, each by ``run_chunk(work)`` (default:
        at once, on this thread); a server passes its batcher's
        :meth:`~engine.batcher.MicroBatcher.run_when_idle`, so appends encode between
        requests. None: its ``append_id`` is applied already."""
        run_chunk = run_chunk or (lambda work: work())

        def encode(texts: list[str]) -> np.ndarray:
            chunks = [texts[i : i + APPEND_ENCODE_CHUNK] for i in range(0, len(texts), APPEND_ENCODE_CHUNK)]
            return np.concatenate([run_chunk(lambda c=c: self.bundle.encoder.encode(c)[0]) for c in chunks])

        return self.memory.prepare(batch, encode)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, EncodeTimes, list[QueryTerms] | None]:
        """The query vectors of ``texts`` and, for a lexical score fusion, their term vectors,
        from the one tokenization the encoder makes (the first stage of :meth:`predict`; a
        pipelined caller runs it apart from :meth:`search`, and hands both over)."""
        if self.lexicon is None:
            return *self.bundle.encoder.encode(texts), None
        vectors, times, encodings = self.bundle.encoder.encode_keeping_tokens(texts)
        started = time.perf_counter()
        terms = self.lexicon.terms_of(encodings)  # the lexicon and the encoder load the bundle's tokenizer alike
        times.tokenize_s += time.perf_counter() - started
        return vectors, times, terms

    def predict(
        self,
        texts: list[str],
        k: int | Sequence[int],
        ef: int | None = None,
        exclude: Sequence[Collection[int]] | None = None,
        view: MemoryView | None = None,
    ) -> Prediction:
        vectors, enc_times, terms = self.encode(texts)
        prediction = self.search(vectors, k, ef, exclude, view, texts, terms)
        prediction.times.add_encoding(enc_times)
        return prediction

    def search(
        self,
        vectors: np.ndarray,
        k: int | Sequence[int],
        ef: int | Sequence[int | None] | None = None,
        exclude: Sequence[Collection[int]] | None = None,
        view: MemoryView | None = None,
        texts: Sequence[str] | None = None,
        terms: list[QueryTerms] | None = None,
    ) -> Prediction:
        """Top-k per query. ``k`` and ``ef`` may differ per query (a micro-batch mixes requests).
        ``exclude`` holds label ids of ``view`` (default: the current memory), the memory the
        search then runs against. A bundle whose score fusion is lexical needs the queries' term
        vectors (``terms``, as :meth:`encode` gives them) or their ``texts`` to compute them from.

        A query's answer does not depend on the other queries of the batch: the queries that need
        as many neighbours at the same ef share one HNSW call, and a query that needs fewer or
        asked a narrower ef is never searched wider for its neighbours' sake."""
        view = view or self.memory.view
        n = len(vectors)
        ks = [k] * n if isinstance(k, int) else list(k)
        efs = [ef] * n if ef is None or isinstance(ef, int) else list(ef)
        exclude = exclude if exclude is not None else [()] * n
        if len(exclude) != n or len(ks) != n or len(efs) != n:
            raise ValueError("k, ef and exclude must have one entry per query")
        manifest = self.bundle.manifest
        t0 = time.perf_counter()
        keys, sims, ran_at = self.knn_per_query(vectors, neighbours_needed(manifest, ks, exclude), efs, view)
        t1 = time.perf_counter()
        if self.lexicon is not None and terms is None:
            if texts is None or len(texts) != n:
                raise ValueError("this bundle's score fusion is lexical: search needs the query texts")
            terms = self.lexicon.query_terms(list(texts))
        lexical = self.lexical_similarities(keys, view, texts, terms)
        widest = max(ran_at, default=0)
        labels = view.labels_of_keys(keys)
        found = Neighbours(keys, sims, labels, view.values, lexical, widest, terms, view.sparse_columns, vectors)
        rankings = rank_batch(manifest, found, ks, exclude, self.bundle.fusion)
        times = StageTimes(search=t1 - t0, aggregate=time.perf_counter() - t1)
        return Prediction(rankings, times, widest, view, ran_at)

    def knn_per_query(
        self, vectors: np.ndarray, needed: Sequence[int], efs: Sequence[int | None], view: MemoryView
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """:meth:`knn` with each query's own neighbour count and ef: one call per distinct
        (count, ef), the rows padded to the widest count with −1 keys (``-inf`` similarities), as
        a search that finds fewer keys pads them. Returns each query's ef too."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (count, ef) in enumerate(zip(needed, efs, strict=True)):
            groups.setdefault((count, ef or self.default_ef), []).append(i)
        if len(groups) == 1:
            (count, ef), _ = groups.popitem()
            keys, sims, ran_at = self.knn(vectors, count, ef, view)
            return keys, sims, [ran_at] * len(vectors)
        width = max(needed)
        keys = np.full((len(vectors), width), -1, dtype=np.int64)
        sims = np.full((len(vectors), width), -np.inf, dtype=np.float32)
        ran = [0] * len(vectors)
        for (count, ef), rows in groups.items():
            group_keys, group_sims, ran_at = self.knn(vectors[rows], count, ef, view)
            keys[rows, :count], sims[rows, :count] = group_keys, group_sims
            for row in rows:
                ran[row] = ran_at
        return keys, sims, ran

    def lexical_similarities(
        self,
        keys: np.ndarray,
        view: MemoryView,
        texts: Sequence[str] | None,
        terms: list[QueryTerms] | None = None,
    ) -> np.ndarray | None:
        """The keys' lexical similarities to the queries for a lexical fusion (None without one)."""
        if self.lexicon is None:
            return None
        if terms is None:
            if texts is None or len(texts) != len(keys):
                raise ValueError("this bundle's score fusion is lexical: search needs the query texts")
            terms = self.lexicon.query_terms(list(texts))
        elif len(terms) != len(keys):
            raise ValueError("search needs one term vector per query")
        key_terms = self.bundle.key_terms.with_appended(view.appended_key_terms)
        return key_terms.similarities(terms, keys)

    def knn(
        self, vectors: np.ndarray, n: int, ef: int | None, view: MemoryView | None = None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Best-first (key ids, inner-product similarities) of the ``n`` nearest keys of ``view``
        (−1 where it has fewer), and the ef the search ran at."""
        return self.memory.knn(vectors, n, ef or self.default_ef, view or self.memory.view)


def neighbours_needed(manifest: Manifest, ks: Sequence[int], exclude: Sequence[Collection[int]]) -> list[int]:
    """Nearest keys each query needs: its k plus its excluded labels (a label index), or b plus
    the labels it excludes (an RAE memory drops excluded label keys before the softmax, and must
    still have b left). A batch fetched at once needs the most of them (the shards' fetch, then
    :func:`merged_neighbours`) and is ranked by :func:`rank_batch`."""
    if manifest.index_kind == "rae_memory":
        # a fusion's label-key source reads the label keys of a deeper search
        keys = manifest.fusion.label_keys if manifest.fusion is not None else None
        deeper = keys.fetch if keys is not None else 0
        return [manifest.rae.top_b + deeper + len(e) for e in exclude]
    return [k + len(e) for k, e in zip(ks, exclude, strict=True)]


@dataclass
class Neighbours:
    """The nearest keys of a batch of queries as ranking reads them, each array ``nq x n``, best
    first: ``rows``, each key's row of ``values`` (−1: no key); ``sims``, its inner-product
    similarity; ``labels``, its label id (−1: an instance key, or no key). ``values``: the value
    rows of an RAE memory (None: a label index); ``lexical``: the keys' lexical similarities to
    the queries (a lexical fusion only); ``ef``: the HNSW breadth the search ran at; ``terms``:
    the queries' term vectors (a fusion with a sparse ranker scores them); ``sparse_columns``:
    that ranker's columns of the labels after its fitted ones (the memory view's); ``vectors``: the
    queries' own vectors (nq x dim; a ranker with dense weights reads them)."""

    rows: np.ndarray
    sims: np.ndarray
    labels: np.ndarray
    values: ValueRows | None
    lexical: np.ndarray | None
    ef: int
    terms: list[QueryTerms] | None = None
    sparse_columns: LabelColumns | None = None
    vectors: np.ndarray | None = None


def merged_neighbours(
    answers: Sequence[ShardAnswer],
    n: int,
    view: MemoryView,
    terms: list[QueryTerms] | None = None,
    vectors: np.ndarray | None = None,
) -> Neighbours:
    """The shards' answers merged into the ``n`` nearest keys per query
    (:func:`~engine.shards.merge_answers`), as :func:`rank_batch` reads them: the
    value rows are the ones the shards sent, each key's row its position among them; ``terms``
    and ``vectors``: the queries' term vectors and dense vectors, for a fusion that reads them."""
    merged = merge_answers(list(answers), n)
    values = ValueRows(merged.rows) if merged.rows is not None else None
    labels = view.labels_of_keys(merged.keys)
    ef = max(a.ef for a in answers)
    return Neighbours(
        merged.positions, merged.sims, labels, values, merged.lexical, ef, terms, view.sparse_columns, vectors
    )


@dataclass
class FusionRows:
    """What a score fusion reads of a batch: ``candidates``, the labels it rescores per query (a
    queries × labels CSR of p̂: each query's top rerank depth by p̂, or every aggregated label), and
    ``features``, φ of each stored candidate in ``candidates``' storage order."""

    candidates: sp.csr_matrix
    features: np.ndarray


def rank_batch(
    manifest: Manifest,
    found: Neighbours,
    ks: Sequence[int],
    exclude: Sequence[Collection[int]],
    fusion: ScoreFusion | None = None,
) -> list[Ranking]:
    """The one ranking of a batch's fetched nearest keys: each query's top ``ks`` labels, its
    ``exclude`` label ids left out. A label index ranks the labels of the keys; an RAE memory
    weighs the value rows of the keys; with ``fusion``, by fused score (:mod:`engine.fusion`),
    whose lexical features read ``found.lexical``. The nearest keys are the caller's to fetch
    (each query needs :func:`neighbours_needed`): the single server from its memory
    (:meth:`Predictor.search`, on a search thread), the Ray ingress from its shards
    (:func:`merged_neighbours`, awaiting replicas on an event loop), so both rank alike."""
    if len(exclude) != len(ks):
        raise ValueError("k and exclude must have one entry per query")
    if manifest.index_kind != "rae_memory":
        rankings = []
        for i, (k, excluded) in enumerate(zip(ks, exclude, strict=True)):
            keep = found.labels[i] >= 0
            if excluded:
                keep &= ~np.isin(found.labels[i], np.fromiter(excluded, dtype=np.int64))
            rankings.append(Ranking(ids=found.labels[i][keep][:k], scores=found.sims[i][keep][:k]))
        return rankings
    kept, scores = aggregated(manifest, found, exclude)
    if fusion is not None:
        margins = fusion.sparse_margins(found.terms, scores.shape[1], exclude, found.sparse_columns, found.vectors)
        hits = fusion.label_key_hits(found.labels, found.sims, exclude, scores.shape[1])
        scores = fusion.rescore(scores, kept, found.values, manifest.rae.tau, ks, margins, hits)
    return [Ranking(*top_k_of_row(scores, i, k)) for i, k in enumerate(ks)]


def fusion_candidates(
    manifest: Manifest, found: Neighbours, exclude: Sequence[Collection[int]], fusion: ScoreFusion
) -> FusionRows:
    """The :class:`FusionRows` ``fusion`` would rescore of a batch of an RAE memory (``fusion``
    may have no model yet): what a fusion is fitted on, computed as :func:`rank_batch` computes
    them for its fused ranking. The candidates do not depend on k (each query's top rerank depth
    by p̂, or every aggregated label)."""
    if manifest.index_kind != "rae_memory":
        raise ValueError("a score fusion ranks an RAE memory: a label index has no feature rows")
    kept, scores = aggregated(manifest, found, exclude)
    margins = fusion.sparse_margins(found.terms, scores.shape[1], exclude, found.sparse_columns, found.vectors)
    hits = fusion.label_key_hits(found.labels, found.sims, exclude, scores.shape[1])
    candidates = fusion.candidates(scores, margins=margins, hits=hits)
    return FusionRows(candidates, fusion.features_of(candidates, kept, found.values, manifest.rae.tau, margins, hits))


def aggregated(
    manifest: Manifest, found: Neighbours, exclude: Sequence[Collection[int]]
) -> tuple[list[KeptKeys], sp.csr_matrix]:
    """(the kept keys, p̂): an RAE memory's keys each query keeps (its excluded label keys and
    all beyond b dropped) and the labels' aggregated scores, a queries × labels CSR."""
    rae = manifest.rae
    kept = keep_keys(found.rows, found.sims, found.labels, exclude, rae.top_b, found.lexical)
    return kept, aggregate_kept(kept, found.values, rae.tau, exclude, rae.mode)


def excluded_label_ids(
    view: MemoryView, exclude: Collection[str] | Sequence[Collection[str]], texts: int
) -> list[set[int]]:
    """Per text, the ids in ``view`` of the label uids it excludes (unknown uids are dropped:
    they cannot be returned anyway). ``exclude`` as the API takes it: one collection of uids
    for all ``texts`` (mapped once, its set shared by every text), or one collection per text."""
    if not exclude or isinstance(next(iter(exclude)), str):
        return [view.label_ids(exclude)] * texts
    return [view.label_ids(uids) for uids in exclude]
