"""Label uids and texts without a Python object per label: memory-mapped arrays, and a uid → id
lookup by a sorted hash array.

At 10^7 labels a list of uids, a list of texts and a dict between them cost gigabytes of Python
objects and a minute to build at every start. A bundle written with label arrays
(``labels_format`` arrays) holds instead, as ``.npy`` files the server memory-maps (pages are
read only as answers touch them)::

    label-uids.npy, label-uid-offsets.npy     UTF-8 bytes of every uid back to back, and where
    label-texts.npy, label-text-offsets.npy   each starts (int64, labels + 1 of them); same for texts
    label-uid-hashes.npy                      the 64-bit hash of every uid, sorted
    label-uid-order.npy                       the label id of each sorted hash

A uid is looked up by binary search (``np.searchsorted``) on its hash and accepted only if the
label it points at has that very uid, so a collision never gives a wrong id. The hash file is
verified against the uids at load (:func:`verify_uid_hashes`): a damaged one would not give a
wrong id either, but it would not find a uid at all, and then an ``exclude`` of it would do
nothing and an append of it would give one uid two labels. The hash is the uids'
:class:`ContentHashes` (numpy over the bytes, which the load computes anyway for the duplicate
check, so the verification costs one gather); bundles written before it hold blake2b hashes
(:func:`uid_hash`), recomputed one uid at a time at load (about 1 µs a label), and looked up
by that hash. A bundle with ``labels.jsonl`` is read into the same arrays at load. Labels
appended to a live memory (few, by comparison) are kept in Python beside them.

Uids are unique: a uid names one label, and excluding it must remove every label it names. A
label set with a uid twice is refused where it is written and where it is loaded
(:func:`duplicate_uids`), by a hash of each uid's bytes computed here with numpy, sorted, equal
neighbours compared byte for byte: the stored hash file is not trusted for it (a damaged one
would hide a duplicate), and a Python set of 10^7 uids would cost gigabytes.
"""

from __future__ import annotations

import codecs
import json
import operator
from collections.abc import Iterable, Iterator, Sequence
from contextlib import nullcontext
from hashlib import blake2b
from pathlib import Path

import numpy as np

from bundle.errors import BundleError, XmcserveError
from bundle.manifest import LABEL_ARRAY_FILES, LABELS_FILE, Manifest
from bundle.mapped_files import ShortFile, file_blocks

UIDS, UID_OFFSETS, TEXTS, TEXT_OFFSETS, UID_HASHES, UID_ORDER = LABEL_ARRAY_FILES


class LabelsRefused(XmcserveError, ValueError):
    """The label arrays are inconsistent; the message says which file and how."""


class DuplicateUids(XmcserveError, ValueError):
    """Labels share a uid; the message names the first such uid and both of its rows (label ids)."""


def uid_hash(uid: str) -> int:
    """A uid's 64-bit blake2b hash: the lookup hash of label arrays written before
    :func:`content_hash` (the same in every process, unlike ``hash``)."""
    return _blake2b(uid.encode("utf-8"))


def _blake2b(data) -> int:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


def content_hash(uid: str) -> int:
    """A uid's 64-bit :class:`ContentHashes` hash, the one the label arrays' lookup is written
    with: equal to the hash of the same bytes wherever they stand in a column. One string at
    offset 0 is Σ b_j·R^j, mixed with its length: computed here directly (a lookup's cost, a few
    µs; the column's machinery is 100x that for one string)."""
    encoded = uid.encode("utf-8")
    if len(encoded) <= len(_R_POWERS_SHORT):  # most uids: Python integers beat numpy's call overheads
        total = sum(b * r for b, r in zip(encoded, _R_POWERS_SHORT, strict=False)) % _WORD
        return _mix_int(total ^ _mix_int(len(encoded)))
    data = np.frombuffer(encoded, dtype=np.uint8)
    if len(data) > HASH_PIECE:
        hasher = ContentHashes(np.array([0, len(data)], dtype=np.int64))
        hasher.add(data)
        return int(hasher.hashes()[0])
    total = int((data.astype(np.uint64) * _R_POWERS[: len(data)]).sum(dtype=np.uint64))
    return _mix_int(total ^ _mix_int(len(data)))


