"""A CSR matrix file (``scipy.sparse.save_npz``): a bundle's value rows and a lexical fusion's key
term vectors. Every array a search indexes by is checked before it is used: scipy checks none of
it when it loads a file, and its C++ products index by these arrays, so an out-of-range index is
an out-of-bounds read in native code, a crash or a silent wrong answer.

The checks are made on the values the service computes with, not on the stored ones: offsets and
column indices as signed 64-bit integers (an unsigned ``indptr`` whose difference wraps would pass
a "never decreases" test on its own dtype, and scipy reads it as a signed index), values once cast
to float32 (a float64 1e39 is finite as stored and ``inf`` as served). Every member's ``.npy``
header is read before its data, so a compressed member that declares more values than the
matrix can hold is refused without being inflated."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bundle.errors import BundleError

CSR_MEMBERS = ("format", "shape", "indptr", "indices", "data")
_INT64_MAX = np.iinfo(np.int64).max
_INT32_MAX = np.iinfo(np.int32).max


def npz_headers(file: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each ``.npy`` member of an ``.npz`` file: its shape and dtype, read from its header alone
    (nothing is inflated beyond the header). Raises ``OSError``/``ValueError`` (``zipfile``'s
    ``BadZipFile`` is one) for a file that is not an npz."""
    headers = {}
    with zipfile.ZipFile(file) as archive:
        for name in archive.namelist():
            if not name.endswith(".npy"):
                continue
            with archive.open(name) as member:
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read_header(member)
            headers[name.removesuffix(".npy")] = (tuple(shape), dtype)
    return headers


def load_csr(
    file: Path, shape: tuple[int, int], what: str, value_range: tuple[float, float] | None = None
) -> sp.csr_matrix:
    """A CSR matrix written by ``scipy.sparse.save_npz``, as float32, refused unless it is one of
    ``shape`` whose structure holds: ``indptr`` (as signed 64-bit offsets) starts at 0, never
    decreases and ends at the number of entries, every column index is inside the matrix, every
    value is finite as float32 (and inside ``value_range``, when given). scipy checks none of this
    when it loads a file, and its C++ products index by these arrays."""

    def refuse(problem: str) -> None:
        raise BundleError(f"{file}: {what} refused: {problem}")

    rows, cols = shape
    try:
        headers = npz_headers(file)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise BundleError(f"{file}: cannot load {what} ({exc})") from None
    if missing := [name for name in CSR_MEMBERS if name not in headers]:
        refuse(f"not a scipy sparse file (no {missing[0]!r})")
    # sizes from the headers, before anything is inflated: a member declaring more than the
    # matrix can hold is refused here, not allocated
    limits = {"format": 16, "shape": 2, "indptr": rows + 1, "indices": rows * cols, "data": rows * cols}
    for name, limit in limits.items():
        member_shape, dtype = headers[name]
        if dtype.hasobject or int(np.prod(member_shape, dtype=np.int64)) > limit:
            refuse(f"{name} is {dtype} {member_shape}, more than a {rows} x {cols} CSR matrix holds")
    for name in ("indptr", "indices"):
        member_shape, dtype = headers[name]
        if len(member_shape) != 1 or dtype.kind not in "iu":
            refuse(f"{name} is not a 1-d integer array")
    if len(headers["data"][0]) != 1 or headers["data"][1].kind not in "fiu":
        refuse("data is not a 1-d array of real numbers")
    try:
        with np.load(file, allow_pickle=False) as npz:
            fmt, declared = npz["format"], npz["shape"]
            if fmt.size != 1 or fmt.item() not in (b"csr", "csr"):
                refuse(f"stored as {fmt.ravel().tolist()!r}, not csr")
            if declared.dtype.kind not in "iu" or tuple(int(n) for n in declared.ravel()) != shape:
                refuse(f"shape {tuple(declared.ravel().tolist())}, expected {shape}")
            # the offsets first: the entries they end at bound what is inflated next
            indptr, nnz = npz["indptr"], headers["indices"][0][0]
            if len(indptr) != rows + 1 or indptr[0] != 0 or int(indptr[-1]) != nnz:
                refuse(f"indptr is not {rows + 1} offsets from 0 to {nnz}")
            # one value per column index, from the headers: a data member declaring more is not inflated
            if headers["data"][0] != (nnz,):
                refuse(f"data is not {nnz} real numbers, one per column index")
            indices, data = npz["indices"], npz["data"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise BundleError(f"{file}: cannot load {what} ({exc})") from None
    if len(data) != len(indices):
        refuse(f"data is not {len(indices)} real numbers, one per column index")
    # as signed offsets: an unsigned indptr's np.diff wraps and never looks negative
    if indptr.dtype == np.uint64 and indptr.max(initial=0) > _INT64_MAX:
        refuse(f"an indptr offset is beyond {_INT64_MAX}")
    offsets = indptr.astype(np.int64)
    if np.any(offsets[1:] < offsets[:-1]):
        refuse(f"indptr is not {rows + 1} non-decreasing offsets from 0 to {len(indices)}")
    if len(indices):
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= cols:
            refuse(f"column index {high if high >= cols else low} outside 0..{cols - 1}")
    with np.errstate(over="ignore"):  # an overflow to inf is refused just below
        values = data.astype(np.float32)
    if not np.all(np.isfinite(values)):
        refuse("a value is not finite as float32")
    if value_range is not None and len(values) and (values.min() < value_range[0] or values.max() > value_range[1]):
        refuse(f"a value is outside {value_range[0]}..{value_range[1]}")
    index_dtype = np.int32 if max(len(indices), cols, rows) <= _INT32_MAX else np.int64
    return sp.csr_matrix((values, indices.astype(index_dtype), offsets.astype(index_dtype)), shape=shape)
