"""hnswlib's graph as a :class:`~service.engine.index.protocol.KeyIndex`.

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

from service.engine.index.protocol import by_distance_then_key


class HnswIndex:
    """An ``hnswlib.Index`` whose labels are the global key ids."""

    def __init__(self, index: hnswlib.Index):
        self.index = index
        self.dim = index.dim
        self._hidden: set[int] = set()  # keys marked deleted
        self._breadth = threading.Lock()  # ef is hnswlib's index-global state: set and used together

    @classmethod
    def load(cls, file: Path, dim: int, space: str = "ip") -> HnswIndex:
        """The index written at ``file`` (checked beforehand by :mod:`service.engine.hnsw_file`:
        hnswlib trusts what it reads). Raises hnswlib's RuntimeError when it cannot read it."""
        index = hnswlib.Index(space=space, dim=dim)
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
