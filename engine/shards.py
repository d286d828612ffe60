"""One shard of a bundle on its own, and the merge of the shards' answers.

A sharded bundle splits its keys into contiguous ranges, one key index each (hnswlib or ivfpq).
In one process they load as one :class:`~engine.index.sharded.ShardedIndex`. A distributed
deployment holds one shard per process (:class:`ShardSearcher`, loaded by
:func:`~engine.bundle.load_shard`) and merges their :class:`ShardAnswer` s with
:func:`merge_answers` (in :func:`~engine.index.protocol.best_first` order, as the
sharded index merges), which carries the value rows of the merged keys along for the RAE
aggregation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from bundle import Shard
from engine.index.protocol import KeyIndex, merge_top_k
from engine.lexical import KeyTerms, QueryTerms


@dataclass
class ShardQuery:
    """One request's queries for a shard: ``fetch`` nearest keys each, at search breadth ``ef``;
    with the queries' ``terms`` (a lexical fusion), the keys' lexical similarities too."""

    vectors: np.ndarray
    fetch: int
    ef: int
    terms: list[QueryTerms] | None = None


@dataclass
class ShardAnswer:
    """One shard's nearest keys for a batch of queries: global key ids and distances (``nq x k``,
    best first), the value rows of those keys for an RAE memory (row-major: ``(nq·k) x labels``),
    the ef the search ran at, and for a lexical fusion the keys' lexical similarities (``nq x k``)."""

    keys: np.ndarray
    distances: np.ndarray
    rows: sp.csr_matrix | None
    ef: int
    lexical: np.ndarray | None = None

    def split(self, queries: list[int]) -> list[ShardAnswer]:
        """The answers of consecutive groups of ``queries[i]`` queries (one batch, several requests)."""
        bounds = np.cumsum([0, *queries])
        width = self.keys.shape[1]
        return [
            ShardAnswer(
                self.keys[start:end],
                self.distances[start:end],
                self.rows[start * width : end * width] if self.rows is not None else None,
                self.ef,
                self.lexical[start:end] if self.lexical is not None else None,
            )
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        ]


class ShardSearcher:
    """One shard of a bundle, on its own: its key index, (RAE) its rows of V and (a lexical
    fusion) its keys' term vectors. Thread-safe."""

    def __init__(
        self,
        index: KeyIndex,
        values: sp.csr_matrix | None,
        shard: Shard,
        search_threads: int = 1,
        key_terms: KeyTerms | None = None,
    ):
        self.index = index
        self.values = values
        self.shard = shard
        self.search_threads = search_threads
        self.key_terms = key_terms
        # one search at a time: each may use all of the replica's search_threads
        self._lock = threading.Lock()

    def search(self, vectors: np.ndarray, fetch: int, ef: int, terms: list[QueryTerms] | None = None) -> ShardAnswer:
        """The ``fetch`` nearest keys of this shard (fewer when it holds fewer) at search breadth
        ``ef``; with the queries' ``terms``, the keys' lexical similarities too."""
        k = min(fetch, self.shard.keys)
        with self._lock:
            keys, distances = self.index.search(vectors, k, ef, threads=self.search_threads)
        rows = self.value_rows(keys) if self.values is not None else None
        lexical = None
        if terms is not None:
            if self.key_terms is None:
                raise ValueError("lexical similarities asked of a shard without key terms")
            lexical = self.key_terms.similarities(terms, keys)
        return ShardAnswer(keys, distances, rows, max(ef, k), lexical)

    def value_rows(self, keys: np.ndarray) -> sp.csr_matrix:
        """The value rows of ``keys`` (row-major), an empty row where there is no key (−1: a
        compressed index's scan may find fewer keys than asked)."""
        found = (keys >= 0).ravel()
        rows = self.values[np.where(found, keys.ravel() - self.shard.first_key, 0)]
        if found.all():
            return rows
        return sp.diags(found.astype(np.float32)) @ rows

    def search_many(self, queries: list[ShardQuery]) -> list[ShardAnswer]:
        """The answers to several requests, one index search per distinct ef at the largest fetch of
        its requests. With one ef (≥ every fetch) a longer list starts with the shorter one, so
        each answer is the one its request would get alone."""
        answers: list[ShardAnswer | None] = [None] * len(queries)
        for ef in sorted({query.ef for query in queries}):
            group = [i for i, query in enumerate(queries) if query.ef == ef]
            vectors = np.concatenate([queries[i].vectors for i in group])
            lexical = queries[group[0]].terms is not None
            terms = [t for i in group for t in queries[i].terms] if lexical else None
            answer = self.search(vectors, max(queries[i].fetch for i in group), ef, terms)
            for i, part in zip(group, answer.split([len(queries[i].vectors) for i in group]), strict=True):
                answers[i] = part
        return answers


@dataclass
class MergedAnswer:
    """The ``n`` nearest keys over all shards, per query, as one index would give them: keys,
    inner-product similarities, the shards' value rows stacked (``rows``) with ``positions``
    saying which of them belongs to each merged key (the rows an RAE memory weighs,
    :func:`~engine.search.merged_neighbours`), and the keys' lexical similarities for a
    lexical fusion."""

    keys: np.ndarray
    sims: np.ndarray
    positions: np.ndarray
    rows: sp.csr_matrix | None
    lexical: np.ndarray | None


def merge_answers(answers: list[ShardAnswer], n: int) -> MergedAnswer:
    """The shards' answers merged into the ``n`` nearest keys per query (:class:`MergedAnswer`)."""
    offsets = np.cumsum([0] + [answer.keys.size for answer in answers[:-1]])
    positions = [
        offset + np.arange(answer.keys.size).reshape(answer.keys.shape)
        for offset, answer in zip(offsets, answers, strict=True)
    ]
    lexical = answers[0].lexical is not None
    carried = [positions] + ([[a.lexical for a in answers]] if lexical else [])
    keys, distances, positions, *merged_lexical = merge_top_k(
        [a.keys for a in answers], [a.distances for a in answers], n, *carried
    )
    sims = (1.0 - distances).astype(np.float32)
    rows = sp.vstack([a.rows for a in answers], format="csr") if answers[0].rows is not None else None
    return MergedAnswer(keys, sims, positions, rows, merged_lexical[0] if lexical else None)
