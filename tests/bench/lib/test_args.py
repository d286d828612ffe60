"""bench.lib.args: the sweep helpers: the ``--settings`` pairs of the compressed-index benchmarks
and the setting they serve (the first to reach the target recall, else the best)."""

import pytest

from bench.lib.args import breadth_settings, first_reaching


def test_settings_are_nprobe_ef_pairs_in_the_order_given():
    assert breadth_settings("128:300,256:1000") == [(128, 300), (256, 1000)]
    with pytest.raises(ValueError):
        breadth_settings("128-300")


def test_the_first_setting_reaching_the_target_is_chosen_else_the_best():
    recalls = {(128, 300): 0.954, (128, 1000): 0.991, (256, 2000): 0.997}
    assert first_reaching(recalls, 0.99) == (128, 1000)
    assert first_reaching({"a": 0.90, "b": 0.96, "c": 0.95}, 0.99) == "b"
