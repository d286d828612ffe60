"""The compressed key index (``ann`` ivfpq) as a :class:`~engine.index.protocol.KeyIndex`:
faiss IVF over 4-bit PQ fast-scan codes, a query's best candidates by code re-ranked exactly by
their stored float16 vectors.

A 64-d key costs 32 bytes of PQ code (``pq_m`` 64 → ``pq_m / 2`` bytes), 8 of id and 128 of
float16 vector: about 170 bytes against hnswlib's 532 (a graph of M=32 links and the float32
vector), and the index trains and fills in minutes at 10^7 keys where hnswlib's insertion takes
hours (bench/results/ann-compressed.json). PQ codes alone saturate below 0.99 recall@10 (their
error reorders near neighbours), so the search breadth is a re-rank depth: a query scans
``nprobe`` cells (the manifest's) for its ``max(breadth, n)`` best candidates by code and
re-ranks them by the exact inner product with their stored vectors.

Its files are checked before faiss reads them (:mod:`bundle.ivfpq_file`: every header field, every
inverted list, the re-rank vectors); :meth:`IvfPqIndex.load` checks what faiss read against the
manifest too (:func:`check_loaded`). Appends are added to the IVF lists (their cell from the
trained centroids, no rebuild) and their vectors kept beside the bundle's; compaction
(``export.compact``) trains and fills a fresh index. One class builds (:meth:`IvfPqIndex.build`,
what export runs), saves, loads and searches it.

Building trains on a sample of the keys (``SAMPLE_PER_CELL`` per cell) for a few k-means rounds:
on 2 cores the cells of 10^7 keys train in minutes, where faiss's defaults (256 points a cell, 25
rounds) would take an hour; the re-rank repairs the small loss in cell quality that costs.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

# faiss's OpenMP threads spin while they wait for each other by default: beside another busy
# process on a 2-core machine a 2-thread build then ran 9x slower than on one thread (41 s against
# 4.6 s to train 200k keys), passively waiting 5.8 s. Read when faiss's OpenMP starts, so set
# before faiss is imported; an operator's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np  # noqa: E402

from bundle import (  # noqa: E402
    FAST_SCAN_BLOCK,
    IndexRefused,
    check_index_file,
    empty_lists_size,
    load_rerank_vectors,
)
from engine.index.protocol import best_first, by_distance_then_key  # noqa: E402

# k-means points per cell: faiss warns below 39, and more buys little once candidates are re-ranked
SAMPLE_PER_CELL = 64
KMEANS_ROUNDS = 10
# cells: about 4·sqrt(keys), a power of two, with at least this many keys a cell on average
MIN_KEYS_PER_CELL = 39


def auto_nlist(keys: int) -> int:
    """Cells for ``keys`` keys: the power of two at or below min(4·sqrt(keys), keys / 39)."""
    wanted = max(1.0, min(4 * math.sqrt(keys), keys / MIN_KEYS_PER_CELL))
    return 1 << int(math.log2(wanted))


def factory_string(nlist: int, pq_m: int) -> str:
    return f"IVF{nlist},PQ{pq_m}x4fs"


def empty_index(dim: int, nlist: int, pq_m: int) -> faiss.Index:
    """An untrained IVF-PQ fast-scan index over inner products."""
    return faiss.index_factory(dim, factory_string(nlist, pq_m), faiss.METRIC_INNER_PRODUCT)


def lists_offset(dim: int, nlist: int, pq_m: int) -> int:
    """Where the inverted lists start in a written index of these parameters: everything before
    them (the IVF header, the ``nlist`` centroids, the PQ codebooks) has sizes fixed by the
    parameters alone, so an index of the same shape with empty lists says how long it is."""
    template = empty_index(dim, nlist, pq_m)
    template.quantizer.add(np.zeros((nlist, dim), dtype=np.float32))
    template.is_trained = True
    return len(faiss.serialize_index(template)) - empty_lists_size(nlist)


def check_loaded(index: faiss.Index, dim: int, nlist: int, pq_m: int, keys: int) -> None:
    """The read index against the manifest: its type, shape, metric and finite codebooks."""
    if not isinstance(index, faiss.IndexIVFPQFastScan):
        raise IndexRefused(f"a {type(index).__name__}, not an IVF-PQ fast-scan index")
    shape = (index.d, index.nlist, index.pq.M, index.pq.nbits, index.bbs, index.ntotal, index.metric_type)
    if shape != (dim, nlist, pq_m, 4, FAST_SCAN_BLOCK, keys, faiss.METRIC_INNER_PRODUCT) or not index.is_trained:
        raise IndexRefused(
            f"(dim, nlist, pq_m, bits, block, keys, metric) {shape}, expected "
            f"{(dim, nlist, pq_m, 4, FAST_SCAN_BLOCK, keys, faiss.METRIC_INNER_PRODUCT)}"
        )
    quantizer = faiss.downcast_index(index.quantizer)
    if quantizer.ntotal != nlist or quantizer.d != dim:
        raise IndexRefused(f"{quantizer.ntotal} centroids of {quantizer.d} dimensions, expected {nlist} of {dim}")
    centroids = quantizer.reconstruct_n(0, nlist)
    codebooks = faiss.vector_to_array(index.pq.centroids)
    if not (np.all(np.isfinite(centroids)) and np.all(np.isfinite(codebooks))):
        raise IndexRefused("a centroid or codebook entry is not finite")


class IvfPqIndex:
    """The compressed index of one shard (keys ``first_key`` .. ``first_key + keys − 1``). Its
    searches may run concurrently (faiss's search reads the index only); its mutations may not run
    beside them (the memory holds its lock around both)."""

    def __init__(self, index: faiss.Index, vectors: np.ndarray, first_key: int, nprobe: int):
        self.index = index
        self.dim = index.d
        # the bundle's keys' vectors, float16, memory-mapped: a plain array over the mapping (a
        # np.memmap's fancy indexing costs more per call)
        self.base = np.asarray(vectors)
        self.base_count = len(vectors)
        self.appended = np.zeros((0, self.dim), dtype=np.float16)  # capacity rows; the first ``added`` used
        self.added = 0
        self.first_key = first_key
        self.nprobe = min(nprobe, index.nlist)
        self._hidden: set[int] = set()  # local ids hidden (an append being inserted)
        self.build_seconds: dict[str, float] | None = None  # set by build

    @classmethod
    def build(cls, keys: np.ndarray, params, first_key: int = 0, seed: int = 0, threads: int = 0) -> IvfPqIndex:
        """Train and fill an index over ``keys`` (float32, n x dim; local ids 0..n−1, global ids from
        ``first_key``): k-means cells on a seeded sample, then every key's 4-bit PQ code in its
        cell; ``params`` the manifest's :class:`~bundle.IvfPqParams`; ``threads`` faiss's (0: its
        default). The seconds spent training and adding are in :attr:`build_seconds`."""
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        index = empty_index(keys.shape[1], params.nlist, params.pq_m)
        index.cp.niter = KMEANS_ROUNDS
        index.cp.seed = seed
        index.cp.max_points_per_centroid = SAMPLE_PER_CELL
        sample = np.random.default_rng(seed).choice(
            len(keys), min(len(keys), SAMPLE_PER_CELL * params.nlist), replace=False
        )
        with faiss_threads(threads):
            started = time.perf_counter()
            index.train(keys[np.sort(sample)])
            trained = time.perf_counter()
            step = 1 << 20  # in blocks: faiss copies what it is given
            for start in range(0, len(keys), step):
                block = keys[start : start + step]
                index.add_with_ids(block, np.arange(start, start + len(block), dtype=np.int64))
            added = time.perf_counter()
        built = cls(index, keys.astype(np.float16), first_key, params.nprobe)
        built.build_seconds = {"train_s": round(trained - started, 1), "add_s": round(added - trained, 1)}
        return built

    @classmethod
    def load(cls, index_file: Path, rerank_file: Path, dim: int, params, first_key: int, keys: int) -> IvfPqIndex:
        """A shard's index from its files, each checked before it is used (:class:`IndexRefused`);
        ``params``: the manifest's :class:`~engine.manifest.IvfPqParams`."""
        check_index_file(index_file, dim, params.nlist, params.pq_m, first_key, keys)
        vectors = load_rerank_vectors(rerank_file, dim, keys)
        try:
            index = faiss.read_index(str(index_file))
        except RuntimeError as exc:
            raise IndexRefused(f"faiss cannot read it ({exc})") from None
        check_loaded(index, dim, params.nlist, params.pq_m, keys)
        return cls(index, vectors, first_key, params.nprobe)

    def save(self, index_file: Path, rerank_file: Path) -> None:
        """The faiss index and every key's float16 vector (appended ones included), as a bundle
        holds them."""
        faiss.write_index(self.index, str(index_file))
        # without appends, the bundle's vectors as they are (no copy of 10^7 rows)
        np.save(rerank_file, self.base if not self.added else self.vectors_of(np.arange(self.count)))

    @property
    def count(self) -> int:
        return self.base_count + self.added

    @property
    def hidden(self) -> int:
        return len(self._hidden)

    @property
    def capacity(self) -> int:
        return self.base_count + len(self.appended)

    def reserve(self, total: int) -> None:
        """Room for ``total`` keys: the appended vectors' buffer grows (the IVF lists grow by themselves)."""
        rows = total - self.base_count
        if rows <= len(self.appended):
            return
        grown = np.zeros((rows, self.dim), dtype=np.float16)
        grown[: self.added] = self.appended[: self.added]
        self.appended = grown

    def add(self, vectors: np.ndarray, ids: np.ndarray, threads: int = 1) -> None:
        """Append keys, whose ids must be the next ones: the IVF lists take their codes (cells from
        the trained centroids), the buffer their float16 vectors."""
        data = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        local = np.asarray(ids, dtype=np.int64) - self.first_key
        expected = self.count + np.arange(len(local))
        if not np.array_equal(local, expected):
            raise ValueError("a compressed index appends keys in id order, after its last one")
        self.reserve(self.count + len(local))
        with faiss_threads(threads):
            self.index.add_with_ids(data, local)
        self.appended[self.added : self.added + len(local)] = data
        self.added += len(local)
        self._hidden.difference_update(int(key) for key in local)  # as hnswlib un-deletes a re-added key

    def take_back(self, first: int, end: int | None = None) -> None:
        """Remove every key from global id ``first`` on (those of an append that failed part-way,
        ``end`` or not: some may have reached the IVF lists and not the buffer), so that the next
        append starts at ``first`` again. Appended keys sit at the end of their lists, in id order,
        so each list is cut back to its keys below ``first``; the codes they leave in the list's
        last block are cleared, as a fast-scan block packs 32 keys' 4-bit codes together and faiss
        ORs the next codes added there into it. Visits every list: only a failed append pays that."""
        count = first - self.first_key
        if count < self.base_count:
            raise ValueError(f"key {first} is one of the bundle's, not an appended one")
        invlists = faiss.extract_index_ivf(self.index).invlists
        packer = self.index.get_CodePacker()
        zero = np.zeros(packer.code_size, dtype=np.uint8)
        removed = 0
        for number in range(self.index.nlist):
            size = invlists.list_size(number)
            if not size:
                continue
            ids = faiss.rev_swig_ptr(invlists.get_ids(number), size)
            keep = int(np.count_nonzero(ids < count))
            if keep == size:
                continue
            if np.any(ids[keep:] < count):
                raise ValueError(f"inverted list {number}: appended keys not at its end")
            codes = invlists.get_codes(number)
            for offset in range(keep, min(size, -(-keep // FAST_SCAN_BLOCK) * FAST_SCAN_BLOCK)):
                packer.pack_1_c(faiss.swig_ptr(zero), offset, codes)
            invlists.resize(number, keep)
            removed += size - keep
        self.index.ntotal -= removed
        self.added = min(self.added, count - self.base_count)
        self._hidden = {key for key in self._hidden if key < count}

    def hide(self, key: int) -> None:
        self._hidden.add(int(key) - self.first_key)

    def show(self, key: int) -> None:
        self._hidden.discard(int(key) - self.first_key)

    def vectors(self, ids) -> np.ndarray:
        """The stored (float16) vectors of keys ``ids``, as float32."""
        return self.vectors_of(np.asarray(ids, dtype=np.int64) - self.first_key).astype(np.float32)

    def vectors_of(self, local: np.ndarray) -> np.ndarray:
        """The float16 vectors of local ids (any shape; each must exist)."""
        flat = local.ravel()
        if not self.added:
            return np.asarray(self.base[flat]).reshape(*local.shape, self.dim)
        out = np.empty((len(flat), self.dim), dtype=np.float16)
        in_base = flat < self.base_count
        out[in_base] = self.base[flat[in_base]]
        out[~in_base] = self.appended[flat[~in_base] - self.base_count]
        return out.reshape(*local.shape, self.dim)

    def search(self, vectors: np.ndarray, n: int, breadth: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` nearest keys of each query (global ids, int64; −1 where fewer were found) and
        their distances ``1 − inner product`` (as hnswlib's ip space gives them; +inf for none):
        the best ``max(breadth, n)`` candidates by code in ``nprobe`` cells, re-ranked by their
        stored vectors. Best first by the distances returned, equal ones in key order, as every
        :class:`~engine.index.protocol.KeyIndex` answers (the re-rank selects by the exact
        similarities, of which two may round to one distance).

        One thread unless told otherwise (hnswlib's default is every core): a query's scan takes
        a fraction of a millisecond, and OpenMP's threads spin-wait for each other, which on a
        machine whose cores are busy costs more than the scan (measured: a 3,000-key build 0.4 s
        on one thread, 12 s on two beside a busy process)."""
        queries = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        depth = max(breadth, n) + len(self._hidden)
        with faiss_threads(threads):
            nprobe = min(self.nprobe, self.index.nlist)
            _, candidates = self.index.search(queries, depth, params=faiss.SearchParametersIVF(nprobe=nprobe))
        return by_distance_then_key(*self.rerank(queries, candidates, n))

    def rerank(self, queries: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:func:`exact_rerank` of local ``candidates`` by this index's stored vectors, hidden keys
        left out; global key ids."""
        hidden = np.fromiter(self._hidden, dtype=np.int64) if self._hidden else None
        return exact_rerank(self.vectors_of, queries, candidates, k, self.first_key, hidden)


def exact_rerank(
    stored_of, queries: np.ndarray, candidates: np.ndarray, k: int, first_key: int = 0, hidden: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best of each query's ``candidates`` (local ids, −1: none; ``hidden`` ones left
    out) by the exact inner product with their stored vectors (``stored_of(local ids)``, any
    shape + dim), in :func:`~engine.index.protocol.best_first` order: key ids
    ``first_key + local`` (−1: none) and distances ``1 − inner product`` (+inf: none)."""
    found = candidates >= 0
    if hidden is not None:
        found &= ~np.isin(candidates, hidden)
    local = np.where(found, candidates, 0)
    vectors = np.asarray(stored_of(local), dtype=np.float32)
    sims = np.matmul(vectors, queries[:, :, None])[:, :, 0]  # einsum took 4x as long here
    sims[~found] = -np.inf
    keys = np.where(found, local + first_key, -1)
    # ordered by the exact similarities (1 − sim rounds near-equal ones together)
    order = best_first(keys, -sims, k)
    keys, sims = np.take_along_axis(keys, order, axis=1), np.take_along_axis(sims, order, axis=1)
    if keys.shape[1] < k:  # fewer candidates than asked: padded as a search that finds fewer keys
        pad = k - keys.shape[1]
        keys = np.pad(keys, ((0, 0), (0, pad)), constant_values=-1)
        sims = np.pad(sims, ((0, 0), (0, pad)), constant_values=-np.inf)
    return keys, (1.0 - sims).astype(np.float32)


class faiss_threads:
    """faiss's OpenMP thread count for one call (−1 or 0: every core), restored after it."""

    def __init__(self, count: int):
        self.count = count if count > 0 else (os.cpu_count() or 1)

    def __enter__(self) -> None:
        self.previous = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(self.count)

    def __exit__(self, *exc) -> None:
        faiss.omp_set_num_threads(self.previous)
