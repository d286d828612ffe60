"""OpenTelemetry tracing, off unless the standard ``OTEL_*`` variables configure an exporter.

On (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set, or
``OTEL_TRACES_EXPORTER=otlp|console``; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``
win): the SDK's tracer provider with a batch processor and the OTLP/HTTP exporter (endpoint,
headers, sampler and ``OTEL_SERVICE_NAME`` read by the SDK from the environment), and the
FastAPI instrumentation's server span per request, continuing an incoming W3C ``traceparent``.
Off: :class:`Tracing` has no tracer and every method returns at once (no spans, no SDK objects).
The server spans follow the stable HTTP conventions (``http.request.method``, ``url.path``,
``http.response.status_code``): ``OTEL_SEMCONV_STABILITY_OPT_IN=http`` unless set otherwise.

One trace per request: the micro-batcher records when each batch crossed each boundary between
its stages (:class:`~engine.batcher.BatchTimeline`), and the request's handler writes,
under its own span, a ``queue wait`` span, a ``batch`` span with one child per stage, and a
``respond`` span, end to end from those readings. A batch that served n requests appears in each
of their n traces (the same ``xmcserve.batch.id``); OpenTelemetry gives a span one parent, and a
trace that stops at the queue, the batch elsewhere behind a link, is one most backends do not
follow.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence

from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanContext

# Routes probed every few seconds: tracing them would bury the requests in probe traces.
EXCLUDED_URLS = "healthz,readyz,metrics"
# The instrumentation's server span reports the stable HTTP attributes only with this opt-in (read
# once per process, at the first instrumentation); the old ones (http.status_code) otherwise.
SEMCONV_OPT_IN = ("OTEL_SEMCONV_STABILITY_OPT_IN", "http")


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
            os.environ.setdefault(*SEMCONV_OPT_IN)  # an operator's own choice (http/dup) stands
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

    def batch_answered(self, answer, resumed: float, variant: str) -> None:
        """Called by a request's handler once its response is built from the batcher's ``answer``
        (a :class:`~engine.batcher.BatchAnswer`, got at ``resumed``): under the current
        request span, the request's ``queue wait``, its ``batch`` with the stages as children,
        and ``respond`` (the handler's work since: metrics, the shadow copy, the response body),
        laid end to end. Nothing when off or outside a request span."""
        if self.current() is None:
            return
        timeline, times = answer.timeline, answer.times
        now_perf, now_ns = time.perf_counter(), time.time_ns()

        def ns(perf: float) -> int:  # one reading for every span: boundaries shared by two spans agree
            return epoch_ns(perf, now_perf, now_ns)

        # Each boundary is one reading; the two inside a thread's stage (tokenize | encode, search |
        # aggregate) come from the measured durations, kept within that stage's own readings.
        tokenized = min(timeline.started + times.tokenize, timeline.encoded)
        aggregating = max(timeline.searched - times.aggregate, timeline.searching)
        boundaries = [
            ("tokenize", timeline.started, tokenized),
            ("encode", tokenized, timeline.encoded),
            ("handoff wait", timeline.encoded, timeline.searching),  # the search thread busy with the batch before
            ("search", timeline.searching, aggregating),
            ("aggregate", aggregating, timeline.searched),
            ("loop wait", timeline.searched, resumed),  # the answer waiting for the event loop to run the handler
        ]
        queued = timeline.started - answer.queue_wait_s
        self.tracer.start_span("queue wait", start_time=ns(queued)).end(end_time=ns(timeline.started))
        batch = self.tracer.start_span(
            "batch",
            start_time=ns(timeline.started),
            attributes={
                "xmcserve.variant": variant,
                "xmcserve.batch.id": timeline.number,
                "xmcserve.batch.requests": timeline.requests,
                "xmcserve.batch.texts": answer.batch_texts,
            },
        )
        parent = trace.set_span_in_context(batch)
        for name, begin, end in boundaries:
            self.tracer.start_span(name, context=parent, start_time=ns(begin)).end(end_time=ns(end))
        batch.end(end_time=ns(resumed))
        self.tracer.start_span("respond", start_time=ns(resumed)).end(end_time=now_ns)

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
