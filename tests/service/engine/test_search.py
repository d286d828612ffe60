"""service.engine.search: the exclusions both front ends map to label ids."""

from service.engine.memory import base_view
from service.engine.search import excluded_label_ids

VIEW = base_view(["a", "b", "c"], ["A", "B", "C"], 3, None)


def test_one_list_for_all_texts_is_mapped_once_and_shared():
    per_text = excluded_label_ids(VIEW, ["c", "a", "unknown"], 3)
    assert per_text == [{0, 2}] * 3
    assert per_text[0] is per_text[2]


def test_one_list_per_text_maps_each():
    assert excluded_label_ids(VIEW, [["b"], [], ("a", "c")], 3) == [{1}, set(), {0, 2}]


def test_no_exclusions_exclude_nothing():
    assert excluded_label_ids(VIEW, [], 2) == [set(), set()]
