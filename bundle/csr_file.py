"""A CSR matrix file (``scipy.sparse.save_npz``): a bundle's value rows and a lexical fusion's key
term vectors. Every array a search indexes by is checked before it is used: scipy checks none of
it when it loads a file, and its C++ products index by these arrays, so an out-of-range index is
an out-of-bounds read in native code, a crash or a silent wrong answer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bundle.errors import BundleError


def load_csr(file: Path, shape: tuple[int, int], what: str) -> sp.csr_matrix:
    """A CSR matrix written by ``scipy.sparse.save_npz``, as float32, refused unless it is one of
    ``shape`` whose structure holds: ``indptr`` starts at 0, never decreases and ends at the
    number of entries, every column index is inside the matrix, every value is finite. scipy
    checks none of this when it loads a file, and its C++ products index by these arrays."""

    def refuse(problem: str) -> None:
        raise BundleError(f"{file}: {what} refused: {problem}")

    try:
        with np.load(file, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in ("format", "shape", "indptr", "indices", "data")}
    except KeyError as exc:
        raise BundleError(f"{file}: {what} refused: not a scipy sparse file (no {exc})") from None
    except (OSError, ValueError) as exc:
        raise BundleError(f"{file}: cannot load {what} ({exc})") from None
    fmt, declared, indptr, indices, data = arrays.values()
    rows, cols = shape
    if fmt.item() not in (b"csr", "csr"):
        refuse(f"stored as {fmt.item()!r}, not csr")
    if tuple(int(n) for n in declared.ravel()) != shape:
        refuse(f"shape {tuple(declared.ravel().tolist())}, expected {shape}")
    for name, array in (("indptr", indptr), ("indices", indices)):
        if array.ndim != 1 or array.dtype.kind not in "iu":
            refuse(f"{name} is not a 1-d integer array")
    if data.ndim != 1 or data.dtype.kind not in "fiu" or len(data) != len(indices):
        refuse(f"data is not {len(indices)} real numbers, one per column index")
    if len(indptr) != rows + 1 or indptr[0] != 0 or indptr[-1] != len(indices) or np.any(np.diff(indptr) < 0):
        refuse(f"indptr is not {rows + 1} non-decreasing offsets from 0 to {len(indices)}")
    if len(indices) and (indices.min() < 0 or indices.max() >= cols):
        refuse(f"column index {int(indices.max() if indices.max() >= cols else indices.min())} outside 0..{cols - 1}")
    if not np.all(np.isfinite(data)):
        refuse("a value is not finite")
    return sp.csr_matrix((data.astype(np.float32), indices, indptr), shape=shape)
