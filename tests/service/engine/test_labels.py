"""Label arrays (service.engine.labels): uids and texts as memory-mapped bytes and offsets, uid → id
by sorted hashes, every answer checked against the stored uid; damaged arrays refused."""

import numpy as np
import pytest

from service.engine import labels as labels_module
from service.engine.labels import (
    LabelsRefused,
    StringColumn,
    UidLookup,
    load_label_arrays,
    write_label_arrays,
)
from service.engine.manifest import LABEL_ARRAY_FILES

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
    monkeypatch.setattr(labels_module, "uid_hash", lambda uid: 7)  # every uid collides
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


def test_arrays_of_another_count_are_refused(arrays):
    with pytest.raises(LabelsRefused, match="expected int64"):
        load_label_arrays(arrays, len(UIDS) + 1)
