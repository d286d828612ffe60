"""Several HNSW indexes over disjoint key ranges, searched as one.

A sharded bundle splits its keys into contiguous ranges, one hnswlib index each, whose element
labels are the global key ids. Searching every shard for its top k and keeping the k best of the
union is exact: each of the global top k is among the top k of its own shard. The same merge is
what a distributed deployment does across machines; here the shards live in one process.

:class:`ShardedIndex` offers the part of ``hnswlib.Index`` the engine uses, so the search and the
live memory (:mod:`service.engine.memory`) treat one index and many alike. Appended keys go to
the last shard.

A distributed deployment holds one shard per process (:class:`ShardSearcher`, loaded by
:func:`~service.engine.bundle.load_shard`) and merges their :class:`ShardAnswer` s with
:func:`merge_answers`, which carries the value rows of the merged keys along for the RAE
aggregation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from bundle import Shard
from service.engine.lexical import KeyTerms, QueryTerms
from service.engine.memory import by_distance_then_key, hide_keys


def merge_top_k(
    keys: list[np.ndarray], distances: list[np.ndarray], k: int, *carried: list[np.ndarray]
) -> tuple[np.ndarray, ...]:
    """Per query row, the ``k`` smallest distances of the shards' answers (each ``nq x k_i``),
    equal distances in key order: (keys, distances, *carried), each ``carried`` list of per-shard
    arrays reordered alike."""
    merged = by_distance_then_key(*(np.concatenate(parts, axis=1) for parts in (keys, distances, *carried)))
    return tuple(array[:, :k] for array in merged)


class ShardedIndex:
    """Shards (``hnswlib.Index`` each) in key order, searched together and merged exactly."""

    def __init__(self, shards: list):
        self.shards = shards
        self.dim = shards[0].dim
        self._deleted: set[int] = set()  # keys of an append in progress (last shard), hidden until published
        self._first_keys = np.cumsum([0] + [s.get_current_count() for s in shards[:-1]])

    def set_ef(self, ef: int) -> None:
        for shard in self.shards:
            shard.set_ef(ef)

    def get_current_count(self) -> int:
        return sum(shard.get_current_count() for shard in self.shards)

    def knn_query(self, vectors: np.ndarray, k: int, num_threads: int = 1):
        keys, distances = [], []
        for i, shard in enumerate(self.shards):
            live = shard.get_current_count() - (len(self._deleted) if i == len(self.shards) - 1 else 0)
            if live > 0:
                shard_keys, shard_distances = shard.knn_query(vectors, k=min(k, live), num_threads=num_threads)
                keys.append(shard_keys.astype(np.int64))
                distances.append(shard_distances)
        return merge_top_k(keys, distances, k)

    def get_items(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        shard_of = np.searchsorted(self._first_keys, ids, side="right") - 1
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for i, shard in enumerate(self.shards):
            rows = np.flatnonzero(shard_of == i)
            if rows.size:
                out[rows] = np.asarray(shard.get_items(ids[rows]), dtype=np.float32)
        return out

    # The live memory appends to the last shard.
    def get_max_elements(self) -> int:
        return int(self._first_keys[-1]) + self.shards[-1].get_max_elements()

    def resize_index(self, total: int) -> None:
        self.shards[-1].resize_index(total - int(self._first_keys[-1]))

    def add_items(self, data, ids, num_threads: int = 1) -> None:
        self.shards[-1].add_items(data, ids, num_threads=num_threads)
        self._deleted.difference_update(int(key) for key in ids)  # hnswlib un-deletes a re-added key

    def mark_deleted(self, key: int) -> None:
        self.shards[-1].mark_deleted(key)
        self._deleted.add(int(key))

    def unmark_deleted(self, key: int) -> None:
        self.shards[-1].unmark_deleted(key)
        self._deleted.discard(int(key))

    def take_back(self, first: int, end: int) -> None:
        """Undo a failed append's keys ``first`` .. ``end − 1`` in the last shard (see
        :func:`service.engine.memory.take_back`): removed from a compressed one, hidden in hnswlib."""
        last = self.shards[-1]
        if hasattr(last, "take_back"):
            last.take_back(first, end)
            self._deleted = {key for key in self._deleted if key < first}
            return
        hide_keys(self, first, end)


@dataclass
class ShardQuery:
    """One request's queries for a shard: ``fetch`` nearest keys each, at HNSW breadth ``ef``;
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
    """One shard of a bundle, on its own: its HNSW index, (RAE) its rows of V and (a lexical
    fusion) its keys' term vectors. Thread-safe."""

    def __init__(
        self,
        index,
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
        self._lock = threading.Lock()  # ef is index-global in hnswlib

    def search(self, vectors: np.ndarray, fetch: int, ef: int, terms: list[QueryTerms] | None = None) -> ShardAnswer:
        """The ``fetch`` nearest keys of this shard (fewer when it holds fewer) at HNSW breadth
        ``ef``; with the queries' ``terms``, the keys' lexical similarities too."""
        k = min(fetch, self.shard.keys)
        with self._lock:
            self.index.set_ef(max(ef, k))
            keys, distances = self.index.knn_query(vectors, k=k, num_threads=self.search_threads)
        keys = keys.astype(np.int64)
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
        """The answers to several requests, one HNSW call per distinct ef at the largest fetch of
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
    :func:`~service.engine.search.merged_neighbours`), and the keys' lexical similarities for a
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
