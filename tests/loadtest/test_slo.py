"""SLO gates: the checker on a locust stats file, and a real headless run that passes and fails."""

import csv

import pytest

from loadtest.run import main as run_main
from loadtest.slo import Slo, check, read_stats
from loadtest.slo import main as slo_main

HEADER = [
    "Type",
    "Name",
    "Request Count",
    "Failure Count",
    "Median Response Time",
    "Average Response Time",
    "Min Response Time",
    "Max Response Time",
    "Average Content Size",
    "Requests/s",
    "Failures/s",
    "50%",
    "66%",
    "75%",
    "80%",
    "90%",
    "95%",
    "98%",
    "99%",
    "99.9%",
    "99.99%",
    "100%",
]


def stats_file(path, rows):
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(HEADER)
        for name, count, failures, rps, p50, p95, p99 in rows:
            writer.writerow(
                [
                    "POST" if name != "Aggregated" else "",
                    name,
                    count,
                    failures,
                    p50,
                    p50,
                    1,
                    p99,
                    900,
                    rps,
                    0,
                    p50,
                    p50,
                    p50,
                    p50,
                    p95,
                    p95,
                    p99,
                    p99,
                    p99,
                    p99,
                    p99,
                ]
            )
    return path


def test_check_passes_and_names_each_miss(tmp_path):
    path = stats_file(
        tmp_path / "s.csv", [("/predict single", 900, 0, 30.0, 12, 30, 45), ("Aggregated", 1000, 2, 33.0, 12, 31, 48)]
    )
    rows = read_stats(path)
    assert check(rows, Slo(p99_ms=50, max_failure_ratio=0.01, min_rps=10))[0] == []
    misses, _ = check(rows, Slo(p99_ms=40, max_failure_ratio=0.001, min_rps=50))
    assert len(misses) == 3
    assert "p99 48 ms > 40 ms" in misses[0] and "failure ratio" in misses[1] and "throughput" in misses[2]
    assert slo_main([str(path), "--p99-ms", "50"]) == 0
    assert slo_main([str(path), "--p99-ms", "10"]) == 1


def test_no_requests_is_a_miss(tmp_path):
    path = stats_file(tmp_path / "s.csv", [("Aggregated", 0, 0, 0.0, 0, 0, 0)])
    assert check(read_stats(path), Slo())[0] == ["no requests were made"]


@pytest.mark.slow
def test_headless_run_meets_a_lenient_slo_and_misses_an_impossible_one(tiny_rae_bundle, tmp_path, capsys):
    common = ["--bundle", str(tiny_rae_bundle), "--seconds", "8", "--users", "2", "--results", str(tmp_path)]
    assert run_main([*common, "--p99-ms", "5000", "--max-failure-ratio", "0.0", "--min-rps", "1"]) == 0
    out = capsys.readouterr().out
    assert "SLO MET" in out and "/predict single" in out and (tmp_path / "steady.html").exists()
    assert run_main([*common, "--scenario", "spike", "--p99-ms", "0.001"]) == 1
    assert "SLO MISSED: p99" in capsys.readouterr().out


def test_loadtest_refuses_non_loopback_hosts():
    with pytest.raises(SystemExit):
        run_main(["--host", "http://10.0.0.5:8000"])
