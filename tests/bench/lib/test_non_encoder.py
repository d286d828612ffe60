"""bench.lib.non_encoder's report: each tree's machinery is its CPU per request minus a floor's in
the same round, the thread rows' medians, and this tree against the baseline."""

import pytest

from bench.lib.non_encoder import report


def round_row(cpu: float, loop: float, threads: dict[str, float]) -> dict:
    return {
        "cpu_us_per_request": cpu,
        "loop_cpu_us_per_request": loop,
        "ok": 900,
        "threads": {
            name: {"threads": 1, "cpu_us_per_request": us, "runqueue_wait_us_per_request": us / 2}
            | {"timeslices_per_request": 2.0}
            for name, us in threads.items()
        },
    }


ROUNDS = {
    "this": [
        round_row(3000.0, 1100.0, {"MainThread": 1100.0, "xmcserve-encode-*": 1500.0}),
        round_row(3200.0, 1200.0, {"MainThread": 1200.0, "xmcserve-encode-*": 1700.0}),
        round_row(3100.0, 1150.0, {"MainThread": 1150.0}),
    ],
    "baseline": [round_row(4000.0, 1400.0, {}), round_row(4400.0, 1500.0, {}), round_row(4100.0, 1450.0, {})],
    "floor_asgi": [round_row(300.0, 290.0, {}), round_row(500.0, 480.0, {}), round_row(350.0, 340.0, {})],
    "floor_fastapi": [round_row(600.0, 590.0, {}), round_row(700.0, 690.0, {}), round_row(650.0, 640.0, {})],
}


def test_the_machinery_is_the_median_of_the_differences_in_each_round():
    result = report(
        ROUNDS, {"this": [800.0], "baseline": [500.0]}, ["this", "baseline"], ["floor_asgi", "floor_fastapi"]
    )
    this = result["machinery_cpu_us_per_request"]["this"]
    assert this["over_floor_asgi"] == {"per_round": [2700.0, 2700.0, 2750.0], "median": 2700.0}
    assert this["over_floor_fastapi"] == {"per_round": [2400.0, 2500.0, 2450.0], "median": 2450.0}
    baseline = result["machinery_cpu_us_per_request"]["baseline"]["over_floor_asgi"]
    assert baseline["median"] == 3750.0  # 3700, 3900, 3750
    loop = result["machinery_loop_cpu_us_per_request"]["this"]["over_floor_asgi"]
    assert loop["per_round"] == [810.0, 720.0, 810.0] and loop["median"] == 810.0
    assert result["median_cpu_us_per_request"] == {
        "this": 3100.0,
        "baseline": 4100.0,
        "floor_asgi": 350.0,
        "floor_fastapi": 650.0,
    }
    assert result["cpu_per_request_this_over_baseline"] == pytest.approx(0.756, abs=1e-3)
    assert result["cpu_us_per_request_this_minus_baseline"]["median"] == -1000.0
    assert result["median_peak_qps"] == {"this": 800.0, "baseline": 500.0}


def test_a_thread_row_missing_from_a_round_counts_as_zero_there():
    threads = report(ROUNDS, {}, ["this"], [])["median_thread_cpu_us_per_request"]["this"]
    assert threads["MainThread"] == {
        "threads": 1,
        "cpu_us_per_request": 1150.0,
        "runqueue_wait_us_per_request": 575.0,
        "timeslices_per_request": 2.0,
    }
    assert threads["xmcserve-encode-*"]["cpu_us_per_request"] == 1500.0  # of 1500, 1700, 0
    assert list(threads) == ["xmcserve-encode-*", "MainThread"]


def test_without_floors_or_baseline_only_the_figures_of_each_server():
    result = report({"this": ROUNDS["this"]}, {"this": []}, ["this"], [])
    assert "machinery_cpu_us_per_request" not in result and "cpu_per_request_this_over_baseline" not in result
    assert result["median_peak_qps"] == {} and "threads" not in result["paced"]["this"][0]
