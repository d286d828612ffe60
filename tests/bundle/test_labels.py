"""Label arrays (bundle.labels): uids and texts as memory-mapped bytes and offsets, uid → id
by sorted hashes, every answer checked against the stored uid; damaged arrays, and a uid named
twice, refused."""

import numpy as np
import pytest

from bundle import labels as labels_module
from bundle.labels import (
    ContentHashes,
    DuplicateUids,
    LabelsRefused,
    StringColumn,
    UidLookup,
    check_unique_uids,
    load_label_arrays,
    write_label_arrays,
)
from bundle.manifest import LABEL_ARRAY_FILES

UIDS = [f"pkg-{i}" for i in range(500)] + ["ünïcode-λ", ""]
TEXTS = [f"text of {uid} ✓" for uid in UIDS]


@pytest.fixture
def arrays(tmp_path):
    write_label_arrays(tmp_path, UIDS, TEXTS)
    return tmp_path


def test_arrays_give_back_every_uid_text_and_id(arrays):
    uids, texts, lookup = load_label_arrays(arrays, len(UIDS))
    assert list(uids) == UIDS and list(texts) == TEXTS and uids == UIDS
    assert isinstance(uids.data, np.memmap)  # memory-mapped, not read into Python objects
    assert all(lookup[uid] == i for i, uid in enumerate(UIDS))
    assert lookup.get("pkg-500") is None and "nope" not in lookup
    assert uids[np.int64(3)] == "pkg-3" and uids[-1] == "" and uids[1:3] == ["pkg-1", "pkg-2"]


def test_appended_labels_live_beside_the_arrays_and_only_they_can_be_removed(arrays):
    uids, _, lookup = load_label_arrays(arrays, len(UIDS))
    uids.append("new")
    lookup["new"] = len(UIDS)
    assert uids[len(UIDS)] == "new" and lookup["new"] == len(UIDS) and len(uids) == len(UIDS) + 1
    del uids[len(UIDS) :]
    assert len(uids) == len(UIDS)
    with pytest.raises(TypeError):
        del uids[3:]


def test_a_hash_collision_still_gives_the_right_id(monkeypatch):
    # every uid collides, stored and looked up
    monkeypatch.setattr(labels_module, "content_hash", lambda uid: 7)
    monkeypatch.setattr(ContentHashes, "hashes", lambda self: np.full(len(self.offsets) - 1, 7, dtype=np.uint64))
    column = StringColumn.of(UIDS)
    lookup = UidLookup.of(column)
    assert [lookup[uid] for uid in UIDS] == list(range(len(UIDS)))
    assert lookup.get("absent") is None


def damage(directory, name, change):
    values = np.load(directory / name)
    change(values)
    np.save(directory / name, values)


@pytest.mark.parametrize(
    ("name", "change", "reason"),
    [
        (LABEL_ARRAY_FILES[1], lambda a: a.__setitem__(3, a[4] + 1), "non-decreasing"),
        (LABEL_ARRAY_FILES[3], lambda a: a.__setitem__(-2, a[-2] - 1), "inside a UTF-8 character"),
        (LABEL_ARRAY_FILES[2], lambda a: a.__setitem__(5, 0xFF), "not UTF-8"),
        (LABEL_ARRAY_FILES[4], lambda a: a.__setitem__(0, np.iinfo(np.uint64).max), "not sorted"),
        (LABEL_ARRAY_FILES[5], lambda a: a.__setitem__(0, a[1]), "not a permutation"),
    ],
    ids=["offsets-decrease", "offset-inside-a-character", "invalid-utf8", "hashes-unsorted", "order-repeats"],
)
def test_damaged_label_arrays_are_refused(arrays, name, change, reason):
    damage(arrays, name, change)
    with pytest.raises(LabelsRefused, match=reason):
        load_label_arrays(arrays, len(UIDS))


def test_hashes_that_are_not_the_uids_are_refused(arrays):
    """Sorted and a permutation, but not the uids' hashes: the lookup would not find the uids
    whose hashes changed (an exclude of them would do nothing, an append of one would give it a
    second label), so the file is refused at load."""
    hashes = np.load(arrays / LABEL_ARRAY_FILES[4])
    order = np.load(arrays / LABEL_ARRAY_FILES[5])
    at = int(np.flatnonzero(np.diff(hashes) > 1)[0])
    missed = UIDS[order[at]]
    hashes[at] += np.uint64(1)  # still sorted, still distinct
    np.save(arrays / LABEL_ARRAY_FILES[4], hashes)
    with pytest.raises(LabelsRefused, match="not the hashes of the uids"):
        load_label_arrays(arrays, len(UIDS))
    assert missed in UIDS  # the uid the altered file would have lost


