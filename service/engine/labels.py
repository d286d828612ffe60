"""Label uids and texts without a Python object per label: memory-mapped arrays, and a uid → id
lookup by a sorted hash array.

At 10^7 labels a list of uids, a list of texts and a dict between them cost gigabytes of Python
objects and a minute to build at every start. A bundle written with label arrays
(``labels_format`` arrays) holds instead, as ``.npy`` files the server memory-maps (pages are
read only as answers touch them)::

    label-uids.npy, label-uid-offsets.npy     UTF-8 bytes of every uid back to back, and where
    label-texts.npy, label-text-offsets.npy   each starts (int64, labels + 1 of them); same for texts
    label-uid-hashes.npy                      the 64-bit hash (blake2b) of every uid, sorted
    label-uid-order.npy                       the label id of each sorted hash

A uid is looked up by binary search (``np.searchsorted``) on its hash and accepted only if the
label it points at has that very uid, so a collision or a damaged hash file never gives a wrong
id (at worst a uid is not found). A bundle with ``labels.jsonl`` is read into the same arrays at
load. Labels appended to a live memory (few, by comparison) are kept in Python beside them.
"""

from __future__ import annotations

import codecs
import hashlib
import operator
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from service.engine.manifest import LABEL_ARRAY_FILES
from service.engine.mapped_files import ShortFile, file_blocks

UIDS, UID_OFFSETS, TEXTS, TEXT_OFFSETS, UID_HASHES, UID_ORDER = LABEL_ARRAY_FILES


class LabelsRefused(ValueError):
    """The label arrays are inconsistent; the message says which file and how."""


def uid_hash(uid: str) -> int:
    """A uid's 64-bit hash, the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(uid.encode("utf-8"), digest_size=8).digest(), "little")


class StringColumn(Sequence):
    """Strings stored as UTF-8 bytes and offsets, indexed like a list; append-only beyond them (a
    live memory's new labels), and only those appended may be deleted again (``del col[n:]``)."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets
        self.stored = len(offsets) - 1
        self.extra: list[str] = []

    @classmethod
    def of(cls, strings: Iterable[str]) -> StringColumn:
        encoded = [s.encode("utf-8") for s in strings]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets)

    def __len__(self) -> int:
        return self.stored + len(self.extra)

    def __getitem__(self, item):
        if isinstance(item, slice):
            return [self[i] for i in range(*item.indices(len(self)))]
        i = operator.index(item)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"label {item} of {len(self)}")
        if i >= self.stored:
            return self.extra[i - self.stored]
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None

    def append(self, text: str) -> None:
        self.extra.append(text)

    def __delitem__(self, item) -> None:
        start, stop, step = item.indices(len(self)) if isinstance(item, slice) else (None, None, None)
        if start is None or step != 1 or stop != len(self) or start < self.stored:
            raise TypeError("only appended strings can be removed, from an index to the end")
        del self.extra[start - self.stored :]


class UidLookup:
    """uid → label id, dict-like: the stored labels through their sorted hashes, appended ones in
    a dict. Every answer is checked against the uid stored at that id."""

    def __init__(self, uids: StringColumn, hashes: np.ndarray, order: np.ndarray):
        self.uids, self.hashes, self.order = uids, hashes, order
        self.appended: dict[str, int] = {}

    @classmethod
    def of(cls, uids: StringColumn) -> UidLookup:
        hashes, order = sorted_hashes(uids)
        return cls(uids, hashes, order)

    def get(self, uid: str, default=None):
        if (label := self.appended.get(uid)) is not None:
            return label
        h = np.uint64(uid_hash(uid))
        at = int(np.searchsorted(self.hashes, h))
        while at < len(self.hashes) and self.hashes[at] == h:
            label = int(self.order[at])
            if 0 <= label < self.uids.stored and self.uids[label] == uid:
                return label
            at += 1
        return default

    def __getitem__(self, uid: str) -> int:
        if (label := self.get(uid)) is None:
            raise KeyError(uid)
        return label

    def __contains__(self, uid: str) -> bool:
        return self.get(uid) is not None

    def __setitem__(self, uid: str, label: int) -> None:
        self.appended[uid] = label


