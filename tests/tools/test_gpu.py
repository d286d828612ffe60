"""tools.gpu's dry run, end to end as CI runs it: every stage on the CPU within its budget, one
JSON with the machine, every figure (positive) and its settings; and the checks made before
anything runs."""

import json

import pytest

from tools.gpu.run import GpuBenchParams, MissingRequirements, build_parser, core_plan, main, params_from, preflight


def positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def test_the_dry_run_measures_every_stage_within_its_budget(distilbert_dir, sample_dir, tmp_path):
    out = tmp_path / "gpu.json"
    # the tiny encoder and --no-reuse: the build stage runs, in seconds, whatever bundles/ holds
    args = ["--dry-run", "--no-reuse", "--checkpoint", str(distilbert_dir), "--dim", "16", "--data", str(sample_dir)]
    assert main([*args, "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    result = json.loads(out.read_text())

    assert result["dry_run"] is True and result["params"]["provider"] == "cpu"
    assert {name: stage["status"] for name, stage in result["stages"].items()} == dict.fromkeys(
        ("bundle", "serving", "null_encoder", "scaling"), "done"
    )
    assert result["wall_s"] <= result["params"]["budget_s"]
    machine = result["machine"]
    assert (
        positive(machine["cpus"])
        and machine["cpu_model"]
        and "CPUExecutionProvider" in machine["onnxruntime_providers"]
    )

    bundle = result["bundle"]
    assert bundle["source"] == "built" and bundle["quantize"] == "none" and positive(bundle["build_wall_s"])
    assert bundle["tiny_rows"] == 200 and bundle["counts"]["train_instances"] == 200

    serving = result["serving"]
    assert serving["execution_provider"] == "CPUExecutionProvider"
    assert serving["settings"]["XMCSERVE_PROVIDERS"] == "cpu"
    for figure in ("peak_qps", "idle_p50_ms", "p99_ms_at_70pct_peak"):
        assert positive(serving[figure]), figure
    assert [row["concurrency"] for row in serving["closed_loop"]] == [4, 16]
    assert serving["idle"]["concurrency"] == 1 and serving["paced"]["share_of_peak"] == 0.7
    assert all(positive(rate) for rate in serving["encoder_alone"]["texts_per_s"].values())

    assert positive(result["null_encoder"]["peak_qps"])

    scaling = result["scaling"]
    assert scaling["provider"] == "cpu" and set(scaling["by_processes"]) == {"1", "2"}
    assert scaling["mode"] == "workers"  # one server of 2 workers, not 2 servers
    one = scaling["by_processes"]["1"]
    assert positive(one["peak_qps"]) and one["speedup_over_1"] == 1.0
    two = scaling["by_processes"]["2"]
    if scaling["cores_usable"] >= 2:  # two processes need two cores of their own
        assert two["status"] == "done" and positive(two["peak_qps"]) and two["servers"] == 1
        assert two["cpus"] is None or not set(two["cpus"][0]) & set(two["cpus"][1])
    else:
        assert two["status"] == "capped"

    assert result["summary"]["peak_qps"] == serving["peak_qps"]


def test_stages_that_no_longer_fit_the_budget_are_skipped_and_say_why(sample_dir, tmp_path):
    bundle = tmp_path / "bundle"  # given, so nothing is built: only its manifest is read
    bundle.mkdir()
    manifest = {"bundle_id": "b", "index_kind": "rae_memory", "dim": 16, "counts": {}, "source": {"encoder": "e"}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "gpu.json"
    args = ["--dry-run", "--budget-s", "8", "--bundle", str(bundle), "--data", str(sample_dir), "--out", str(out)]
    assert main([*args, "--work", str(tmp_path / "work")]) == 0
    result = json.loads(out.read_text())
    assert result["stages"]["bundle"]["status"] == "done" and result["bundle"]["source"] == "given (--bundle)"
    for name in ("serving", "null_encoder", "scaling"):
        stage = result["stages"][name]
        assert stage["status"] == "skipped" and stage["reason"].startswith("budget: needs about"), stage
    assert result["wall_s"] <= 8 and result["summary"]["peak_qps"] is None


def test_a_run_that_needs_the_cuda_provider_says_so_before_starting(monkeypatch, sample_dir, tmp_path):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(MissingRequirements) as refused:
        preflight(GpuBenchParams(data=sample_dir, bundle=tmp_path / "absent"))
    problems = "\n".join(refused.value.problems)
    assert "onnxruntime-gpu" in problems and "absent (no manifest.json)" in problems


def test_missing_requirements_exit_2_naming_them(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("tools.gpu.run.preflight", lambda params: (_ for _ in ()).throw(MissingRequirements(["x>=1"])))
    assert main(["--out", str(tmp_path / "gpu.json")]) == 2
    assert "x>=1" in capsys.readouterr().err and not (tmp_path / "gpu.json").exists()


def test_scaling_cores_leave_the_load_generator_its_own_from_eight_cores():
    loadgen, servers, per_server = core_plan(GpuBenchParams(), list(range(16)))
    assert loadgen == [14, 15] and servers == list(range(14)) and per_server == 1
    loadgen, servers, per_server = core_plan(GpuBenchParams.dry(), [0, 1])
    assert loadgen == [] and servers == [0, 1] and per_server == 1


def test_stages_not_asked_for_are_skipped_and_say_so(sample_dir, tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    manifest = {"bundle_id": "b", "index_kind": "rae_memory", "dim": 16, "counts": {}, "source": {"encoder": "e"}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "gpu.json"
    args = ["--dry-run", "--bundle", str(bundle), "--data", str(sample_dir), "--out", str(out)]
    # a budget too short for the scaling stage, so it is skipped for the budget, the others as not asked for
    assert main([*args, "--budget-s", "8", "--stages", "scaling", "--work", str(tmp_path / "work")]) == 0
    stages = json.loads(out.read_text())["stages"]
    assert stages["serving"] == stages["null_encoder"] == {"status": "skipped", "reason": "not asked for (--stages)"}
    assert stages["scaling"]["reason"].startswith("budget: needs about")


def test_unknown_stages_and_the_cores_per_server_reach_the_params(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--stages", "serving,encoder"])
    assert refused.value.code == 2 and "not encoder" in capsys.readouterr().err
    params = params_from(build_parser().parse_args(["--stages", "scaling", "--cores-per-server", "3"]))
    assert params.stages == ("scaling",) and params.cores_per_server == 3
    assert GpuBenchParams().stages == ("serving", "null_encoder", "scaling")
