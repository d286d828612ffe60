"""Tracing with the SDK's in-memory exporter: one trace per request (its span, its queue wait, the
stages of the batch that served it, end to end); and nothing at all when tracing is off."""

import itertools

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
    off.batch_answered(None, 0.0, "A")  # returns before reading the answer
    with off.part_span("encode", [{"traceparent": TRACEPARENT}]):
        pass


STAGES = ["tokenize", "encode", "handoff wait", "search", "aggregate", "loop wait"]
MAX_GAP_NS = 1_000_000  # 1 ms


def children(spans, parent) -> list:
    return sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
        key=lambda s: s.start_time,
    )


def test_one_trace_holds_the_request_its_queue_wait_and_its_batch_stages_end_to_end(traced_client):
    client, exporter = traced_client
    answer = client.post("/predict", json=TEXT, headers={"traceparent": TRACEPARENT})
    assert answer.status_code == 200
    spans = exporter.get_finished_spans()
    # every span of the request in the caller's trace: no second trace for the batch
    assert {format(s.context.trace_id, "032x") for s in spans} == {"0af7651916cd43dd8448eb211c80319c"}
    (server,) = [s for s in spans if s.kind.name == "SERVER"]
    assert server.parent.span_id == 0xB7AD6B7169203331
    assert server.attributes["xmcserve.request_id"] == answer.headers["x-request-id"]
    assert not [s for s in spans if s.name.endswith(("http send", "http receive"))]
    # request -> queue wait, batch, respond; batch -> its stages in order
    queue, batch, respond = children(spans, server)
    assert (queue.name, batch.name, respond.name) == ("queue wait", "batch", "respond")
    stages = children(spans, batch)
    assert [s.name for s in stages] == STAGES
    assert batch.attributes["xmcserve.variant"] == "A" and batch.attributes["xmcserve.batch.texts"] == 1
    assert batch.attributes["xmcserve.batch.requests"] == 1 and batch.attributes["xmcserve.batch.id"] >= 1
    # end to end, inside the request's span, no gap between them longer than 1 ms
    chain = [queue, *stages, respond]
    assert server.start_time <= queue.start_time and respond.end_time <= server.end_time
    assert (batch.start_time, batch.end_time) == (stages[0].start_time, stages[-1].end_time)
    for before, after in itertools.pairwise(chain):
        assert 0 <= after.start_time - before.end_time <= MAX_GAP_NS, (before.name, after.name)
    assert all(s.start_time <= s.end_time for s in chain)
    assert stages[1].end_time - stages[1].start_time > 0  # the encoder ran


def test_the_server_span_uses_the_stable_http_conventions(traced_client):
    client, exporter = traced_client
    exporter.clear()
    assert client.post("/predict", json={"text": "x", "k": 0}).status_code == 422
    (server,) = [s for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]
    attributes = server.attributes
    assert attributes["http.request.method"] == "POST" and attributes["url.path"] == "/predict"
    assert attributes["http.response.status_code"] == 422 and attributes["http.route"] == "/predict"
    assert "http.status_code" not in attributes and "http.method" not in attributes


def test_probes_are_not_traced(traced_client):
    client, exporter = traced_client
    exporter.clear()
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code == 200
    assert exporter.get_finished_spans() == ()
