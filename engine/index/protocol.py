"""What the engine asks of a key index, and the one order its answers come in.

:class:`KeyIndex` is the engine's central interface: the live memory
(:mod:`engine.memory`), the shard searchers (:mod:`engine.shards`) and the search
path call these methods and no library's. Three implementations: :class:`~.hnsw.HnswIndex`
(hnswlib's graph), :class:`~.ivfpq.IvfPqIndex` (faiss IVF-PQ codes, re-ranked exactly) and
:class:`~.sharded.ShardedIndex` (several of either over disjoint key ranges, searched as one).

A search's breadth is an argument of each call (as PECOS's HNSW takes its search parameters per
call), not state of the index: hnswlib's ``ef`` for a graph, the re-rank depth for a compressed
index; an index never searches narrower than the ``n`` it is asked for.

Every answer, and every merge of answers, is in the order :func:`best_first` defines: by distance,
equal distances by key id.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class KeyIndex(Protocol):
    """Keys (vectors, global ids) searched by inner product. Ids are contiguous: an index holds
    ``count`` keys from its first id on, and takes appended keys in id order after them.

    Concurrency: :meth:`search` may run on several threads at once; the mutating methods
    (:meth:`add`, :meth:`hide`, :meth:`show`, :meth:`take_back`, :meth:`reserve`) must not run
    beside a search or each other (the memory holds its lock around them)."""

    dim: int

    def search(self, vectors: np.ndarray, n: int, breadth: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` nearest visible keys of each query (``vectors``: nq x dim), best first
        (:func:`best_first`): global key ids (int64, nq x n, −1 where fewer were found) and
        distances ``1 − inner product`` (float32, +inf for none). ``breadth``: how wide the search
        runs (at least ``n``); ``threads``: the threads it may use (−1 or 0: every core)."""
        ...

    @property
    def count(self) -> int:
        """Keys held, hidden ones included."""
        ...

    @property
    def hidden(self) -> int:
        """Keys held but hidden (:meth:`hide`): searches skip them."""
        ...

    @property
    def capacity(self) -> int:
        """Keys it has room for before it must grow (:meth:`reserve`)."""
        ...

    def reserve(self, total: int) -> None:
        """Room for ``total`` keys."""
        ...

    def add(self, vectors: np.ndarray, ids: np.ndarray, threads: int = 1) -> None:
        """Append keys ``ids`` (the next ids, in order) with their ``vectors``; a hidden key added
        again is replaced and shown."""
        ...

    def hide(self, key: int) -> None:
        """Leave ``key`` out of searches until :meth:`show`."""
        ...

    def show(self, key: int) -> None: ...

    def take_back(self, first: int, end: int) -> None:
        """Undo the insertion of keys ``first`` .. ``end − 1`` (an append that failed part-way;
        some may never have been inserted): searches never see them, and the next :meth:`add`
        of ids from ``first`` on goes where they would have."""
        ...

    def vectors(self, ids) -> np.ndarray:
        """The stored vectors of keys ``ids``, float32 (ids x dim)."""
        ...


def best_first(keys: np.ndarray, distances: np.ndarray, k: int | None = None) -> np.ndarray:
    """Per row, the positions of the ``k`` (None: all) smallest ``distances`` in order, equal ones
    by key id: the one order of every answer and every merge, so keys with identical vectors (an
    instance whose text is a label's) come out in one order however the index is built or sharded,
    and exact search gives one answer. With ``k``, only the best ``2k`` are sorted (a partition
    finds them) unless a tie crosses that cut, where the whole row decides (sorting every
    candidate cost as much as a compressed index's scan itself)."""
    width = distances.shape[1]
    if k is None or width <= 2 * k:
        return np.lexsort((keys, distances), axis=-1)[:, :k]
    part = np.argpartition(distances, 2 * k - 1, axis=1)
    head, rest = part[:, : 2 * k], part[:, 2 * k :]
    head_distances = np.take_along_axis(distances, head, axis=1)
    if np.any(np.take_along_axis(distances, rest, axis=1).min(axis=1) <= np.sort(head_distances, axis=1)[:, k - 1]):
        return np.lexsort((keys, distances), axis=-1)[:, :k]  # a tie at the cut
    within = np.lexsort((np.take_along_axis(keys, head, axis=1), head_distances), axis=-1)[:, :k]
    return np.take_along_axis(head, within, axis=1)


def by_distance_then_key(keys: np.ndarray, distances: np.ndarray, *carried: np.ndarray) -> tuple[np.ndarray, ...]:
    """``keys``, ``distances`` and the ``carried`` arrays (same shape), each row in
    :func:`best_first` order."""
    order = best_first(keys, distances)
    return tuple(np.take_along_axis(a, order, axis=1) for a in (keys, distances, *carried))


def merge_top_k(
    keys: list[np.ndarray], distances: list[np.ndarray], k: int, *carried: list[np.ndarray]
) -> tuple[np.ndarray, ...]:
    """Per query row, the ``k`` best of several answers (each ``nq x k_i``: shards' answers) in
    :func:`best_first` order: (keys, distances, *carried), each ``carried`` list of per-answer
    arrays reordered alike."""
    merged = by_distance_then_key(*(np.concatenate(parts, axis=1) for parts in (keys, distances, *carried)))
    return tuple(array[:, :k] for array in merged)