def test_arrays_written_with_blake2b_hashes_load_and_are_verified_too(arrays):
    """Label arrays written before the lookup hashed by content hold blake2b hashes: verified
    by recomputing them, and looked up by them."""
    blake = np.array([labels_module.uid_hash(uid) for uid in UIDS], dtype=np.uint64)
    order = np.argsort(blake, kind="stable")
    np.save(arrays / LABEL_ARRAY_FILES[4], blake[order])
    np.save(arrays / LABEL_ARRAY_FILES[5], order.astype(np.int64))
    uids, _, lookup = load_label_arrays(arrays, len(UIDS))
    assert all(lookup[uid] == i for i, uid in enumerate(UIDS)) and "nope" not in lookup
    damaged = blake[order]
    assert damaged[-1] - damaged[-2] > 1
    damaged[-1] -= np.uint64(1)  # still sorted
    np.save(arrays / LABEL_ARRAY_FILES[4], damaged)
    with pytest.raises(LabelsRefused, match="not the hashes of the uids"):
        load_label_arrays(arrays, len(UIDS))


def test_arrays_of_another_count_are_refused(arrays):
    with pytest.raises(LabelsRefused, match="expected int64"):
        load_label_arrays(arrays, len(UIDS) + 1)


def test_arrays_naming_a_uid_twice_are_refused_with_both_rows(tmp_path):
    """A uid at two label ids would name the first only (the lookup stops at it) and an exclusion
    of it would leave the other: refused at load, the uid and both rows named."""
    uids = [*UIDS[:17], "pkg-3", *UIDS[18:]]
    write_label_arrays(tmp_path, uids, TEXTS)
    with pytest.raises(LabelsRefused, match=r"label uid 'pkg-3' at rows 3 and 17"):
        load_label_arrays(tmp_path, len(uids))


def test_a_duplicate_is_found_whatever_the_stored_hashes_say(tmp_path):
    """The stored hash file is the lookup's, not the check's: hashes written as if the uids were
    distinct do not hide a uid written twice."""
    uids = [*UIDS[:-1], "pkg-0"]
    write_label_arrays(tmp_path, UIDS, TEXTS)  # the hashes and order of distinct uids
    column = StringColumn.of(uids)  # the uid bytes and offsets: "pkg-0" twice
    np.save(tmp_path / LABEL_ARRAY_FILES[0], column.data)
    np.save(tmp_path / LABEL_ARRAY_FILES[1], column.offsets)
    with pytest.raises(LabelsRefused, match=rf"label uid 'pkg-0' at rows 0 and {len(uids) - 1}"):
        load_label_arrays(tmp_path, len(uids))


def test_every_duplicate_is_counted_and_the_empty_uid_is_one_too():
    with pytest.raises(DuplicateUids, match=r"label uid '' at rows 0 and 3 \(1 more label with an earlier label's"):
        check_unique_uids(["", "a", "b", "", "a"])
    check_unique_uids(["a", "a\x00", "", "\x00", "ab", "ba", "λ"])  # alike but distinct


def test_content_hashes_do_not_depend_on_how_the_bytes_are_cut():
    strings = ["", "ab", "ba", "ab", "λλ", "x" * 1000, "", "ab"]
    column = StringColumn.of(strings)
    cuts = []
    for size in (1, 3, 7, 1 << 20):
        hashes = ContentHashes(column.offsets)
        for start in range(0, len(column.data), size):
            hashes.add(column.data[start : start + size])
        cuts.append(hashes.hashes())
    assert all(np.array_equal(cuts[0], other) for other in cuts[1:])
    by_string = dict(zip(strings, cuts[0].tolist(), strict=True))
    assert len(set(by_string.values())) == len(by_string)  # equal strings alike, these distinct ones not


def test_one_uid_hashes_as_it_does_in_a_column():
    """The lookup hashes one uid (content_hash) as the file was written (a column's hashes)."""
    strings = ["", "a", "pkg-3", "ünïcode-λ", "z" * 256, "x" * 5000, "y" * (labels_module.HASH_PIECE + 3)]
    column = labels_module.column_hashes(StringColumn.of(strings))
    assert [labels_module.content_hash(s) for s in strings] == column.tolist()


def test_a_hash_collision_is_never_taken_for_a_duplicate(monkeypatch):
    monkeypatch.setattr(ContentHashes, "hashes", lambda self: np.zeros(len(self.offsets) - 1, dtype=np.uint64))
    check_unique_uids(UIDS)  # every uid collides, none repeats
    with pytest.raises(DuplicateUids, match="label uid 'pkg-9' at rows 9 and 502"):
        check_unique_uids([*UIDS, "pkg-9"])