def sorted_hashes(uids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    hashes = np.fromiter((uid_hash(uid) for uid in uids), dtype=np.uint64, count=len(uids))
    order = np.argsort(hashes, kind="stable")
    return hashes[order], order.astype(np.int64)


def write_label_arrays(directory: Path, uids: Sequence[str], texts: Sequence[str]) -> None:
    """The label array files of ``uids`` and ``texts`` (label id order) into ``directory``."""
    for (data_name, offsets_name), strings in (((UIDS, UID_OFFSETS), uids), ((TEXTS, TEXT_OFFSETS), texts)):
        column = StringColumn.of(strings)
        np.save(directory / data_name, column.data)
        np.save(directory / offsets_name, column.offsets)
    hashes, order = sorted_hashes(uids)
    np.save(directory / UID_HASHES, hashes)
    np.save(directory / UID_ORDER, order)


def load_label_arrays(directory: Path, labels: int) -> tuple[StringColumn, StringColumn, UidLookup]:
    """The memory-mapped label arrays of a bundle of ``labels`` labels, their structure checked:
    offsets from 0, never decreasing, to the end of the bytes, each at the start of a UTF-8
    character, the bytes valid UTF-8, the order a permutation of the label ids, the hashes sorted."""
    try:
        return _checked_label_arrays(directory, labels)
    except ShortFile as exc:
        raise LabelsRefused(str(exc)) from None


def _checked_label_arrays(directory: Path, labels: int) -> tuple[StringColumn, StringColumn, UidLookup]:

    def array(name: str, dtype, length: int | None) -> np.ndarray:
        try:
            values = np.load(directory / name, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise LabelsRefused(f"{name}: cannot read it ({exc})") from None
        if values.dtype != dtype or values.ndim != 1 or (length is not None and len(values) != length):
            raise LabelsRefused(f"{name}: {values.dtype} {values.shape}, expected {np.dtype(dtype)} of {length}")
        return values

    # Checked through the files (the page cache), not the mappings: a page read through a mapping
    # stays in the server's resident memory, and answers touch only the labels they return.
    columns = []
    for data_name, offsets_name in ((UIDS, UID_OFFSETS), (TEXTS, TEXT_OFFSETS)):
        data, offsets = array(data_name, np.uint8, None), array(offsets_name, np.int64, labels + 1)
        read = np.concatenate(list(file_blocks(offsets, BLOCK)))  # 8 bytes a label, freed after the checks
        if read[0] != 0 or read[-1] != len(data) or np.any(read[1:] < read[:-1]):
            raise LabelsRefused(f"{offsets_name}: not {labels + 1} non-decreasing offsets from 0 to {len(data)}")
        starts = read[:-1][read[1:] > read[:-1]]  # sorted and distinct: the offsets never decrease
        del read
        position, decoder = 0, codecs.getincrementaldecoder("utf-8")()
        try:
            for block in file_blocks(data, BLOCK):
                inside = starts[np.searchsorted(starts, position) : np.searchsorted(starts, position + len(block))]
                if np.any((block[inside - position] & 0xC0) == 0x80):
                    raise LabelsRefused(f"{offsets_name}: an offset falls inside a UTF-8 character")
                decoder.decode(block.tobytes())
                position += len(block)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise LabelsRefused(f"{data_name}: not UTF-8 ({exc.reason})") from None
        columns.append(StringColumn(data, offsets))
    hashes, order = array(UID_HASHES, np.uint64, labels), array(UID_ORDER, np.int64, labels)
    previous = None
    for block in file_blocks(hashes, BLOCK):
        if np.any(block[1:] < block[:-1]) or (previous is not None and len(block) and block[0] < previous):
            raise LabelsRefused(f"{UID_HASHES}: not sorted")
        previous = block[-1] if len(block) else previous
    # a permutation: every id in range and each marked once (np.unique hashed 10^7 ids for 56 s)
    seen, marked = np.zeros(labels, dtype=bool), 0
    for block in file_blocks(order, BLOCK):
        if len(block) and (block.min() < 0 or block.max() >= labels):
            raise LabelsRefused(f"{UID_ORDER}: not a permutation of the label ids")
        seen[block] = True
        if (now := int(np.count_nonzero(seen))) != marked + len(block):
            raise LabelsRefused(f"{UID_ORDER}: not a permutation of the label ids")
        marked = now
    uids, texts = columns
    return uids, texts, UidLookup(uids, hashes, order)


BLOCK = 1 << 22  # values read at a time by the checks
