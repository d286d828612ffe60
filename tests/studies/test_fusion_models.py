"""studies.fusion_models: every model is validated cross-fitted on the held-out instances under both
protocols, optional feature groups are tried on the best, and dev is measured only for the choice."""

import json
from pathlib import Path

import pytest

from engine.fusion import OPTIONAL_GROUPS
from export.fusion_fit import DEFAULT_FUSION, DEFAULT_PARAMS, DEFAULT_SIZES, FusionChoice, size_name
from export.fusion_validation import selection_score
from export.sparse_fit import SparseFitParams
from studies.fusion_models.run import MAX_MODEL_MS, MODELS, main


def test_the_choice_is_made_on_validation_and_dev_is_measured_for_it_alone(memory_and_run, sample_dir, tmp_path):
    bundle, run = memory_and_run
    out = tmp_path / "fusion-models.json"
    args = ["--bundle", str(bundle), "--run", str(run), "--data", str(sample_dir), "--out", str(out)]
    assert main([*args, "--folds", "3", "--ensembles", "10x31", "--rerank-depths", "0", "--dev", "--curve"]) == 0
    result = json.loads(out.read_text())
    candidates = result["candidates"]
    assert {c["model"] for c in candidates.values()} == set(MODELS)
    assert len(candidates) == len(MODELS) + len(OPTIONAL_GROUPS) - 1  # each extra group tried once
    assert all(c["rerank_depth"] is None for c in candidates.values()) and candidates[result["chosen"]]["eligible"]
    assert all(c["eligible"] == (not c["ineligible_because"]) for c in candidates.values())
    for figures in candidates.values():
        for protocol in ("filter_after", "exclude_before"):
            assert set(figures["validation"][protocol]) == {"P@1", "P@5", "PSP@5", "R@100"}
            assert 0 <= figures["validation"][protocol]["P@1"] <= 100
    assert result["chosen"] in candidates and result["held_out_instances"] == 150
    assert result["dev"]["candidate"] == result["chosen"] and result["dev"]["onnx_parity_max_abs"] <= 1e-4
    assert set(result["dev"]["filter_after"]) == {"P@1", "P@3", "P@5", "PSP@5", "R@100"}
    assert list(result["curve"]) == ["0.25", "0.5", "1"]
    assert result["curve"]["1"] == candidates[result["chosen"]]["validation"]  # the same cross-fit
    assert all(figures["onnx_us_per_pair"] > 0 for figures in candidates.values())


def test_rerank_depths_and_sizes_are_compared_and_the_budget_rules_out_dear_models(
    memory_and_run, sample_dir, tmp_path
):
    bundle, run = memory_and_run
    out = tmp_path / "fusion-models.json"
    args = ["--bundle", str(bundle), "--run", str(run), "--data", str(sample_dir), "--out", str(out), "--folds", "2"]
    with pytest.raises(SystemExit, match="no candidate's model costs at most"):  # a budget none meets
        main([*args, "--rerank-depths", "8", "--ensembles", "6x4", "--max-model-ms", "1e-9"])
    result_args = [*args, "--rerank-depths", "0", "8", "--ensembles", "6x4", "12x8", "--min-gain", "1000"]
    assert main(result_args) == 0
    result = json.loads(out.read_text())
    candidates = result["candidates"]
    first = [c for c in candidates.values() if c["features"] == ["rae", "lexical"]]
    assert len(first) == 2 * (1 + 2 * 2)  # per depth: the tree, and two sizes of each ensemble
    assert {c["rerank_depth"] for c in candidates.values()} == {None, 8}
    assert {(c["params"].get("trees"), c["params"].get("leaves")) for c in candidates.values()} >= {(6, 4), (12, 8)}
    assert result["pairs"]["8"] < result["pairs"]["all"]
    reference = candidates["tree@all[rae+lexical]"]
    for c in candidates.values():
        below = c["validation"]["filter_after"]["R@100"] < reference["validation"]["filter_after"]["R@100"]
        assert below == any("R@100" in why for why in c["ineligible_because"])
    assert candidates[result["chosen"]]["eligible"]
    assert result["positives_among_candidates"]["8"] <= result["positives_among_candidates"]["all"]
    # a depth-8 candidate ranks at most 8 labels a search: its R@100 is its R@8
    deep = [c for c in candidates.values() if c["rerank_depth"] == 8]
    shallow = [c for c in candidates.values() if c["rerank_depth"] is None]
    assert max(c["validation"]["filter_after"]["R@100"] for c in deep) <= max(
        c["validation"]["filter_after"]["R@100"] for c in shallow
    )


