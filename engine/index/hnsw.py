"""hnswlib's graph as a :class:`~engine.index.protocol.KeyIndex`: one class that builds, saves,
loads (after :mod:`bundle.hnsw_file`'s checks: hnswlib trusts what it reads) and searches, as
PECOS's ``HNSW`` model does; export builds through it, the engine loads through it.

hnswlib keeps its search breadth ``ef`` as state of the index (``set_ef``), so a search that sets
it and one that queries could interleave on two threads; :class:`HnswIndex` takes the breadth per
call and holds its own small lock around ``set_ef`` + ``knn_query``, so its callers no longer do.
(A second handle per thread would copy the whole graph.)
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import hnswlib
import numpy as np

from bundle import HnswParams, check_index_body, check_index_header
from engine.index.protocol import by_distance_then_key


class HnswIndex:
    """An ``hnswlib.Index`` whose labels are the global key ids."""

    def __init__(self, index: hnswlib.Index):
        self.index = index
        self.dim = index.dim
        self._hidden: set[int] = set()  # keys marked deleted
        self._breadth = threading.Lock()  # ef is hnswlib's index-global state: set and used together

    @classmethod
    def build(
        cls, keys: np.ndarray, params: HnswParams, first_id: int = 0, seed: int = 0, threads: int = -1
    ) -> HnswIndex:
        """A graph over ``keys`` (float32, n x dim) whose labels are ``first_id``, ``first_id + 1``,
        …; ``params`` the manifest's (degree M, build breadth); ``threads`` −1: every core."""
        index = hnswlib.Index(space=params.space, dim=keys.shape[1])
        index.init_index(max_elements=len(keys), ef_construction=params.ef_construction, M=params.M, random_seed=seed)
        index.add_items(keys, first_id + np.arange(len(keys)), num_threads=threads)
        return cls(index)

    @classmethod
    def load(cls, file: Path, dim: int, params: HnswParams, first_key: int, keys: int) -> HnswIndex:
        """The graph written at ``file``, holding ``keys`` keys from id ``first_key`` on: its header
        and body checked first (:class:`bundle.HnswFileRefused`), then read by hnswlib (its
        RuntimeError when it still cannot)."""
        check_index_header(file, dim, params.M, keys)
        check_index_body(file, first_key, keys)
        index = hnswlib.Index(space=params.space, dim=dim)
        index.load_index(str(file))
        return cls(index)

    def save(self, file: Path) -> None:
        self.index.save_index(str(file))

    def search(self, vectors: np.ndarray, n: int, breadth: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """hnswlib's ``knn_query`` at ``ef = max(breadth, n)``. One thread by default (hnswlib's
        default, every core, starts and joins a thread per core on each call of over 4 rows per
        core). Keys tied in distance in key order (hnswlib's order among them is its graph's)."""
        with self._breadth:
            self.index.set_ef(max(breadth, n))
            keys, distances = self.index.knn_query(vectors, k=n, num_threads=threads)
        return by_distance_then_key(keys.astype(np.int64), distances)

    @property
    def count(self) -> int:
        return self.index.get_current_count()

    @property
    def hidden(self) -> int:
        return len(self._hidden)

    @property
    def capacity(self) -> int:
        return self.index.get_max_elements()

    def reserve(self, total: int) -> None:
        """A copy of the whole graph when it grows."""
        if total > self.capacity:
            self.index.resize_index(total)

    def add(self, vectors: np.ndarray, ids: np.ndarray, threads: int = 1) -> None:
        self.index.add_items(vectors, ids, num_threads=threads)
        self._hidden.difference_update(int(key) for key in ids)  # hnswlib un-deletes a re-added key

    def hide(self, key: int) -> None:
        self.index.mark_deleted(int(key))
        self._hidden.add(int(key))

    def show(self, key: int) -> None:
        self.index.unmark_deleted(int(key))
        self._hidden.discard(int(key))

    def take_back(self, first: int, end: int) -> None:
        """hnswlib cannot remove a key: those of ``first`` .. ``end − 1`` it holds are hidden, and
        the next append's :meth:`add` of the same ids replaces them (hnswlib updates an existing
        label's vector and un-deletes it)."""
        for key in range(first, end):
            with contextlib.suppress(RuntimeError):  # never inserted, or hidden already
                self.index.mark_deleted(key)
                self._hidden.add(key)

    def vectors(self, ids) -> np.ndarray:
        return np.asarray(self.index.get_items(np.asarray(ids, dtype=np.int64)), dtype=np.float32)
