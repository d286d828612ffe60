"""Several HNSW indexes over disjoint key ranges, searched as one.

A sharded bundle splits its keys into contiguous ranges, one hnswlib index each, whose element
labels are the global key ids. Searching every shard for its top k and keeping the k best of the
union is exact: each of the global top k is among the top k of its own shard. The same merge is
what a distributed deployment does across machines; here the shards live in one process.

:class:`ShardedIndex` offers the part of ``hnswlib.Index`` the engine uses, so the search and the
live memory (:mod:`service.engine.memory`) treat one index and many alike. Appended keys go to
the last shard.
"""

from __future__ import annotations

import numpy as np

from service.engine.memory import by_distance_then_key


def merge_top_k(keys: list[np.ndarray], distances: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query row, the ``k`` smallest distances of the shards' answers (each ``nq x k_i``),
    equal distances in key order."""
    merged_keys, merged_distances = by_distance_then_key(
        np.concatenate(keys, axis=1), np.concatenate(distances, axis=1)
    )
    return merged_keys[:, :k], merged_distances[:, :k]


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

    def knn_query(self, vectors: np.ndarray, k: int):
        keys, distances = [], []
        for i, shard in enumerate(self.shards):
            live = shard.get_current_count() - (len(self._deleted) if i == len(self.shards) - 1 else 0)
            if live > 0:
                shard_keys, shard_distances = shard.knn_query(vectors, k=min(k, live))
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
