"""Each variant's live /predict traffic from the server's own request histogram: QPS, p50/p99 and
the share of answers that were not a prediction, over the last minutes of a split.

The histogram (``xmcserve_request_duration_seconds``) holds cumulative counts since start-up, as
Prometheus reads them. :class:`LiveTraffic` samples it every few seconds into a bounded ring of
per-variant totals; a window's figures are differences between two samples, and its quantiles are
interpolated within the histogram's buckets as ``histogram_quantile`` does, so the page shows
what a Grafana panel on the same counters would, without a Prometheus. Sampling reads the
counters only: /predict pays nothing for it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass

ENDPOINT = "/predict"
FAMILY = "xmcserve_request_duration_seconds"


@dataclass(frozen=True)
class Totals:
    """One variant's cumulative /predict answers at one moment."""

    count: float
    failed: float  # answers other than 200: refusals (429, 503), errors (500), clients gone (499)
    buckets: tuple[tuple[float, float], ...]  # (upper bound in seconds, cumulative count), +Inf last


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """``histogram_quantile(q, ...)`` of cumulative ``(upper bound, count)`` buckets: linear within
    the bucket holding the rank; the highest finite bound when the rank is in the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def totals_by_variant(histogram) -> dict[str, Totals]:
    """The histogram's /predict series summed per variant (over methods and statuses)."""
    counts: dict[str, float] = {}
    failed: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in histogram.collect():
        for sample in family.samples:
            labels = sample.labels
            variant = labels.get("variant", "-")
            if labels.get("endpoint") != ENDPOINT or variant == "-":
                continue
            if sample.name == f"{FAMILY}_count":
                counts[variant] = counts.get(variant, 0.0) + sample.value
                if labels.get("status") != "200":
                    failed[variant] = failed.get(variant, 0.0) + sample.value
            elif sample.name == f"{FAMILY}_bucket":
                bound = float(labels["le"])
                per_bound = buckets.setdefault(variant, {})
                per_bound[bound] = per_bound.get(bound, 0.0) + sample.value
    return {
        variant: Totals(count, failed.get(variant, 0.0), tuple(sorted(buckets.get(variant, {}).items())))
        for variant, count in counts.items()
    }


def figures(before: Totals | None, after: Totals, seconds: float) -> dict:
    """A variant's traffic between two samples: requests, QPS, p50/p99 (ms), failed share."""
    count = after.count - (before.count if before else 0.0)
    failed = after.failed - (before.failed if before else 0.0)
    earlier = dict(before.buckets) if before else {}
    window = [(bound, total - earlier.get(bound, 0.0)) for bound, total in after.buckets]

    def ms(q: float) -> float | None:
        value = quantile(q, window) if count > 0 else None
        return None if value is None else round(value * 1000, 3)

    return {
        "requests": int(count),
        "qps": round(count / seconds, 3) if seconds > 0 else None,
        "p50_ms": ms(0.5),
        "p99_ms": ms(0.99),
        "failed": int(failed),
        "failed_share": round(failed / count, 4) if count > 0 else None,
    }


class LiveTraffic:
    """A ring of per-variant totals sampled every ``interval_s`` (the app's lifespan runs
    :meth:`sample`); ``clock`` is injectable for tests."""

    def __init__(self, histogram, interval_s: float = 5.0, capacity: int = 720, clock=time.time):
        self.histogram = histogram
        self.interval_s = interval_s
        self.clock = clock
        self.samples: deque[tuple[float, dict[str, Totals]]] = deque(maxlen=capacity)  # 1 h at 5 s

    def sample(self) -> None:
        self.samples.append((self.clock(), totals_by_variant(self.histogram)))

    async def run(self) -> None:
        """Samples every ``interval_s`` until cancelled (the lifespan's task)."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def report(self, window_s: float) -> dict:
        """Each variant's figures over the last ``window_s`` (from the oldest sample within it to
        now) and per sampling interval (a point per interval, for the page's plots)."""
        now = self.clock()
        current = totals_by_variant(self.histogram)
        inside = [(ts, totals) for ts, totals in self.samples if ts >= now - window_s]
        series: dict[str, list] = {}
        for (t0, before), (t1, after) in zip(inside, [*inside[1:], (now, current)], strict=True):
            if t1 - t0 < self.interval_s / 2:  # a sample a moment ago: too short an interval to rate
                continue
            for variant, totals in after.items():
                point = figures(before.get(variant), totals, t1 - t0)
                series.setdefault(variant, []).append(
                    [t1, point["qps"], point["p50_ms"], point["p99_ms"], point["failed_share"]]
                )
        start, first = inside[0] if inside else (now, {})
        return {
            "now": now,
            "window_s": window_s,
            "from": start,
            "interval_s": self.interval_s,
            "variants": {
                variant: figures(first.get(variant), totals, now - start) for variant, totals in current.items()
            },
            "series": series,
        }
