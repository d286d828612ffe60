"""Request ids and the access line, on a bare app behind the front door: ids accepted, generated,
returned on every answer (errors included), and the access line's fields."""

import logging

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from service.api.front_door import FrontDoorMiddleware
from service.observability.logs import RequestIdFilter
from service.observability.requests import AccessLog, accepted_request_id, refusal_reason


def app_with(access_log: AccessLog | None = AccessLog()) -> FastAPI:
    app = FastAPI()

    @app.get("/ok")
    async def ok(request: Request) -> dict:
        request.state.variant, request.state.texts = "A", 2
        logging.getLogger("xmcserve.test").info("inside the request")
        return {"ok": True}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("a bug")

    app.add_middleware(FrontDoorMiddleware, max_body_bytes=1000, body_timeout_s=5, access_log=access_log)
    return app


@pytest.mark.parametrize("given", [b"abc-123", b"0af7651916cd43dd8448eb211c80319c", b"a.b:c_d"])
def test_a_valid_client_id_is_kept(given):
    assert accepted_request_id(given) == given.decode()


@pytest.mark.parametrize("given", [None, b"", b"has space", b"x" * 129, b"new\nline", "é".encode()])
def test_a_missing_or_invalid_id_is_replaced_by_a_generated_one(given):
    generated = accepted_request_id(given)
    assert len(generated) == 32 and generated != accepted_request_id(given)


def test_the_id_comes_back_on_answers_refusals_and_errors_and_is_on_every_line(caplog):
    client = TestClient(app_with(), raise_server_exceptions=False)
    caplog.handler.addFilter(RequestIdFilter())  # as configure_logging's handler has it
    with caplog.at_level(logging.INFO):
        assert client.get("/ok", headers={"X-Request-Id": "r-1"}).headers["x-request-id"] == "r-1"
        missing = client.get("/missing", headers={"X-Request-Id": "r-2"})
        boom = client.get("/boom", headers={"X-Request-Id": "r-3"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "r-2"
    assert boom.status_code == 500 and boom.headers["x-request-id"] == "r-3"
    inside = next(r for r in caplog.records if r.getMessage() == "inside the request")
    access = {r.request_id: r for r in caplog.records if r.name == "xmcserve.access"}
    assert inside.request_id == "r-1"  # the filter on the configured handler reads the same context
    assert access["r-1"].status == 200 and access["r-1"].variant == "A" and access["r-1"].texts == 2
    assert access["r-2"].status == 404 and access["r-2"].reason == "Not Found"
    assert access["r-3"].status == 500 and access["r-3"].reason == "internal server error"
    assert access["r-3"].levelname == "WARNING"


def test_readable_access_lines_spell_out_the_fields(caplog):
    with caplog.at_level(logging.INFO):
        TestClient(app_with(AccessLog(readable=True))).get("/ok", headers={"X-Request-Id": "r-9"})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "xmcserve.access"]
    assert line.startswith("GET /ok 200 total_ms=") and "variant=A texts=2" in line


def test_no_access_line_when_turned_off(caplog):
    with caplog.at_level(logging.INFO):
        TestClient(app_with(None)).get("/ok")
    assert not [r for r in caplog.records if r.name == "xmcserve.access"]


def test_the_reason_of_a_validation_error_is_its_first_message():
    body = b'{"detail": [{"msg": "too short", "loc": ["body", "text"]}, {"msg": "x", "loc": []}]}'
    assert refusal_reason(body) == "too short at body.text (+1 more)"
    assert refusal_reason(b"not json") is None
