"""hnswlib's binary index format, checked before hnswlib reads a file: the header against what the
manifest says (so hnswlib never allocates what a forged header asks for), and every element's
links, labels and vectors (hnswlib follows links unchecked, so an out-of-range id is an
out-of-bounds read in native code). Format only, and no hnswlib: what a bundle is lives in
:mod:`bundle.manifest`; the engine's loader (``engine.bundle``) turns a refusal here into a
:class:`~bundle.BundleError`.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from bundle.errors import XmcserveError


class HnswFileRefused(XmcserveError, ValueError):
    """An HNSW file that does not follow hnswlib's format or the manifest; the message names the file."""


# hnswlib's saveIndex header (hnswalg.h): offsetLevel0, max_elements, cur_element_count,
# size_data_per_element, label_offset, offsetData (size_t), maxlevel (int), enterpoint (uint32),
# maxM, maxM0, M (size_t), mult (double), ef_construction (size_t).
HNSW_HEADER = struct.Struct("<QQQQQQiIQQQdQ")
# The most build breadth a file may record (hnswlib searches this wide on every append; exports
# use 200)
MAX_EF_CONSTRUCTION = 1 << 16
# Room an index file may declare beyond its keys (hnswlib allocates max_elements up front).
HNSW_GROWTH_ALLOWANCE = 2


def check_index_header(file: Path, dim: int, expected_m: int, keys: int) -> None:
    """The HNSW file's header against the manifest (``dim``-d float32 vectors, graph degree
    ``expected_m``, ``keys`` elements), before hnswlib allocates what the header asks for: a file
    whose checksums match but whose header claims 2^27 elements would make hnswlib allocate
    gigabytes inside the serving process."""
    size = file.stat().st_size if file.is_file() else 0
    if size < HNSW_HEADER.size:
        raise HnswFileRefused(f"{file}: {size} bytes, shorter than an HNSW header")
    with file.open("rb") as f:
        header = HNSW_HEADER.unpack(f.read(HNSW_HEADER.size))
    level0, max_elements, count, per_element, label_offset, data_offset, max_level, entry = header[:8]
    max_m, max_m0, m, mult, ef_construction = header[8:]
    links = max_m0 * 4 + 4  # level-0 neighbour ids (uint32) and their count
    problems = [
        # hnswlib writes 0 and reads every element at this offset (a spike: a segfault at load)
        (level0 != 0, f"level-0 data at offset {level0}, not 0"),
        ((m, max_m, max_m0) != (expected_m, expected_m, 2 * expected_m), f"M {m}/{max_m}/{max_m0}, not {expected_m}"),
        # the multiplier follows from M: named after it, so a wrong M is reported as that
        (not (m > 1 and math.isclose(mult, 1 / math.log(m), rel_tol=1e-9)), f"level multiplier {mult}, not 1/ln(M)"),
        (not 0 < ef_construction <= MAX_EF_CONSTRUCTION, f"ef_construction {ef_construction}"),
        (count != keys, f"holds {count} keys, manifest says {keys}"),
        (max_elements > HNSW_GROWTH_ALLOWANCE * keys, f"declares room for {max_elements} elements for {keys} keys"),
        (data_offset != links or label_offset != links + 4 * dim, f"element layout is not {dim}-d float32"),
        (per_element != links + 4 * dim + 8, f"{per_element} bytes per element, expected {links + 4 * dim + 8}"),
        (max_level < 0 or (count and entry >= count), "entry point or top level out of range"),
        (size < HNSW_HEADER.size + count * (per_element + 4), f"{size} bytes, too short for {count} elements"),
    ]
    for failed, problem in problems:
        if failed:
            raise HnswFileRefused(f"{file}: HNSW header refused: {problem}")


# The keys are the encoder's unit vectors (the loader checks that it encodes unit vectors): a
# longer one would outweigh every other key's similarity, and a long enough one overflows the
# similarity, and the softmax over it, to a non-finite score. The slack covers float16 re-rank
# vectors (bundle.ivfpq_file) and rounding.
MAX_KEY_NORM = 1.01
LINK_COUNT_MASK = 0xFFFF  # hnswlib keeps a list's length in the low 16 bits of its first uint32


