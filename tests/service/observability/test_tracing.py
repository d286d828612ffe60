"""Tracing with the SDK's in-memory exporter: the request's span, its queue wait, the batch span
linked to the requests it served and its stages; and nothing at all when tracing is off."""

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.http.app import create_app
from service.http.settings import Settings
from service.observability.tracing import Tracing, exporter_configured, provider_from_environment

TEXT = {"text": "libc6: GNU C Library: Shared libraries", "k": 5}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def traced_client(tiny_rae_bundle):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with TestClient(create_app(Settings(bundle_dir=tiny_rae_bundle), Tracing(provider))) as client:
        yield client, exporter


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_on_only_when_the_environment_configures_an_exporter(env, on):
    assert exporter_configured(env) is on
    assert (provider_from_environment("xmcserve", env) is not None) is on


def test_off_means_no_tracer_and_no_spans():
    off = Tracing()
    assert not off.enabled and off.current() is None and off.trace_id() is None and off.headers() == {}
    off.queue_wait(0.0, 1.0)
    off.batch_observer("A")(1, None, 0.0, [None])
    with off.part_span("encode", [{"traceparent": TRACEPARENT}]):
        pass


def test_a_request_continues_the_callers_trace_with_queue_wait_and_a_linked_batch(traced_client):
    client, exporter = traced_client
    answer = client.post("/predict", json=TEXT, headers={"traceparent": TRACEPARENT})
    assert answer.status_code == 200
    spans = exporter.get_finished_spans()
    server = next(s for s in spans if s.kind.name == "SERVER")
    assert format(server.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert server.parent.span_id == 0xB7AD6B7169203331
    assert server.attributes["xmcserve.request_id"] == answer.headers["x-request-id"]
    assert not [s for s in spans if s.name.endswith(("http send", "http receive"))]
    (queue,) = [s for s in spans if s.name == "queue wait"]
    assert queue.parent.span_id == server.context.span_id and queue.end_time >= queue.start_time
    (batch,) = [s for s in spans if s.name == "batch"]
    assert [link.context.span_id for link in batch.links] == [server.context.span_id]
    assert batch.attributes["xmcserve.variant"] == "A" and batch.attributes["xmcserve.batch.texts"] == 1
    stages = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == batch.context.span_id}
    assert set(stages) == {"tokenize", "encode", "search", "aggregate"}
    assert all(batch.start_time <= s.start_time <= s.end_time <= batch.end_time for s in stages.values())
    assert stages["tokenize"].end_time <= stages["encode"].start_time + 1  # laid end to end (ns rounding)


def test_probes_are_not_traced(traced_client):
    client, exporter = traced_client
    exporter.clear()
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code == 200
    assert exporter.get_finished_spans() == ()