def test_the_default_fusion_is_the_choice_bench_fusion_models_recorded():
    """export.fusion_fit.DEFAULT_FUSION is defined once; the run that chose it over the candidates it
    serves (the memory's and the sparse ranker's) recorded its name, under the cap of today."""
    results = Path(__file__).resolve().parents[2] / "bench/results"
    recorded = json.loads((results / "fusion-models-sparse.json").read_text())
    assert DEFAULT_FUSION.name == recorded["chosen"] == "lambdarank-60x31@200[rae+lexical]+sparse@100"
    assert recorded["sparse_depth"] == DEFAULT_FUSION.sparse_depth and recorded["max_model_ms"] == MAX_MODEL_MS
    assert recorded["candidates"][recorded["chosen"]]["eligible"]
    # the choice before the sparse ranker, over the memory's candidates alone, under the 0.15 ms cap
    before = json.loads((results / "fusion-models.json").read_text())
    assert before["chosen"] == "lambdarank-60x15@200[rae+lexical]" and before["max_model_ms"] == 0.15


def test_each_default_size_is_the_one_a_recorded_data_set_s_own_validation_prefers():
    """export.fuse chooses among DEFAULT_SIZES per data set because the recorded validations
    disagree: Debian-Related's prefers 60x31, Gutenberg-Subjects' 60x15."""
    results = Path(__file__).resolve().parents[2] / "bench/results"
    preferred = {}
    for name in ("fusion-models-sparse.json", "fusion-models-sparse-gutenberg.json"):
        candidates = json.loads((results / name).read_text())["candidates"]
        scores = {}
        for size in DEFAULT_SIZES:
            choice = FusionChoice("lambdarank", DEFAULT_FUSION.groups, DEFAULT_PARAMS["lambdarank"] | size, 200, 100)
            scores[size_name(size)] = selection_score(candidates[choice.name]["validation"])
        preferred[name] = max(scores, key=scores.get)
    assert preferred == {"fusion-models-sparse.json": "60x31", "fusion-models-sparse-gutenberg.json": "60x15"}


def test_the_default_fusions_candidates_are_the_choice_bench_candidate_sources_recorded():
    """Its candidate sources (the memory's and a sparse ranker's top 100, each label's own text among
    its texts) are the choice of studies.candidate_sources on the held-out validation."""
    root = Path(__file__).resolve().parents[2]
    recorded = json.loads((root / "bench/results/candidate-sources-debian.json").read_text())
    assert recorded["chosen"] == f"memory+sparse+labels@{DEFAULT_FUSION.sparse_depth}"
    assert SparseFitParams().label_texts and SparseFitParams().kind(42242) == "centroid"
    assert FusionChoice("tree", ("rae", "lexical", "rank"), {"depth": 7}, None).name == "tree@all[rae+lexical+rank]"


def test_the_model_is_chosen_over_a_sparse_rankers_candidates_too(memory_and_run, sample_dir, tmp_path):
    """With --sparse-depth every candidate ranks the memory's candidates joined by the ranker's top
    D, the sparse features in its φ, and dev serves the ranker the pairs were computed with."""
    bundle, run = memory_and_run
    out = tmp_path / "fusion-models.json"
    args = ["--bundle", str(bundle), "--run", str(run), "--data", str(sample_dir), "--out", str(out), "--folds", "2"]
    plain = tmp_path / "plain.json"
    assert main([*args[:-4], "--out", str(plain), "--folds", "2", "--rerank-depths", "0", "--ensembles", "6x4"]) == 0
    assert main([*args, "--rerank-depths", "0", "--ensembles", "6x4", "--sparse-depth", "5", "--dev"]) == 0
    result, before = json.loads(out.read_text()), json.loads(plain.read_text())
    assert result["sparse_depth"] == 5 and before["sparse_depth"] is None
    assert all(c["features"][-1] == "sparse" for c in result["candidates"].values())
    assert all(name.endswith("+sparse@5") for name in result["candidates"])
    assert len(result["candidates"]) == len(before["candidates"])  # the same models and groups tried
    assert result["pairs"]["all"] > before["pairs"]["all"]  # the ranker's labels joined the candidates
    assert result["positives_among_candidates"]["all"] >= before["positives_among_candidates"]["all"]
    assert result["dev"]["candidate"] == result["chosen"] and result["dev"]["onnx_parity_max_abs"] <= 1e-4
