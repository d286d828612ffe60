"""Several key indexes over disjoint, contiguous key ranges, searched as one
:class:`~engine.index.protocol.KeyIndex`.

A sharded bundle splits its keys into contiguous ranges, one index each (hnswlib or ivfpq), whose
keys are the global ids. Searching every shard for its top n and keeping the n best of the union
(:func:`~engine.index.protocol.merge_top_k`) is exact: each of the global top n is among
the top n of its own shard. Appended keys go to the last shard.
"""

from __future__ import annotations

import numpy as np

from engine.index.protocol import KeyIndex, merge_top_k


class ShardedIndex:
    """Shards (each a :class:`KeyIndex`) in key order, searched together and merged exactly."""

    def __init__(self, shards: list[KeyIndex]):
        self.shards = shards
        self.dim = shards[0].dim
        self._first_keys = np.cumsum([0] + [s.count for s in shards[:-1]])

    def search(self, vectors: np.ndarray, n: int, breadth: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        keys, distances = [], []
        for shard in self.shards:
            visible = shard.count - shard.hidden
            if visible > 0:
                shard_keys, shard_distances = shard.search(vectors, min(n, visible), breadth, threads)
                keys.append(shard_keys.astype(np.int64))
                distances.append(shard_distances)
        return merge_top_k(keys, distances, n)

    @property
    def count(self) -> int:
        return sum(shard.count for shard in self.shards)

    @property
    def hidden(self) -> int:
        return sum(shard.hidden for shard in self.shards)

    def vectors(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        shard_of = np.searchsorted(self._first_keys, ids, side="right") - 1
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for i, shard in enumerate(self.shards):
            rows = np.flatnonzero(shard_of == i)
            if rows.size:
                out[rows] = shard.vectors(ids[rows])
        return out

    # The live memory appends to the last shard.
    @property
    def capacity(self) -> int:
        return int(self._first_keys[-1]) + self.shards[-1].capacity

    def reserve(self, total: int) -> None:
        self.shards[-1].reserve(total - int(self._first_keys[-1]))

    def add(self, vectors: np.ndarray, ids: np.ndarray, threads: int = 1) -> None:
        self.shards[-1].add(vectors, ids, threads)

    def hide(self, key: int) -> None:
        self.shards[-1].hide(key)

    def show(self, key: int) -> None:
        self.shards[-1].show(key)

    def take_back(self, first: int, end: int) -> None:
        self.shards[-1].take_back(first, end)
