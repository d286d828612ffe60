"""Prometheus metrics, one registry per app (so several apps can live in one process, e.g. tests)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import CounterMetricFamily

from service.http.guards import method_label

# Request latencies span ~2 ms (idle, one text) to seconds (overload); stages start lower.
REQUEST_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2, 5)
STAGE_BUCKETS = (0.0001, 0.0003, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.01, 0.02, 0.05, 0.1, 0.5, 1)


class Metrics:
    """``multiprocess_dir``: the group's metrics directory when this is one worker of several
    (``XMCSERVE_WORKERS``): prometheus-client then keeps every value in a file there, and
    :meth:`exposition` sums the workers' counters and histograms (and the live workers' gauges)
    into one view. The client must have been imported with ``PROMETHEUS_MULTIPROC_DIR`` set to it
    (the supervisor sets it before it starts the workers)."""

    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        self._children: dict[tuple, object] = {}
        self._sampled: list[tuple[object, Callable[[], float]]] = []
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        if multiprocess_dir is None:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            self.local_registry = self.registry
        else:
            in_files = values.ValueClass is not values.MutexValue
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR") != str(multiprocess_dir) or not in_files:
                raise RuntimeError(f"prometheus-client was not imported in multiprocess mode for {multiprocess_dir}")
            # Info is not kept in the files: each worker exports the bundles it serves (the same
            # in every worker once an admin change has converged)
            self.local_registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "xmcserve_request_duration_seconds",
            "HTTP request latency by endpoint and status code",
            ["endpoint", "method", "status", "variant"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.stage_seconds = Histogram(
            "xmcserve_stage_duration_seconds",
            "Time per /predict stage: queue (per request), tokenize, encode, search, aggregate (per batch)",
            ["stage", "variant"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.batch_texts = Histogram(
            "xmcserve_batch_size_texts",
            "Texts per micro-batch",
            ["variant"],
            buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64, 128),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "xmcserve_queue_depth",
            "Requests waiting for a micro-batch",
            ["variant"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.batches_in_flight = Gauge(
            "xmcserve_batches_in_flight",
            "Micro-batches being computed",
            ["variant"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.rejected = Counter(
            "xmcserve_rejected_requests",
            "Requests refused because the variant's queue was full",
            ["variant"],
            registry=self.registry,
        )
        self.dropped_requests = Counter(
            "xmcserve_dropped_requests",
            "Queued requests taken out unrun: the client went away (client_gone) or the request could "
            "not start before its deadline (deadline, answered 503)",
            ["variant", "reason"],
            registry=self.registry,
        )
        self.predicted_texts = Counter(
            "xmcserve_predicted_texts", "Texts answered by /predict", ["variant"], registry=self.registry
        )
        # Server-wide: a request's variant is known only once /predict has routed it (per-variant
        # load is queue_depth and batches_in_flight).
        self.in_flight = Gauge(
            "xmcserve_in_flight_requests",
            "HTTP requests being handled",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.bundle_info = Info(
            "xmcserve_bundle", "The bundle each variant serves", ["variant"], registry=self.local_registry
        )
        self.reloads = Counter(
            "xmcserve_reloads",
            "Admin bundle loads by variant and outcome",
            ["variant", "outcome"],
            registry=self.registry,
        )
        self.appends = Counter(
            "xmcserve_appends",
            "Admin appends to a variant's memory by outcome (applied, repeated, refused, failed)",
            ["variant", "outcome"],
            registry=self.registry,
        )
        # What /info's memory says: read from the memory each variant serves at each scrape, so it
        # counts the appends replayed at load and those other workers logged as well as this
        # process's own; per process (a group's workers serve one memory: exported once, not summed).
        self.appended_keys_of: Callable[[], Iterable[tuple[str, int, int]]] = tuple
        self.local_registry.register(_AppendedKeys(lambda: self.appended_keys_of()))
        self.replay_skipped = Counter(
            "xmcserve_replay_skipped",
            "Logged appends left out when a bundle was loaded, as they no longer applied "
            "(only with XMCSERVE_REPLAY_SKIP_REFUSED; see /info memory.replay_skipped)",
            ["variant"],
            registry=self.registry,
        )
        # The shadow's comparisons, labelled with the variant whose answers are mirrored (A).
        self.shadow_overlap = Histogram(
            "xmcserve_shadow_overlap",
            "overlap@k between primary and shadow top-k, per mirrored text",
            ["variant"],
            buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
            registry=self.registry,
        )
        self.shadow_rank_correlation = Histogram(
            "xmcserve_shadow_rank_correlation",
            "Kendall tau of the shared labels' ranks, per mirrored text",
            ["variant"],
            buckets=(-1.0, -0.5, 0.0, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=self.registry,
        )
        self.shadow_score_delta = Histogram(
            "xmcserve_shadow_score_delta",
            "mean |primary score - shadow score| over the labels both top-k share, per mirrored text",
            ["variant"],
            buckets=(0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),
            registry=self.registry,
        )
        self.shadow_latency_delta = Histogram(
            "xmcserve_shadow_latency_delta_seconds",
            "shadow minus primary latency per mirrored request",
            ["variant"],
            buckets=(-0.1, -0.03, -0.01, -0.003, 0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),
            registry=self.registry,
        )
        self.shadow_compared = Counter(
            "xmcserve_shadow_compared_texts", "Mirrored texts compared", ["variant"], registry=self.registry
        )
        self.shadow_dropped = Counter(
            "xmcserve_shadow_dropped",
            "Mirrored requests dropped, by reason",
            ["reason", "variant"],
            registry=self.registry,
        )
        self.shadow_worker_exits = Counter(
            "xmcserve_shadow_worker_exits",
            "Shadow worker processes that exited unasked (each restart waits longer while they keep exiting)",
            ["variant"],
            registry=self.registry,
        )

    def track(self, gauge, read: Callable[[], float]) -> None:
        """Export ``read()`` as the gauge's value: read at each scrape in one process; in a group
        (whose scrapes read the files) written by :meth:`sample_tracked`, which the app calls
        every :data:`SAMPLE_INTERVAL_S`."""
        if self.multiprocess_dir is None:
            gauge.set_function(read)
        else:
            self._sampled.append((gauge, read))

    def sample_tracked(self) -> None:
        for gauge, read in self._sampled:
            gauge.set(read())

    def exposition(self) -> bytes:
        """The text /metrics serves: this process's registry, or the group's files summed."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        return generate_latest(self.merged_registry()) + generate_latest(self.local_registry)

    def merged_registry(self) -> CollectorRegistry:
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=str(self.multiprocess_dir))
        return merged

    def merged(self, metric) -> object:
        """Something whose ``collect()`` gives ``metric``'s family as /metrics shows it (summed over
        the group's workers in a group): what the rollout page's live figures read."""
        if self.multiprocess_dir is None:
            return metric
        return _MergedFamily(self, metric._name)

    def retire(self) -> None:
        """This worker stops: its live gauges leave the group's sums."""
        if self.multiprocess_dir is not None:
            multiprocess.mark_process_dead(os.getpid(), str(self.multiprocess_dir))

    def forget_dead(self, alive: Callable[[int], bool]) -> list[int]:
        """The live gauges of workers that died without :meth:`retire` (killed) leave the sums
        (their counters and histograms stay: what they counted happened); returns their pids.
        A worker calls it as it starts, which is when the supervisor replaces a dead one."""
        if self.multiprocess_dir is None:
            return []
        dead = set()
        for file in Path(self.multiprocess_dir).glob("gauge_live*_*.db"):
            pid = int(file.stem.rsplit("_", 1)[1])
            if not alive(pid):
                dead.add(pid)
        for pid in dead:
            multiprocess.mark_process_dead(pid, str(self.multiprocess_dir))
        return sorted(dead)

    def child(self, metric, *values: str):
        """``metric.labels(*values)`` (values in the metric's label order), looked up once: the
        client's ``labels()`` checks and locks on every call, a cost paid several times a request."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def start_at_zero(self, variant: str) -> None:
        """Every outcome of the variant's event counters exported at 0 before its first event, so
        that a rate() or a dashboard panel has a series from the start (not only after a failure)."""
        for reason in ("client_gone", "deadline"):
            self.dropped_requests.labels(variant=variant, reason=reason)
        self.dropped_requests.labels(variant="-", reason="deadline")  # shed before routing
        for outcome in ("loaded", "refused"):
            self.reloads.labels(variant=variant, outcome=outcome)
        for outcome in ("applied", "repeated", "refused", "failed"):
            self.appends.labels(variant=variant, outcome=outcome)

    def drop_observer(self, variant: str):
        def observe(reason: str) -> None:
            self.child(self.dropped_requests, variant, reason).inc()

        return observe

    def batch_observer(self, variant: str):
        batch_texts = self.child(self.batch_texts, variant)

        def observe(texts: int, times) -> None:
            batch_texts.observe(texts)
            for stage, seconds in times.as_dict().items():
                self.child(self.stage_seconds, stage, variant).observe(seconds)

        return observe


class _AppendedKeys:
    """``xmcserve_appended_keys_total{variant,kind}``: the keys appended to the memory each variant
    serves, by kind (label, instance), as ``read()`` gives them (variant, labels, instances). It
    falls back when a variant loads a bundle that holds fewer (a compaction folds them in): a
    counter reset, as Prometheus's rate() and increase() take one."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, int, int]]]):
        self.read = read

    def collect(self):
        family = CounterMetricFamily(
            "xmcserve_appended_keys",
            "Keys appended to the memory each variant serves, by kind (label, instance): acknowledged, "
            "replayed from its log at load, or logged by another worker (as /info memory says)",
            labels=["variant", "kind"],
        )
        for variant, labels, instances in self.read():
            family.add_metric([variant, "label"], labels)
            family.add_metric([variant, "instance"], instances)
        yield family


