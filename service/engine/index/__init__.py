"""The key index: one :class:`KeyIndex` Protocol, three implementations (hnswlib's graph, the
compressed IVF-PQ index, several of either as shards), and the one order of their answers."""

from service.engine.index.hnsw import HnswIndex
from service.engine.index.ivfpq import IvfPqIndex, empty_index, exact_rerank, faiss_threads, lists_offset
from service.engine.index.protocol import KeyIndex, best_first, by_distance_then_key, merge_top_k
from service.engine.index.sharded import ShardedIndex

__all__ = [
    "HnswIndex",
    "IvfPqIndex",
    "KeyIndex",
    "ShardedIndex",
    "best_first",
    "by_distance_then_key",
    "exact_rerank",
    "empty_index",
    "faiss_threads",
    "lists_offset",
    "merge_top_k",
]
