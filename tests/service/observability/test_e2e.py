"""One request followed across processes: a primary mirroring every request to a shadow, both
logging JSON and exporting traces over OTLP/HTTP to a receiver on 127.0.0.1."""

import json
import time

import httpx
import pytest

from loadtest.localserver import start_server, stop_server
from tests.support.otlp_receiver import OtlpReceiver

TEXT = {"text": "libc6: GNU C Library: Shared libraries", "k": 5}


def unique_keys(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicated fields: {keys}"
    return dict(pairs)


def json_lines(log: str) -> list[dict]:
    """The log's JSON lines, each checked for a field given twice and for terminal escape codes."""
    lines = []
    for line in log.splitlines():
        if line.startswith("{"):
            assert "\x1b" not in line and "\\u001b" not in line, line
            lines.append(json.loads(line, object_pairs_hook=unique_keys))
    return lines


def access_lines(log: str) -> list[dict]:
    return [line for line in json_lines(log) if line.get("logger") == "xmcserve.access"]


def access_lines_when(server, wanted, attempts: int = 100) -> list[dict]:
    """``server``'s access lines for which ``wanted(line)`` holds, as soon as there are any. A line
    is written as its response completes, which the client can see first, and a shadow's copy
    leaves within the mirroring worker's batching wait: polled, at most ``attempts`` × 0.1 s."""
    for _ in range(attempts):
        found = [line for line in access_lines(server.log()) if wanted(line)]
        if found:
            return found
        time.sleep(0.1)
    return []


@pytest.fixture(scope="module")
def traced_pair(tiny_rae_bundle, tmp_path_factory):
    """(primary, shadow, receiver): the primary mirrors all of A's requests to the shadow."""
    logs = tmp_path_factory.mktemp("observability")
    with OtlpReceiver() as receiver:
        otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        # a log directory of its own: the primary serves the same bundle (one writer per log)
        own_logs = {"XMCSERVE_APPEND_LOG_DIR": str(logs / "shadow-appends")}
        shadow = start_server(tiny_rae_bundle, logs / "shadow.log", {**otel, "OTEL_SERVICE_NAME": "shadow", **own_logs})
        env = {
            **otel,
            "XMCSERVE_SHADOW_URL": shadow.url,
            "XMCSERVE_SHADOW_FRACTION": "1",
            "XMCSERVE_LOG_FORMAT": "json",
        }
        try:
            primary = start_server(tiny_rae_bundle, logs / "primary.log", env)
        except Exception:
            stop_server(shadow)
            raise
        yield primary, shadow, receiver
        stop_server(primary)
        stop_server(shadow)


def test_one_request_id_from_the_primary_access_line_to_the_shadow_access_line(traced_pair):
    primary, shadow, _ = traced_pair
    answer = httpx.post(f"{primary.url}/predict", json=TEXT, headers={"X-Request-Id": "follow-me-1"}, timeout=30)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "follow-me-1"
    mine = access_lines_when(primary, lambda line: line["request_id"] == "follow-me-1")
    assert len(mine) == 1
    line = mine[0]
    assert line["route"] == "/predict" and line["status"] == 200 and line["variant"] == "A"
    assert line["bundle_id"] == answer.json()["bundle_id"] and line["texts"] == 1 and line["k"] == 5
    assert line["queue_ms"] >= 0 and line["total_ms"] >= line["queue_ms"] and line["level"] == "INFO"
    assert "request_texts" not in line and TEXT["text"] not in primary.log()  # texts only with XMCSERVE_LOG_TEXTS

    (copy,) = access_lines_when(shadow, lambda line: "follow-me-1" in line.get("shadow_of", ""))
    assert copy["request_id"] == "follow-me-1" and copy["status"] == 200


def test_refusals_carry_the_request_id_and_their_reason(traced_pair):
    primary, _, _ = traced_pair
    bad = httpx.post(
        f"{primary.url}/predict", json={"text": "x", "k": 0}, headers={"X-Request-Id": "bad-1"}, timeout=30
    )
    assert bad.status_code == 422 and bad.headers["x-request-id"] == "bad-1"
    unknown = httpx.get(f"{primary.url}/nowhere", headers={"X-Request-Id": "bad id with spaces"}, timeout=30)
    assert unknown.status_code == 404 and len(unknown.headers["x-request-id"]) == 32  # generated instead
    (line,) = access_lines_when(primary, lambda line: line["request_id"] == "bad-1")
    assert line["status"] == 422 and "k" in line["reason"]


def test_lifecycle_lines_and_uvicorn_lines_are_json_with_the_same_fields(traced_pair):
    primary, _, _ = traced_pair
    lines = json_lines(primary.log())
    events = {line.get("event") for line in lines}
    assert {"bundle_loaded", "serving", "shadow_configured"} <= events
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # uvicorn's start lines, same format
    assert all({"time", "level", "logger", "request_id", "message"} <= line.keys() for line in lines)
    assert not [line for line in lines if "color_message" in line]  # uvicorn's coloured copy of its message


def test_the_trace_follows_the_request_into_the_shadow_and_the_batch(traced_pair):
    primary, _, receiver = traced_pair
    answer = httpx.post(f"{primary.url}/predict", json=TEXT, headers={"X-Request-Id": "traced-1"}, timeout=30)
    assert answer.status_code == 200
    (line,) = access_lines_when(primary, lambda line: line["request_id"] == "traced-1")
    trace_id = line["trace_id"]

    def complete(spans):
        names = {(s["service"], s["name"]) for s in spans if s["trace_id"] == trace_id}
        return {("xmcserve", "queue wait"), ("xmcserve", "batch")} <= names and any(svc == "shadow" for svc, _ in names)

    spans = [s for s in receiver.wait_for(complete) if s["trace_id"] == trace_id]
    batch = next(s for s in spans if s["name"] == "batch" and s["service"] == "xmcserve")
    stages = [s["name"] for s in spans if s["parent_span_id"] == batch["span_id"]]
    assert sorted(stages) == sorted(["tokenize", "encode", "handoff wait", "search", "aggregate", "loop wait"])
    server_spans = [s for s in spans if s["service"] == "shadow"]
    assert any(s["name"].startswith("POST /predict") for s in server_spans)