def _mix_int(z: int) -> int:
    """:func:`_mix` of one value, in Python integers."""
    z = (z + 0x9E3779B97F4A7C15) % _WORD
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % _WORD
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % _WORD
    return z ^ (z >> 31)


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
    """uid → label id, dict-like: the stored labels through their sorted hashes (of ``hash_of``,
    :func:`content_hash` unless given), appended ones in a dict. Every answer is checked against
    the uid stored at that id."""

    def __init__(self, uids: StringColumn, hashes: np.ndarray, order: np.ndarray, hash_of=None):
        self.uids, self.hashes, self.order = uids, hashes, order
        self.hash_of = hash_of or content_hash
        self.appended: dict[str, int] = {}

    @classmethod
    def of(cls, uids: StringColumn) -> UidLookup:
        hashes, order = sorted_hashes(uids)
        return cls(uids, hashes, order)

    def get(self, uid: str, default=None):
        if (label := self.appended.get(uid)) is not None:
            return label
        h = np.uint64(self.hash_of(uid))
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
    """The uids' :class:`ContentHashes`, sorted, and the label id of each."""
    hashes = column_hashes(uids if isinstance(uids, StringColumn) and not uids.extra else StringColumn.of(uids))
    order = np.argsort(hashes, kind="stable")
    return hashes[order], order.astype(np.int64)


def column_hashes(column: StringColumn) -> np.ndarray:
    """The :class:`ContentHashes` of a column's stored strings, in row order."""
    hashes = ContentHashes(np.asarray(column.offsets))
    for start in range(0, len(column.data), BLOCK):
        hashes.add(column.data[start : start + BLOCK])
    return hashes.hashes()


