"""Reading a memory-mapped ``.npy`` array's values for a check without keeping them resident."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bundle.errors import XmcserveError


class ShortFile(XmcserveError, ValueError):
    """The file holds fewer values than its ``.npy`` header says."""


def file_blocks(mapped: np.memmap, items: int) -> Iterator[np.ndarray]:
    """The values of a memory-mapped ``.npy`` array, ``items`` scalars at a time, read from its file
    (the page cache) rather than through the mapping: pages read through a mapping stay counted in
    the process's resident memory. Raises :class:`ShortFile`."""
    with open(mapped.filename, "rb") as fh:
        fh.seek(mapped.offset)
        left = mapped.size
        while left:
            block = np.fromfile(fh, dtype=mapped.dtype, count=min(items, left))
            if not len(block):
                raise ShortFile(f"{Path(mapped.filename).name}: shorter than its header says")
            left -= len(block)
            yield block
