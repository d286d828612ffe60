"""Building the compressed key index (``--index ivfpq``, service/engine/index/ivfpq.py): k-means
cells, 4-bit PQ fast-scan codes, and the keys' float16 vectors the service re-ranks by.

Training reads a sample of the keys (``SAMPLE_PER_CELL`` per cell) for a few k-means rounds: on
2 cores the cells of 10^7 keys train in minutes, where faiss's defaults (256 points a cell, 25
rounds) would take an hour; the re-rank repairs the small loss in cell quality that costs.
"""

from __future__ import annotations

import math
from pathlib import Path

import faiss
import numpy as np

from service.engine.offline import empty_index, faiss_threads

# k-means points per cell: faiss warns below 39, and more buys little once candidates are re-ranked
SAMPLE_PER_CELL = 64
KMEANS_ROUNDS = 10
# cells: about 4·sqrt(keys), a power of two, with at least this many keys a cell on average
MIN_KEYS_PER_CELL = 39


def auto_nlist(keys: int) -> int:
    """Cells for ``keys`` keys: the power of two at or below min(4·sqrt(keys), keys / 39)."""
    wanted = max(1.0, min(4 * math.sqrt(keys), keys / MIN_KEYS_PER_CELL))
    return 1 << int(math.log2(wanted))


def build_ivfpq(
    keys: np.ndarray,
    nlist: int,
    pq_m: int,
    index_path: Path,
    rerank_path: Path,
    seed: int = 0,
    build_threads: int = 0,
) -> dict:
    """Train and fill an IVF-PQ fast-scan index over ``keys`` (local ids 0..n−1) into
    ``index_path``, and their float16 vectors into ``rerank_path``; returns the seconds spent
    training and adding."""
    import time

    keys = np.ascontiguousarray(keys, dtype=np.float32)
    index = empty_index(keys.shape[1], nlist, pq_m)
    index.cp.niter = KMEANS_ROUNDS
    index.cp.seed = seed
    index.cp.max_points_per_centroid = SAMPLE_PER_CELL
    sample = np.random.default_rng(seed).choice(len(keys), min(len(keys), SAMPLE_PER_CELL * nlist), replace=False)
    with faiss_threads(build_threads):
        started = time.perf_counter()
        index.train(keys[np.sort(sample)])
        trained = time.perf_counter()
        step = 1 << 20  # in blocks: faiss copies what it is given
        for start in range(0, len(keys), step):
            block = keys[start : start + step]
            index.add_with_ids(block, np.arange(start, start + len(block), dtype=np.int64))
        added = time.perf_counter()
    faiss.write_index(index, str(index_path))
    np.save(rerank_path, keys.astype(np.float16))
    return {"train_s": round(trained - started, 1), "add_s": round(added - trained, 1)}
