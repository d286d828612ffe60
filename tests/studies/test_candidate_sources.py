"""studies.candidate_sources: each variant is the default fusion over its own candidates, validated
cross-fitted on the held-out instances and chosen there; dev is measured after, and the serving
cost of built bundles in turns."""

import json

from export.fuse import FuseParams, fuse_bundle
from studies.candidate_sources.run import main, variants
from xmc.data import load_jsonl_split
from xmc.results import relative_paths


def test_each_variant_is_validated_and_the_choice_is_the_best_validation_score(memory_and_run, sample_dir, tmp_path):
    bundle, run = memory_and_run
    out = tmp_path / "sources.json"
    args = ["--bundle", str(bundle), "--run", str(run), "--data", str(sample_dir), "--out", str(out)]
    assert main([*args, "--sparse-depths", "5", "--folds", "2", "--dev"]) == 0
    result = json.loads(out.read_text())
    rows = result["variants"]
    assert list(rows) == ["memory, no fusion", *variants([5], [], 0)]
    scored = {name: row["score"] for name, row in rows.items() if "score" in row}
    assert result["chosen"] == max(scored, key=scored.get)
    # a sparse ranker only adds candidates: the relevant labels among them never fall
    assert rows["memory+sparse@5"]["relevant_among_candidates"] >= rows["memory"]["relevant_among_candidates"]
    assert all("dev" in row and row["dev"]["batched_queries_per_second"] > 0 for row in rows.values())
    assert "| memory+sparse+labels@5" in out.with_suffix(".md").read_text()


def test_serving_cost_measures_each_bundle_every_round_and_keeps_the_rest_of_the_file(
    memory_and_run, sample_dir, tmp_path
):
    bundle, run = memory_and_run
    fused = tmp_path / "fused"
    fuse_bundle(bundle, run, load_jsonl_split(sample_dir, "trn"), fused, FuseParams(sparse_depth=5))
    out = tmp_path / "cost.json"
    out.write_text(json.dumps({"chosen": "kept"}))
    args = ["--serving-cost", str(bundle), str(fused), "--rounds", "2", "--data", str(sample_dir), "--out", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["chosen"] == "kept"
    for name in (str(bundle), str(fused)):  # named as a result file names paths
        cost = result["serving_cost"][relative_paths(name)]
        assert cost["rounds"] == 2 and len(cost["per_round"]["idle_p50_ms"]) == 2
        assert cost["batched_queries_per_second"] > 0 and cost["idle_p50_ms"] > 0
