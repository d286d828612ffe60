"""The key index: one :class:`KeyIndex` Protocol, three implementations (hnswlib's graph, the
compressed IVF-PQ index, several of either as shards), and the one order of their answers. Each
kind is one class that builds, saves, loads (after :mod:`bundle`'s file checks) and searches."""

from engine.index.hnsw import HnswIndex
from engine.index.ivfpq import IvfPqIndex, auto_nlist, empty_index, exact_rerank, faiss_threads, lists_offset
from engine.index.protocol import KeyIndex, best_first, by_distance_then_key, merge_top_k
from engine.index.sharded import ShardedIndex

__all__ = [
    "HnswIndex",
    "IvfPqIndex",
    "KeyIndex",
    "ShardedIndex",
    "auto_nlist",
    "best_first",
    "by_distance_then_key",
    "exact_rerank",
    "empty_index",
    "faiss_threads",
    "lists_offset",
    "merge_top_k",
]
