"""The compressed index's files (``ann`` ivfpq: ``index.faiss``, ``rerank.npy``), checked before
faiss reads them; the index itself, faiss IVF over 4-bit PQ fast-scan codes searched and
appended to, is the serving engine's. No faiss here: the checks read the file's bytes.

Checks before faiss reads a file (:func:`check_index_file`): faiss's reader long trusted every
length and count in the file (releases before 1.15 read a forged ``M2``, ``nbits`` or codebook
length as written), and its scan reads the codes its list sizes say, so a file whose lists are
inconsistent would be read out of bounds. The whole file is parsed here first: every field of the
header (the IVF header, the coarse quantizer, the direct map, the fast-scan fields and the product
quantizer) equal to what faiss writes for the manifest's parameters, every list's ids and codes
sized alike, the ids exactly the shard's keys, the file ending where the lists do; the re-rank
vectors are checked for shape and finiteness (:func:`load_rerank_vectors`).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from bundle.errors import XmcserveError
from bundle.hnsw_file import MAX_KEY_NORM
from bundle.mapped_files import ShortFile, file_blocks

# fast-scan packs codes in blocks of this many keys (faiss's default bbs)
FAST_SCAN_BLOCK = 32
# bits of one PQ code: fast-scan's (x4fs)
PQ_BITS = 4
# the ids and codes of one inverted list, as faiss's BlockInvertedLists writes them: a uint64 count
# then the elements (WRITEVECTOR)
_COUNT = struct.Struct("<Q")
# the inverted lists' header: fourcc "ilbl", nlist, code_size, n_per_block, block_size (size_t);
# block lists record no per-key code size (faiss's InvertedLists::INVALID_CODE_SIZE)
_LISTS_HEADER = struct.Struct("<4sQQQQ")
_NO_CODE_SIZE = 2**64 - 1
# faiss's METRIC_INNER_PRODUCT (MetricType.h), the metric the headers record: a constant of faiss's
# file format, so that these checks run without faiss
METRIC_INNER_PRODUCT = 0


class IndexRefused(XmcserveError, ValueError):
    """The compressed index's file or vectors are inconsistent; the message says how."""


class _HeaderReader:
    """The fields of an index file's header, read in order, each refused unless it is what faiss
    writes for the manifest's parameters."""

    def __init__(self, fh, size: int):
        self.fh, self.size, self.offset = fh, size, 0

    def read(self, name: str, fmt: str):
        field = struct.Struct("<" + fmt)
        if self.offset + field.size > self.size:
            raise IndexRefused(f"the file ends inside its header (at {name})")
        (value,) = field.unpack(self.fh.read(field.size))
        self.offset += field.size
        return value

    def expect(self, name: str, fmt: str, expected, why: str = "") -> None:
        if (value := self.read(name, fmt)) != expected:
            raise IndexRefused(f"header field {name} is {value!r}, expected {expected!r}{why}")

    def skip(self, name: str, count: int) -> None:
        """Pass over ``count`` bytes (float vectors: checked finite after faiss reads them)."""
        if self.offset + count > self.size:
            raise IndexRefused(f"the file ends inside its header (in {name})")
        self.offset += count
        self.fh.seek(self.offset)

    def index_header(self, prefix: str, dim: int, ntotal: int, ntotal_is: str) -> None:
        """faiss's ``write_index_header``: d, ntotal, two unused words, is_trained, the metric."""
        self.expect(f"{prefix}d", "i", dim, " (the manifest's dim)")
        self.expect(f"{prefix}ntotal", "q", ntotal, f" ({ntotal_is})")
        self.skip(f"{prefix}header", 16)  # two words faiss writes as 2^20 and never reads
        self.expect(f"{prefix}is_trained", "B", 1)
        self.expect(f"{prefix}metric_type", "i", METRIC_INNER_PRODUCT, " (inner product)")