def check_index_body(file: Path, first_key: int, keys: int) -> None:
    """The HNSW file's elements, before hnswlib reads them (its header checked already): every
    neighbour id names an element, a neighbour at level l lives on level l, the entry point is on
    the top level, the labels are exactly the key ids ``first_key`` .. ``first_key + keys - 1`` and
    the vectors are finite and no longer than a unit vector. hnswlib
    checks none of these; a search follows the links unchecked."""
    data = np.fromfile(file, dtype=np.uint8)
    (_, _, count, per_element, label_offset, data_offset, max_level, entry, max_m, max_m0, _, _, _) = (
        HNSW_HEADER.unpack(data[: HNSW_HEADER.size].tobytes())
    )
    elements = data[HNSW_HEADER.size : HNSW_HEADER.size + count * per_element].reshape(count, per_element)

    def refuse(problem: str) -> None:
        raise HnswFileRefused(f"{file}: HNSW body refused: {problem}")

    def column(start: int, stop: int, dtype) -> np.ndarray:
        return np.ascontiguousarray(elements[:, start:stop]).view(dtype)

    counts = column(0, 4, np.uint32)[:, 0] & LINK_COUNT_MASK
    if np.any(counts > max_m0):
        refuse(f"element {int(np.argmax(counts > max_m0))} lists {int(counts.max())} level-0 links, at most {max_m0}")
    links = column(4, 4 + 4 * max_m0, np.uint32)
    used = np.arange(max_m0) < counts[:, None]
    if np.any(links[used] >= count):
        refuse(f"a level-0 link names element {int(links[used].max())} of {count}")
    labels = np.sort(column(label_offset, label_offset + 8, np.uint64)[:, 0])
    if not np.array_equal(labels, first_key + np.arange(keys, dtype=np.uint64)):
        refuse(f"its labels are not the key ids {first_key}..{first_key + keys - 1}")
    vectors = column(data_offset, label_offset, np.float32)
    if not np.all(np.isfinite(vectors)):
        refuse("a vector is not finite")
    with np.errstate(over="ignore"):  # a norm that overflows is inf, refused as too long
        longest = float(np.linalg.norm(vectors, axis=1).max(initial=0.0))
    if longest > MAX_KEY_NORM:
        refuse(f"a vector's norm is {longest:.4g}: the keys are the encoder's unit vectors")
    levels = check_upper_levels(data, HNSW_HEADER.size + count * per_element, count, max_m, refuse)
    if count and (levels.max(initial=0) > max_level or levels[entry] != max_level):
        refuse(f"the entry point is on level {levels[entry]}, the top level is {max_level}")


def check_upper_levels(data: np.ndarray, offset: int, count: int, max_m: int, refuse) -> np.ndarray:
    """The level of every element, its upper link lists checked: each at most ``max_m`` long,
    every id an element that lives on the list's level."""
    list_bytes = 4 * (max_m + 1)
    size_at = struct.Struct("<I").unpack_from
    buffer = data.data
    levels = np.zeros(count, dtype=np.int64)
    owners, blocks = [], []
    for element in range(count):  # sizes are read in sequence: each says where the next one is
        if offset + 4 > len(data):
            refuse(f"the file ends inside the link lists (element {element})")
        size = size_at(buffer, offset)[0]
        offset += 4
        if size:
            if size % list_bytes or offset + size > len(data):
                refuse(f"element {element}'s upper link lists are {size} bytes, not whole lists inside the file")
            levels[element] = size // list_bytes
            owners.append(element)
            blocks.append(data[offset : offset + size])
            offset += size
    if offset != len(data):
        refuse(f"{len(data) - offset} bytes after the last element's link lists")
    if not owners:
        return levels
    rows = np.concatenate(blocks).view(np.uint32).reshape(-1, max_m + 1)
    per_owner = levels[owners]
    owner = np.repeat(owners, per_owner)
    level = np.arange(len(rows)) - np.repeat(np.cumsum(per_owner) - per_owner, per_owner) + 1
    lengths = rows[:, 0] & LINK_COUNT_MASK
    if np.any(lengths > max_m):
        bad = int(np.argmax(lengths > max_m))
        refuse(f"element {owner[bad]} lists {lengths[bad]} links on level {level[bad]}, at most {max_m}")
    used = np.arange(max_m) < lengths[:, None]
    ids = rows[:, 1:][used].astype(np.int64)
    link_owner, link_level = (np.broadcast_to(a[:, None], used.shape)[used] for a in (owner, level))
    outside = ids >= count
    if np.any(outside):
        bad = int(np.argmax(outside))
        refuse(f"a level-{link_level[bad]} link of element {link_owner[bad]} names element {ids[bad]} of {count}")
    below = levels[ids] < link_level
    if np.any(below):
        bad = int(np.argmax(below))
        refuse(f"a level-{link_level[bad]} link of element {link_owner[bad]} names an element below that level")
    return levels
