"""evaluate: bundle + split (+ filter) -> table and JSON, through the service's search path."""

import json

import numpy as np
import pytest

from service.engine.bundle import load_bundle
from service.engine.search import Predictor
from training.data import load_jsonl_split
from training.evaluate import main, rank_split

pytestmark = pytest.mark.slow


def test_evaluate_prints_table_and_writes_json(sample_bundle, sample_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["--bundle", str(sample_bundle), "--data", str(sample_dir), "--split", "dev", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("P@1", "P@5", "PSP@5", "R@100", "nDCG@5", "F1@5/tail"):
        assert name in printed
    result = json.loads(out.read_text())
    assert result["instances"] == 1000 and result["filter_pairs_applied"] == 679
    metrics = result["metrics"]
    # The pretrained MiniLM RAE bundle measured P@1 54.4, R@100 77.8 on this split; a broken
    # search path (wrong ids, no aggregation, lost filter) lands far below these floors.
    assert metrics["P@1"] > 40 and metrics["R@100"] > 65
    assert metrics["P@1"] >= metrics["P@5"] and metrics["R@100"] >= metrics["R@10"]
    assert set(result["metrics_exclude_before"]) == set(metrics)
    assert "peers' protocol" in printed and "exclude before aggregation" in printed


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
