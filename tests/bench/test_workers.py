"""bench.workers end to end on the tiny bundle: both worker counts served and measured in each
round, the ratios taken against the first count."""

import json

import pytest

from bench.workers import main


@pytest.mark.parametrize("null_encoder", [False, True], ids=["encoder", "null-encoder"])
def test_one_and_two_workers_are_measured_in_turns(tiny_rae_bundle, sample_dir, tmp_path, null_encoder):
    out = tmp_path / "workers.json"
    args = ["--bundle", str(tiny_rae_bundle), "--data", str(sample_dir), "--rounds", "2", "--seconds", "0.5"]
    args += ["--null-encoder"] if null_encoder else []
    main([*args, "--idle-requests", "20", "--concurrency", "4", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [list(row) for row in result["rounds"]] == [["1", "2"], ["2", "1"]]  # the order alternates
    for row in result["rounds"]:
        for figures in row.values():
            assert figures["peak_qps"] > 0 and figures["idle_p50_ms"] > 0 and not figures["non_200"], figures
    assert result["ratio_to_first"]["1"] == {"peak_qps": 1.0, "idle_p50_ms": 1.0}
    assert result["ratio_to_first"]["2"]["peak_qps"] > 0
    assert result["params"]["null_encoder"] is null_encoder
