"""OpenTelemetry tracing, off unless the standard ``OTEL_*`` variables configure an exporter.

On (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set, or
``OTEL_TRACES_EXPORTER=otlp|console``; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``
win): the SDK's tracer provider with a batch processor and the OTLP/HTTP exporter (endpoint,
headers, sampler and ``OTEL_SERVICE_NAME`` read by the SDK from the environment), and the
FastAPI instrumentation's server span per request, continuing an incoming W3C ``traceparent``.
Off: :class:`Tracing` has no tracer and every method returns at once (no spans, no SDK objects).

The micro-batcher measures its stages per batch; their spans are written when the batch is
answered, from the measured start and durations: a ``batch`` span, linked to the spans of the
requests it serves, with ``tokenize``, ``encode``, ``search`` and ``aggregate`` children, and per
request a ``queue wait`` child of the request's span.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanContext

# Routes probed every few seconds: tracing them would bury the requests in probe traces.
EXCLUDED_URLS = "healthz,readyz,metrics"


def exporter_configured(env=os.environ) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return exporter in ("otlp", "console") or any(
        env.get(name) for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def provider_from_environment(service_name: str, env=os.environ):
    """The SDK's tracer provider exporting as ``OTEL_*`` says, or None when tracing is off."""
    if not exporter_configured(env):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def epoch_ns(perf: float, now_perf: float, now_ns: int) -> int:
    """A ``time.perf_counter()`` reading as Unix nanoseconds (spans take wall-clock times)."""
    return now_ns - round((now_perf - perf) * 1e9)


class Tracing:
    """The front ends' tracing, on with a tracer provider (the SDK's, or a test's), off without."""

    def __init__(self, provider=None):
        self.provider = provider
        self.tracer = provider.get_tracer("xmcserve") if provider is not None else None

    @classmethod
    def from_environment(cls, service_name: str) -> Tracing:
        return cls(provider_from_environment(service_name))

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def instrument(self, app) -> None:
        """A server span per request (FastAPI's instrumentation), when on."""
        if self.enabled:
            from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

            FastAPIInstrumentor.instrument_app(
                app,
                tracer_provider=self.provider,
                excluded_urls=EXCLUDED_URLS,
                exclude_spans=["receive", "send"],  # a span per ASGI message: noise, and their cost per request
            )

    def shutdown(self) -> None:
        """Exports what is buffered (at the end of the process's lifespan)."""
        if self.enabled and hasattr(self.provider, "shutdown"):
            self.provider.shutdown()

    def current(self) -> SpanContext | None:
        """The current span's context (the request's), or None when off or outside a span."""
        if not self.enabled:
            return None
        context = trace.get_current_span().get_span_context()
        return context if context.is_valid else None

    def tag_request(self, request_id: str) -> None:
        """Names the request id on the current (request) span, so a trace is found by the id."""
        if self.enabled:
            trace.get_current_span().set_attribute("xmcserve.request_id", request_id)

    def trace_id(self) -> str | None:
        context = self.current()
        return None if context is None else format(context.trace_id, "032x")

    def headers(self) -> dict[str, str]:
        """The W3C ``traceparent`` (and ``tracestate``) of the current span, for a call onwards."""
        carrier: dict[str, str] = {}
        if self.enabled:
            propagate.inject(carrier)
        return carrier

    def queue_wait(self, enqueued: float, started: float) -> None:
        """A ``queue wait`` span under the current request span: from ``enqueued`` to ``started``
        (``time.perf_counter()`` readings)."""
        if self.current() is None:
            return
        now_perf, now_ns = time.perf_counter(), time.time_ns()
        span = self.tracer.start_span("queue wait", start_time=epoch_ns(enqueued, now_perf, now_ns))
        span.end(end_time=epoch_ns(started, now_perf, now_ns))

    def batch_observer(self, variant: str) -> Callable[[int, object, float, Sequence], None]:
        """The batcher's ``on_batch_done(texts, times, started, tags)``, where each request's tag
        is its span context: a ``batch`` span linked to them, with one child per stage. The stage
        spans are laid end to end from the batch's start, ``search`` and ``aggregate`` ending when
        the batch is answered (the hand-off between the encode and search threads is the gap)."""

        def observe(texts: int, times, started: float, tags: Sequence) -> None:
            if not self.enabled:
                return
            links = [Link(tag) for tag in tags if isinstance(tag, SpanContext)]
            if not links:
                return
            now_perf, now_ns = time.perf_counter(), time.time_ns()
            start = epoch_ns(started, now_perf, now_ns)
            attributes = {
                "xmcserve.variant": variant,
                "xmcserve.batch.texts": texts,
                "xmcserve.batch.requests": len(tags),
            }
            batch = self.tracer.start_span(
                "batch",
                context=trace.set_span_in_context(trace.INVALID_SPAN),
                links=links,
                start_time=start,
                attributes=attributes,
            )
            parent = trace.set_span_in_context(batch)
            search_start = now_ns - round((times.search + times.aggregate) * 1e9)
            stages = (
                ("tokenize", start, start + round(times.tokenize * 1e9)),
                ("encode", start + round(times.tokenize * 1e9), start + round((times.tokenize + times.encode) * 1e9)),
                ("search", search_start, search_start + round(times.search * 1e9)),
                ("aggregate", now_ns - round(times.aggregate * 1e9), now_ns),
            )
            for name, begin, end in stages:
                self.tracer.start_span(name, context=parent, start_time=begin).end(end_time=end)
            batch.end(end_time=now_ns)

        return observe

    @contextlib.contextmanager
    def part_span(
        self, name: str, carriers: Sequence[Mapping[str, str]], attributes: Mapping | None = None
    ) -> Iterator[None]:
        """A span around work done in another process for the requests whose trace headers are
        ``carriers`` (a Ray part's batch): the child of the first request's span, linked to every
        request's. Nothing when off or when no request is traced."""
        parents = (
            [trace.get_current_span(propagate.extract(c)).get_span_context() for c in carriers] if self.enabled else []
        )
        parents = [p for p in parents if p.is_valid]
        if not parents:
            yield
            return
        parent = trace.set_span_in_context(trace.NonRecordingSpan(parents[0]))
        links = [Link(p) for p in parents]
        attrs = {"xmcserve.batch.requests": len(carriers), **(attributes or {})}
        with self.tracer.start_as_current_span(name, context=parent, links=links, attributes=attrs):
            yield