class _MergedFamily:
    """One metric family read from the group's files (see :meth:`Metrics.merged`)."""

    def __init__(self, metrics: Metrics, name: str):
        self.metrics, self.name = metrics, name

    def collect(self):
        return [family for family in self.metrics.merged_registry().collect() if family.name == self.name]


# how often a worker of a group writes its tracked gauges (queue depth, batches in flight)
SAMPLE_INTERVAL_S = 0.5


class RequestObserver:
    """The front door's request metrics: requests in flight, and the latency histogram by route
    template (not raw path: bounded label cardinality), status and the variant that answered
    (``-`` for endpoints that do not predict)."""

    def __init__(self, metrics: Metrics, endpoints):
        self.metrics = metrics
        self.endpoints = endpoints  # () -> the app's route paths: a request refused before routing keeps its path

    def started(self) -> None:
        self.metrics.in_flight.inc()

    def finished(self, scope: dict, status: int, seconds: float) -> None:
        self.metrics.in_flight.dec()
        endpoint = getattr(scope.get("route"), "path", None)
        if endpoint is None:
            endpoint = scope["path"] if scope["path"] in self.endpoints() else "unmatched"
        variant = scope.get("state", {}).get("variant", "-")
        metrics = self.metrics
        metrics.child(metrics.request_seconds, endpoint, method_label(scope["method"]), str(status), variant).observe(
            seconds
        )
