"""The front door on its own: refusals before the route (body cap, load shed), the body read
deadline, the request id on every answer, and the observer's view of each request."""

import asyncio
import json

import pytest

from service.api.body_guards import BodyRefused
from service.api.front_door import FrontDoorMiddleware
from service.http.guards import LoadShed


class Observer:
    def __init__(self):
        self.in_flight, self.seen = 0, []

    def started(self):
        self.in_flight += 1

    def finished(self, scope, status, seconds):
        self.in_flight -= 1
        self.seen.append((scope["path"], status))


async def body_app(scope, receive, send):
    """Reads the whole body, answers its length; a BodyRefused passes through as a route's parsing would."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def scope_of(path="/predict", method="POST", headers=()):
    return {"type": "http", "path": path, "method": method, "headers": list(headers)}


async def call(door, scope, chunks=(b"{}",), stall=False):
    """Sends ``chunks`` as the body (then blocks forever when ``stall``); returns (messages sent,
    chunks received)."""
    sent, handed = [], []

    async def receive():
        if len(handed) < len(chunks):
            handed.append(chunks[len(handed)])
            return {"type": "http.request", "body": handed[-1], "more_body": stall or len(handed) < len(chunks)}
        if stall:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await door(scope, receive, send)
    return sent, handed


def door_over(app=body_app, **options):
    return FrontDoorMiddleware(app, **{"max_body_bytes": 100, "body_timeout_s": 5.0, **options})


def status_and_detail(sent):
    return sent[0]["status"], json.loads(sent[-1]["body"])["detail"]


def test_a_declared_body_over_the_cap_is_refused_unread_with_the_request_id():
    observer = Observer()
    door = door_over(observer=observer)
    sent, handed = asyncio.run(call(door, scope_of(headers=[(b"content-length", b"101"), (b"x-request-id", b"r-1")])))
    status, detail = status_and_detail(sent)
    assert status == 413 and "100 byte limit" in detail and not handed
    assert (b"x-request-id", b"r-1") in sent[0]["headers"]
    assert observer.seen == [("/predict", 413)] and observer.in_flight == 0


def test_a_chunked_body_is_refused_at_the_first_chunk_over_the_cap():
    chunks = (b"x" * 60, b"x" * 60, b"x" * 60)
    sent, handed = asyncio.run(call(door_over(), scope_of(), chunks))
    assert status_and_detail(sent)[0] == 413 and len(handed) == 2


def test_a_body_at_the_cap_is_served():
    sent, _ = asyncio.run(call(door_over(), scope_of(), (b"x" * 50, b"x" * 50)))
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"100"


def test_a_stalled_body_is_answered_408_at_the_read_deadline():
    sent, handed = asyncio.run(asyncio.wait_for(call(door_over(body_timeout_s=0.05), scope_of(), stall=True), 10))
    status, detail = status_and_detail(sent)
    assert status == 408 and "0.05 s" in detail and len(handed) == 1


def test_after_the_body_a_receive_waits_for_the_disconnect_without_a_deadline():
    async def waits_for_disconnect(scope, receive, send):
        await receive()  # the whole body
        assert (await receive())["type"] == "http.disconnect"  # after the deadline has passed
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def late_disconnect():
        sent, given = [], []

        async def receive():
            if not given:
                given.append(1)
                return {"type": "http.request", "body": b"{}", "more_body": False}
            await asyncio.sleep(0.2)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await door_over(waits_for_disconnect, body_timeout_s=0.05)(scope_of(), receive, send)
        return sent

    assert asyncio.run(late_disconnect())[0]["status"] == 204


def test_an_overloaded_server_sheds_predict_before_reading_the_body():
    reached, shed = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await body_app(scope, receive, send)

    waits = {"now": 2.0}
    door = door_over(app, shed=LoadShed(lambda: waits["now"], deadline_s=1.0, on_shed=lambda: shed.append(1)))
    sent, handed = asyncio.run(call(door, scope_of()))
    status, detail = status_and_detail(sent)
    assert status == 503 and (b"retry-after", b"1") in sent[0]["headers"] and "deadline" in detail
    assert not handed and not reached and shed == [1]
    asyncio.run(call(door, scope_of("/healthz", "GET")))  # other routes are never shed
    # a body over the cap is refused as such, before the shed is asked
    sent, _ = asyncio.run(call(door, scope_of(headers=[(b"content-length", b"500")])))
    assert sent[0]["status"] == 413 and shed == [1]
    waits["now"] = 0.5
    asyncio.run(call(door, scope_of()))
    assert reached == ["/healthz", "/predict"]


def test_a_failing_route_gets_a_500_with_the_id_and_the_error_goes_on_to_the_server():
    async def broken(scope, receive, send):
        raise RuntimeError("a bug")

    observer = Observer()
    with pytest.raises(RuntimeError):
        asyncio.run(call(door_over(broken, observer=observer), scope_of(headers=[(b"x-request-id", b"r-5")])))
    assert observer.seen == [("/predict", 500)]


def test_a_refusal_raised_after_the_answer_started_is_not_answered_twice():
    async def starts_then_refuses(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise BodyRefused(413, "late")

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    with pytest.raises(BodyRefused):
        asyncio.run(door_over(starts_then_refuses)(scope_of(), receive, send))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
