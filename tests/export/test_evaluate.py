"""export.evaluate: bundle + split (+ filter) -> table and JSON, through the service's search path."""

import json

import pytest

from export.evaluate import main

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
