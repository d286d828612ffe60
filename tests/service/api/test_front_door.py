"""The front door on its own: refusals before the route (body cap, load shed), the body read
deadline, the request id on every answer, and the observer's view of each request."""

import asyncio
import json

import pytest

from service.api.body_guards import BodyRefused
from service.api.front_door import BadContentLength, FrontDoorMiddleware, declared_length
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


async def call(door, scope, chunks=(b"{}",), stall=False, cut=False):
    """Sends ``chunks`` as the body (then blocks forever when ``stall``, or disconnects when
    ``cut``, the body unfinished); returns (messages sent, chunks received)."""
    sent, handed = [], []

    async def receive():
        if len(handed) < len(chunks):
            handed.append(chunks[len(handed)])
            more = stall or cut or len(handed) < len(chunks)
            return {"type": "http.request", "body": handed[-1], "more_body": more}
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


@pytest.mark.parametrize(
    ("values", "length"),
    [
        ([], None),
        ([b"0"], 0),
        ([b"0005"], 5),
        ([b" 5\t"], 5),  # optional whitespace around the value
        ([b"5", b"005"], 5),  # repeated, the same number
        ([b"5, 5"], 5),
        ([b"9" * 20], 10**20 - 1),
    ],
)
def test_a_content_length_is_read_as_one_number(values, length):
    assert declared_length([(b"host", b"x"), *((b"content-length", value) for value in values)]) == length


@pytest.mark.parametrize(
    "values",
    [
        [b"0" * 4998 + b"10"],  # int() alone raises ValueError past 4300 digits
        [b"1" * 21],
        [b"-5"],
        [b"+5"],
        [b""],
        [b"5 5"],
        [b"0x5"],
        ["\u0665".encode()],  # a digit, but not an ASCII one
        [b"5", b"6"],
        [b"5, 6"],
        [b"5,"],
    ],
)
def test_a_content_length_that_is_not_one_number_is_refused(values):
    with pytest.raises(BadContentLength):
        declared_length([(b"content-length", value) for value in values])


def test_a_content_length_that_is_not_one_number_is_400_before_the_route():
    observer = Observer()
    headers = [(b"content-length", b"0" * 5000), (b"x-request-id", b"r-2")]
    sent, handed = asyncio.run(call(door_over(observer=observer), scope_of(headers=headers)))
    status, detail = status_and_detail(sent)
    assert status == 400 and "Content-Length" in detail and not handed
    assert (b"connection", b"close") in sent[0]["headers"] and (b"x-request-id", b"r-2") in sent[0]["headers"]
    assert observer.seen == [("/predict", 400)]


def test_a_connection_that_ends_before_the_body_is_a_400_not_a_500():
    """The server's parser refused the rest of the body (a malformed chunk), or the client left:
    the route's body read gets a refusal, where Starlette would raise ClientDisconnect."""
    observer = Observer()
    sent, handed = asyncio.run(call(door_over(observer=observer), scope_of(), (b"{",), cut=True))
    assert status_and_detail(sent) == (400, "the connection ended before the request body did")
    assert observer.seen == [("/predict", 400)]


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