def blake2b_hashes(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The :func:`uid_hash` of each string of a column (``offsets`` in memory), its bytes read
    from the file a block of strings at a time: one Python object a string while it is hashed,
    none kept."""
    out = np.empty(len(offsets) - 1, dtype=np.uint64)
    with open(data.filename, "rb") if isinstance(data, np.memmap) else nullcontext() as fh:
        for first in range(0, len(out), LABELS_A_BLOCK):
            last = min(first + LABELS_A_BLOCK, len(out))
            start, ends = int(offsets[first]), offsets[first + 1 : last + 1] - offsets[first]
            if fh is None:
                chunk = data[start : int(offsets[last])].tobytes()
            else:
                fh.seek(data.offset + start)
                chunk = fh.read(int(offsets[last]) - start)
            view, bounds = memoryview(chunk), [0, *ends.tolist()]
            digests = b"".join(
                blake2b(view[begin:end], digest_size=8).digest()
                for begin, end in zip(bounds[:-1], bounds[1:], strict=True)
            )
            out[first:last] = np.frombuffer(digests, dtype="<u8")  # uid_hash's little-endian integers
    return out


LABELS_A_BLOCK = 1 << 16  # strings hashed from one read of their bytes


def verify_uid_hashes(hashes: np.ndarray, order: np.ndarray, expected: np.ndarray) -> bool:
    """Whether the sorted hash file ``hashes`` holds, at each position, ``expected[order]`` (the
    hash of the uid of the label it points at): read through the files a block at a time."""
    for stored, labels in zip(file_blocks(hashes, BLOCK), file_blocks(order, BLOCK), strict=True):
        if not np.array_equal(stored, expected[labels]):
            return False
    return True


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise over uint64 (wrapping arithmetic): well-spread bits."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _powers(base: int, count: int) -> np.ndarray:
    """``base**j mod 2**64`` for j in 0 .. count − 1."""
    out = np.full(count, base % 2**64, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out, out=out)  # uint64 products wrap modulo 2^64, as meant


_WORD = 2**64
_K = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2^64
_R = pow(_K, -1, _WORD)
HASH_PIECE = 1 << 18  # bytes hashed at a time: the temporaries stay in the cache
_R_POWERS = _powers(_R, HASH_PIECE)
_K_LOW = _powers(_K, 1 << 16)
_R_POWERS_SHORT = _R_POWERS[:256].tolist()


class ContentHashes:
    """A 64-bit hash of each string of a column, from its ``offsets`` (in memory) and its bytes fed
    in order, in blocks of any size (:meth:`add`), with numpy only (no label's uid becomes a
    Python object) in O(bytes).

    A polynomial hash, Σ b_j·R^j over the string's bytes (modulo 2^64, R = K⁻¹ for an odd K), from
    the running sums Q(i) = Σ_{j<i} b_j·R^j over the whole column, recorded at every offset as
    the bytes stream by: the string [s, e) is (Q(e) − Q(s))·K^s. Mixed with the length at the end
    (a zero byte adds nothing to the sum). Equal strings hash alike wherever they stand; unequal
    ones may collide (Thue–Morse strings do, for any K): callers compare the bytes of equal hashes."""

    def __init__(self, offsets: np.ndarray):
        self.offsets = offsets
        self.at_offsets = np.zeros(len(offsets), dtype=np.uint64)  # Q at each offset
        self.position, self.carry, self.scale = 0, 0, 1  # bytes seen, Q(position), R^position

    def add(self, block: np.ndarray) -> None:
        for start in range(0, len(block), HASH_PIECE):
            self._add(block[start : start + HASH_PIECE])

    def _add(self, piece: np.ndarray) -> None:
        position, end = self.position, self.position + len(piece)
        prefix = piece.astype(np.uint64)
        prefix *= _R_POWERS[: len(piece)]
        prefix *= np.uint64(self.scale)
        np.cumsum(prefix, out=prefix)
        # the offsets in (position, end]: Q there is Q(position) + the piece's sum up to it
        low = int(np.searchsorted(self.offsets, position, side="right"))
        high = int(np.searchsorted(self.offsets, end, side="right"))
        self.at_offsets[low:high] = prefix[self.offsets[low:high] - position - 1] + np.uint64(self.carry)
        self.carry = (self.carry + int(prefix[-1])) % _WORD
        self.scale = self.scale * pow(_R, len(piece), _WORD) % _WORD
        self.position = end

    def hashes(self) -> np.ndarray:
        strings = len(self.offsets) - 1
        k_high = _powers(pow(_K, 1 << 16, _WORD), (self.position >> 16) + 1)  # K^(65536·m)
        out = np.empty(strings, dtype=np.uint64)
        for first in range(0, strings, BLOCK):
            last = min(first + BLOCK, strings)
            starts = self.offsets[first:last]
            sums = self.at_offsets[first + 1 : last + 1] - self.at_offsets[first:last]
            sums *= _K_LOW[starts & 0xFFFF]
            sums *= k_high[starts >> 16]
            out[first:last] = _mix(sums ^ _mix(np.diff(self.offsets[first : last + 1]).astype(np.uint64)))
        return out


def duplicate_uids(uids: StringColumn, hashes: np.ndarray) -> list[tuple[int, int]]:
    """``(first row, later row)`` of every label whose uid an earlier label has, in row order, by
    the uids' :class:`ContentHashes`: sorted, and the rows of a repeated hash compared by their
    bytes (a collision costs a comparison, never a false refusal). A sort, not an argsort: half
    the memory and time, and the rows are found again only for the few repeated hashes."""
    ordered = np.sort(hashes)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    del ordered
    if not len(repeated):
        return []
    first_row: dict[bytes, int] = {}
    duplicates = []
    for row in np.flatnonzero(np.isin(hashes, repeated)).tolist():
        uid = uids.data[uids.offsets[row] : uids.offsets[row + 1]].tobytes()
        if uid in first_row:
            duplicates.append((first_row[uid], row))
        else:
            first_row[uid] = row
    return duplicates


def duplicates_message(uids: StringColumn, duplicates: list[tuple[int, int]]) -> str:
    """``label uid 'x' at rows 3 and 17`` for the first duplicate, and how many more there are."""
    first, later = duplicates[0]
    others = len(duplicates) - 1
    more = f" ({others} more label{'s' if others > 1 else ''} with an earlier label's uid)" if others else ""
    return f"label uid {uids[later]!r} at rows {first} and {later}{more}; a uid must name one label"


def check_unique_uids(uids: Sequence[str]) -> None:
    """Refuse (:class:`DuplicateUids`) a label set in which two labels share a uid: the bundle
    would map the uid to one of them only, and an exclusion of it would leave the other."""
    column = uids if isinstance(uids, StringColumn) and not uids.extra else StringColumn.of(uids)
    if duplicates := duplicate_uids(column, column_hashes(column)):
        raise DuplicateUids(duplicates_message(column, duplicates))


def write_label_arrays(directory: Path, uids: Sequence[str], texts: Sequence[str]) -> None:
    """The label array files of ``uids`` and ``texts`` (label id order) into ``directory``."""
    for (data_name, offsets_name), strings in (((UIDS, UID_OFFSETS), uids), ((TEXTS, TEXT_OFFSETS), texts)):
        column = StringColumn.of(strings)
        np.save(directory / data_name, column.data)
        np.save(directory / offsets_name, column.offsets)
    hashes, order = sorted_hashes(StringColumn.of(uids))
    np.save(directory / UID_HASHES, hashes)
    np.save(directory / UID_ORDER, order)


def load_label_arrays(directory: Path, labels: int) -> tuple[StringColumn, StringColumn, UidLookup]:
    """The memory-mapped label arrays of a bundle of ``labels`` labels, their structure checked:
    offsets from 0, never decreasing, to the end of the bytes, each at the start of a UTF-8
    character, the bytes valid UTF-8, the order a permutation of the label ids, the hashes sorted
    and those of the uids (:func:`verify_uid_hashes`), no uid twice."""
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
    columns, uid_hashes = [], None
    for data_name, offsets_name in ((UIDS, UID_OFFSETS), (TEXTS, TEXT_OFFSETS)):
        data, offsets = array(data_name, np.uint8, None), array(offsets_name, np.int64, labels + 1)
        read = np.concatenate(list(file_blocks(offsets, BLOCK)))  # 8 bytes a label, freed after the checks
        if read[0] != 0 or read[-1] != len(data) or np.any(read[1:] < read[:-1]):
            raise LabelsRefused(f"{offsets_name}: not {labels + 1} non-decreasing offsets from 0 to {len(data)}")
        starts = read[:-1][read[1:] > read[:-1]]  # sorted and distinct: the offsets never decrease
        position, decoder = 0, codecs.getincrementaldecoder("utf-8")()
        hasher = ContentHashes(read) if data_name == UIDS else None  # the uids hashed as they are read
        try:
            for block in file_blocks(data, BLOCK):
                inside = starts[np.searchsorted(starts, position) : np.searchsorted(starts, position + len(block))]
                if np.any((block[inside - position] & 0xC0) == 0x80):
                    raise LabelsRefused(f"{offsets_name}: an offset falls inside a UTF-8 character")
                decoder.decode(block.tobytes())
                position += len(block)
                if hasher is not None:
                    hasher.add(block)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise LabelsRefused(f"{data_name}: not UTF-8 ({exc.reason})") from None
        columns.append(StringColumn(data, offsets))
        if hasher is not None:
            uid_hashes = hasher.hashes()
        del read, hasher
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
    if duplicates := duplicate_uids(uids, uid_hashes):
        raise LabelsRefused(f"{UIDS}: {duplicates_message(uids, duplicates)}")
    if verify_uid_hashes(hashes, order, uid_hashes):
        return uids, texts, UidLookup(uids, hashes, order)
    del uid_hashes
    # written before the lookup hashed by content: blake2b hashes, or a damaged file
    uid_offsets = np.concatenate(list(file_blocks(uids.offsets, BLOCK)))  # read again: the fast path keeps none
    if verify_uid_hashes(hashes, order, blake2b_hashes(uids.data, uid_offsets)):
        return uids, texts, UidLookup(uids, hashes, order, uid_hash)
    raise LabelsRefused(f"{UID_HASHES}: not the hashes of the uids in {UIDS} (a uid would not be found)")


BLOCK = 1 << 22  # values read at a time by the checks


def read_labels(path: Path, manifest: Manifest) -> tuple[StringColumn, StringColumn, UidLookup]:
    """Label uids and texts, as many as the manifest counts, and the uid → id lookup: the
    bundle's memory-mapped label arrays, checked (:func:`load_label_arrays`), or ``labels.jsonl``
    read into the same arrays."""
    if manifest.labels_format == "arrays":
        try:
            return load_label_arrays(path, manifest.counts.labels)
        except LabelsRefused as exc:
            raise BundleError(f"{path}: label arrays refused: {exc}") from None
    uids, texts = [], []
    with open(path / LABELS_FILE, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            try:
                obj = json.loads(line)
                uids.append(str(obj["uid"]))
                texts.append(str(obj["text"]))
            except (ValueError, KeyError) as exc:
                raise BundleError(f"{path / LABELS_FILE}:{lineno}: bad label line ({exc})") from None
    if len(uids) != manifest.counts.labels:
        raise BundleError(f"{path}: {len(uids)} labels in {LABELS_FILE}, manifest says {manifest.counts.labels}")
    uid_column = StringColumn.of(uids)
    try:
        check_unique_uids(uid_column)
    except DuplicateUids as exc:
        raise BundleError(f"{path / LABELS_FILE}: {exc}") from None
    return uid_column, StringColumn.of(texts), UidLookup.of(uid_column)
