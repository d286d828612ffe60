"""xmc.evaluate: a predictor ranks a split under both filter protocols."""

import numpy as np
import pytest

from engine import Predictor
from engine.offline import load_bundle
from xmc.data import load_jsonl_split
from xmc.evaluate import rank_split

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("protocol", ["filter_after", "exclude_before"])
def test_filter_labels_never_appear_under_either_protocol(sample_bundle, sample_dir, protocol):
    dev = load_jsonl_split(sample_dir, "dev").subset(np.arange(200))
    ranked, _ = rank_split(Predictor(load_bundle(sample_bundle)), dev, k=100, ef=None, protocol=protocol)
    filters = dev.filter_sets()
    assert sum(len(f) for f in filters) > 50
    for row, excluded in enumerate(filters):
        assert not excluded & set(ranked[row].tolist())
    assert (ranked[:, :5] >= 0).all()  # still k labels after the filter labels were dropped


def test_the_protocols_agree_on_a_label_index_and_differ_on_an_rae_memory(bundle_root, sample_dir):
    """Filtering after ranking drops the same labels exclude-before skips when scores do not
    interact (a label index); the RAE softmax renormalises without the excluded keys."""
    dev = load_jsonl_split(sample_dir, "dev").subset(np.arange(200))
    tiny_labels, tiny_rae = (Predictor(load_bundle(bundle_root / name)) for name in ("tiny-labels", "tiny-rae"))
    after, _ = rank_split(tiny_labels, dev, k=20, ef=400, protocol="filter_after")
    before, _ = rank_split(tiny_labels, dev, k=20, ef=400, protocol="exclude_before")
    assert (after == before).mean() > 0.99  # HNSW may order near-ties differently at other depths
    rae_after, _ = rank_split(tiny_rae, dev, k=20, ef=None, protocol="filter_after")
    rae_before, _ = rank_split(tiny_rae, dev, k=20, ef=None, protocol="exclude_before")
    assert not (rae_after == rae_before).all()