def check_header(fh, size: int, dim: int, nlist: int, pq_m: int, keys: int) -> int:
    """An ``IVF<nlist>,PQ<pq_m>x4fs`` index's header, as faiss's ``write_index`` lays it out
    (``IwPf``: the IVF header with the coarse quantizer and the direct map, the fast-scan fields,
    the product quantizer), every field checked against the manifest's parameters; returns where
    the inverted lists start. The faiss reader of releases before 1.15 allocated and indexed by
    these fields unchecked: a forged ``M2``, ``nbits``, codebook length or direct map read or wrote
    out of bounds."""
    header = _HeaderReader(fh, size)
    header.expect("fourcc", "4s", b"IwPf", " (an IVF-PQ fast-scan index)")
    header.index_header("", dim, keys, "the shard's keys")
    header.expect("nlist", "Q", nlist, " (the manifest's nlist)")
    if not 1 <= (nprobe := header.read("nprobe", "Q")) <= nlist:
        raise IndexRefused(f"header field nprobe is {nprobe}, expected 1 to {nlist}")
    header.expect("quantizer fourcc", "4s", b"IxFI", " (a flat inner-product quantizer)")
    header.index_header("quantizer.", dim, nlist, "one centroid a cell")
    header.expect("quantizer.codes", "Q", nlist * dim, f" ({nlist} centroids of {dim} floats)")
    header.skip("quantizer.codes", 4 * nlist * dim)
    header.expect("direct_map.type", "b", 0, " (no direct map)")
    header.expect("direct_map.array", "Q", 0, " (no direct map)")
    header.expect("by_residual", "B", 0, " (codes of the keys themselves: no 'r' in the factory string)")
    header.expect("code_size", "Q", pq_m * PQ_BITS // 8, f" ({pq_m} codes of {PQ_BITS} bits)")
    header.expect("bbs", "i", FAST_SCAN_BLOCK)
    header.expect("M2", "Q", pq_m + pq_m % 2, f" (pq_m {pq_m} rounded up to even)")
    header.expect("implem", "i", 0, " (chosen at search)")
    header.expect("qbs2", "Q", 0, " (chosen at search)")
    header.expect("pq.d", "Q", dim, " (the manifest's dim)")
    header.expect("pq.M", "Q", pq_m, " (the manifest's pq_m)")
    header.expect("pq.nbits", "Q", PQ_BITS, " (4-bit fast-scan codes)")
    codebook = dim * (1 << PQ_BITS)
    header.expect("pq.centroids", "Q", codebook, f" (dim x {1 << PQ_BITS} floats)")
    header.skip("pq.centroids", 4 * codebook)
    return header.offset


def empty_lists_size(nlist: int) -> int:
    """The bytes of ``nlist`` empty inverted lists: their header and two zero counts a list."""
    return _LISTS_HEADER.size + nlist * 2 * _COUNT.size


def check_index_file(file: Path, dim: int, nlist: int, pq_m: int, first_key: int, keys: int) -> None:
    """The written index, header and inverted lists, before faiss reads it (see the module
    docstring). Read through the file, a list at a time, not into memory: at 10^7 keys a copy of
    the file would be a quarter of a gigabyte of the server's peak memory."""
    size = file.stat().st_size
    seen = np.zeros(keys, dtype=bool)
    with open(file, "rb") as fh:
        offset = check_header(fh, size, dim, nlist, pq_m, keys)
        if size < offset + _LISTS_HEADER.size:
            raise IndexRefused(f"{size} bytes, shorter than an IVF{nlist},PQ{pq_m}x4fs index's header")
        tag, lists, code_size, per_block, block_size = _LISTS_HEADER.unpack(fh.read(_LISTS_HEADER.size))
        expected = (b"ilbl", nlist, _NO_CODE_SIZE, FAST_SCAN_BLOCK, FAST_SCAN_BLOCK * pq_m // 2)
        if (tag, lists, code_size, per_block, block_size) != expected:
            raise IndexRefused(
                f"inverted lists {tag!r} of {lists} lists in blocks of {per_block} keys ({block_size} bytes): "
                f"not the fast-scan lists of IVF{nlist},PQ{pq_m}x4fs"
            )
        offset += _LISTS_HEADER.size
        for number in range(nlist):
            if offset + _COUNT.size > size:
                raise IndexRefused(f"the file ends inside list {number}")
            (count,) = _COUNT.unpack(fh.read(_COUNT.size))
            offset += _COUNT.size
            if count > keys or offset + 8 * count + _COUNT.size > size:
                raise IndexRefused(f"list {number} declares {count} ids, beyond the file or the shard's {keys} keys")
            ids = np.frombuffer(fh.read(8 * count), dtype=np.int64)
            offset += 8 * count
            ordered = np.sort(ids)
            if count and (
                ordered[0] < 0 or ordered[-1] >= keys or seen[ids].any() or np.any(ordered[1:] == ordered[:-1])
            ):
                raise IndexRefused(f"list {number}: its ids are not the shard's keys 0..{keys - 1}, once each")
            seen[ids] = True
            (code_bytes,) = _COUNT.unpack(fh.read(_COUNT.size))
            offset += _COUNT.size
            blocks = -(-count // per_block)
            if code_bytes != blocks * block_size or offset + code_bytes > size:
                raise IndexRefused(
                    f"list {number} holds {code_bytes} bytes of codes for {count} keys, not {blocks} blocks"
                )
            offset += code_bytes
            fh.seek(offset)
    if offset != size:
        raise IndexRefused(f"{size - offset} bytes after the last inverted list")
    if not seen.all():
        raise IndexRefused(
            f"its ids are not the shard's keys 0..{keys - 1} (key {first_key} onwards): some are missing"
        )


def load_rerank_vectors(file: Path, dim: int, keys: int) -> np.ndarray:
    """The float16 vectors of the shard's keys, memory-mapped (pages are read as queries touch
    them, and shared between processes serving one bundle), refused unless (keys x dim), finite and
    no longer than unit vectors (:data:`~bundle.hnsw_file.MAX_KEY_NORM`)."""
    try:
        vectors = np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise IndexRefused(f"cannot read the re-rank vectors ({exc})") from None
    if vectors.dtype != np.float16 or vectors.shape != (keys, dim):
        raise IndexRefused(f"re-rank vectors {vectors.dtype} {vectors.shape}, expected float16 {(keys, dim)}")
    if not vectors.flags.c_contiguous and vectors.size:
        # the blocks below are read in file order, whole rows each only when stored row by row
        raise IndexRefused("re-rank vectors stored column by column (fortran_order), not row by row")
    # read through the file in blocks, not through the mapping: pages read by the mapping would
    # stay in the server's resident memory, all of them, where queries touch only some
    try:
        for block in file_blocks(vectors, max(1, (1 << 24) // dim) * dim):  # whole vectors a block
            if not np.all(np.isfinite(block)):
                raise IndexRefused("a re-rank vector is not finite")
            with np.errstate(over="ignore"):  # a norm that overflows is inf, refused as too long
                longest = float(np.linalg.norm(block.reshape(-1, dim).astype(np.float32), axis=1).max(initial=0.0))
            if longest > MAX_KEY_NORM:
                raise IndexRefused(f"a re-rank vector's norm is {longest:.4g}: the keys are the encoder's unit vectors")
    except ShortFile as exc:
        raise IndexRefused(str(exc)) from None
    return vectors
