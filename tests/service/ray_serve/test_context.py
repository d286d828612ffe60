"""The request id and the trace go with every part call, without a Ray cluster: the ingress's
routes over fake part handles that record what they were sent, and an encoder replica's batch
method called directly."""

import asyncio
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.observability.tracing import Tracing
from service.ray_serve.app import Encoder, Ingress
from service.ray_serve.calls import CallContext


class Answer:
    """A Serve ``DeploymentResponse`` stand-in: awaitable and cancellable."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        async def value():
            return self.value

        return value().__await__()

    def cancel(self) -> None:
        pass


class Method:
    def __init__(self, answer):
        self.answer = answer
        self.contexts: list[CallContext | None] = []

    def remote(self, work, timeout_s, context):
        self.contexts.append(context)
        return Answer(self.answer(work))


class Part:
    def __init__(self, **methods):
        for name, method in methods.items():
            setattr(self, name, method)


def traced() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


@pytest.fixture
def ingress_over_fakes(tiny_rae_bundle):
    """An ingress whose encoder answers unit vectors of the bundle and whose one shard answers
    for another bundle (so the request ends with a 503 after both were called, the shard call
    sent again until the deadline)."""
    holder = {}

    def vectors(texts):
        dim = holder["ingress"].manifest.dim
        return holder["ingress"].manifest.bundle_id, np.full((len(texts), dim), dim**-0.5, dtype=np.float32)

    encoder = Part(encode=Method(vectors))
    shard = Part(search=Method(lambda query: ("another-bundle", None)))
    ingress_class = Ingress.func_or_class.__bases__[0]  # the class under @serve.ingress's ASGI wrapper
    ingress = ingress_class(encoder, [shard], str(tiny_rae_bundle), False, 0.3, 64)
    holder["ingress"] = ingress
    return ingress, encoder.encode, shard.search


def test_every_part_call_carries_the_request_id_and_the_traceparent(ingress_over_fakes):
    ingress, encode, search = ingress_over_fakes
    ingress.tracing, exporter = traced()
    with TestClient(ingress.__serve_build_asgi_app__()) as client:
        answer = client.post("/predict", json={"text": "some text", "k": 3}, headers={"X-Request-Id": "ray-req-7"})
    assert answer.status_code == 503 and answer.headers["x-request-id"] == "ray-req-7"
    (sent_to_encoder,), sent_to_shard = encode.contexts, search.contexts[0]
    assert all(context == sent_to_shard for context in search.contexts)  # every send of the call carries it
    assert sent_to_encoder.request_id == sent_to_shard.request_id == "ray-req-7"
    server_span = next(s for s in exporter.get_finished_spans() if s.kind.name == "SERVER")
    trace_id = format(server_span.context.trace_id, "032x")
    assert sent_to_encoder.trace_headers["traceparent"].split("-")[1] == trace_id
    assert sent_to_shard.trace_headers == sent_to_encoder.trace_headers


def test_without_tracing_the_calls_carry_the_id_and_no_trace_headers(ingress_over_fakes):
    ingress, encode, _ = ingress_over_fakes
    assert not ingress.tracing.enabled  # no OTEL_* exporter configured in tests
    with TestClient(ingress.__serve_build_asgi_app__()) as client:
        answer = client.post("/predict", json={"text": "some text", "k": 3})
    (context,) = encode.contexts
    assert context.request_id == answer.headers["x-request-id"] and context.trace_headers == {}


def test_the_encoder_replica_continues_the_request_trace(tiny_rae_bundle):
    encoder = Encoder.func_or_class(str(tiny_rae_bundle), 1.0, 64, 0.0, False)
    encoder.tracing, exporter = traced()
    caller, _ = traced()
    with caller.tracer.start_as_current_span("ingress request") as request_span:
        headers = caller.headers()

    batch = Encoder.func_or_class.encode_batch.__wrapped__  # as @serve.batch hands it over, outside a replica
    deadline = time.monotonic() + 60
    work = [(["a text", "another"], deadline)]
    ((bundle_id, vectors),) = asyncio.run(batch(encoder, work, [CallContext("enc-1", headers)]))
    assert vectors.shape[0] == 2
    (span,) = exporter.get_finished_spans()
    assert span.name == "encode" and span.parent.span_id == request_span.get_span_context().span_id
    assert span.context.trace_id == request_span.get_span_context().trace_id
    assert [link.context.span_id for link in span.links] == [request_span.get_span_context().span_id]
