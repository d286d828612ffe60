"""studies.fusion_onnx: parity of every ONNX model with its library, and a per-batch time for each
variant, on the same held-out features."""

import json

from export.fusion_to_onnx import PARITY_BOUND
from studies.fusion_onnx.run import main


def test_parity_and_per_batch_cost_of_each_variant(memory_and_run, sample_dir, tmp_path):
    bundle, run = memory_and_run
    out = tmp_path / "fusion-onnx.json"
    args = ["--bundle", str(bundle), "--run", str(run), "--data", str(sample_dir), "--out", str(out)]
    assert main([*args, "--rounds", "2", "--trees", "10", "--batch", "32"]) == 0
    result = json.loads(out.read_text())
    variants = {"onnx-tree", "onnx-gbdt", "onnx-lambdarank"}
    assert set(result["parity_max_abs_vs_library"]) == variants == set(result["median_us_per_batch"])
    assert all(0 <= parity <= PARITY_BOUND for parity in result["parity_max_abs_vs_library"].values())
    assert result["batches"] == 10  # 300 searches (150 instances, both kinds) in batches of 32
    assert all(us > 0 for us in result["median_us_per_batch"].values())
