"""studies.fusion_shift: held-out and dev pairs are compared by a classifier's AUC, per kind of pair."""

import json

from studies.fusion_shift.run import main


def test_held_out_and_dev_pairs_are_told_apart_or_not_by_auc(memory_and_run, sample_dir, tmp_path):
    bundle, run = memory_and_run
    out = tmp_path / "shift.json"
    args = ["--bundle", str(bundle), "--run", str(run), "--data", str(sample_dir), "--queries", "100"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["queries"] == {"held_out": 100, "dev": 100}
    for kind in ("relevant_pairs", "irrelevant_pairs"):
        assert 0.0 <= result[kind]["auc"] <= 1.0 and result[kind]["pairs_each"] > 0
        assert result[kind]["gain_share"] and all(0 <= share <= 1 for share in result[kind]["gain_share"].values())
