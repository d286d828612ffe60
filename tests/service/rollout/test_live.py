"""Live traffic per variant from the request histogram: a window's QPS, quantiles and failed share
are differences of sampled cumulative counts (an injected clock, the real prometheus histogram)."""

import pytest

from service.http.metrics import Metrics
from service.rollout.live import LiveTraffic, quantile


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def observe(metrics: Metrics, variant: str, seconds: float, times: int = 1, status: str = "200", endpoint="/predict"):
    for _ in range(times):
        metrics.request_seconds.labels(endpoint=endpoint, method="POST", status=status, variant=variant).observe(
            seconds
        )


def test_quantile_interpolates_within_the_bucket_as_prometheus_does():
    buckets = [(0.01, 0.0), (0.02, 50.0), (0.05, 100.0), (float("inf"), 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.02)
    assert quantile(0.25, buckets) == pytest.approx(0.015)
    assert quantile(0.99, buckets) == pytest.approx(0.02 + 0.03 * 49 / 50)
    assert quantile(0.5, [(0.01, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.99, [(0.01, 1.0), (float("inf"), 10.0)]) == 0.01  # in +Inf: the highest finite bound


def test_a_window_counts_only_what_happened_inside_it_per_variant():
    metrics, clock = Metrics(), Clock()
    live = LiveTraffic(metrics.request_seconds, interval_s=5, clock=clock)
    observe(metrics, "A", 0.5, times=100)  # before the window: not counted
    live.sample()
    clock.now += 5
    observe(metrics, "A", 0.015, times=40)
    observe(metrics, "A", 0.015, times=10, status="429")
    observe(metrics, "B", 0.2, times=5)
    observe(metrics, "-", 0.001, times=7, status="422")  # refused before a variant was chosen
    observe(metrics, "A", 0.001, times=9, endpoint="/readyz")
    live.sample()
    clock.now += 5
    report = live.report(window_s=60)
    a, b = report["variants"]["A"], report["variants"]["B"]
    assert set(report["variants"]) == {"A", "B"}
    assert (a["requests"], a["failed"], a["failed_share"], a["qps"]) == (50, 10, 0.2, 5.0)
    assert 10 < a["p50_ms"] <= 25 and a["p99_ms"] <= 25  # the 0.5 s answers are outside the window
    assert (b["requests"], b["failed"], b["qps"]) == (5, 0, 0.5)
    # one point per sampling interval: 50 answers in the first 5 s, none in the next
    assert [point[1] for point in report["series"]["A"]] == [10.0, 0.0]
    assert report["from"] == 1000.0 and report["now"] == 1010.0


def test_the_ring_forgets_the_oldest_samples():
    metrics, clock = Metrics(), Clock()
    live = LiveTraffic(metrics.request_seconds, interval_s=5, capacity=3, clock=clock)
    for _ in range(5):
        live.sample()
        clock.now += 5
    assert len(live.samples) == 3 and live.samples[0][0] == 1010.0
    assert live.report(window_s=3600)["variants"] == {}  # no /predict answered yet
