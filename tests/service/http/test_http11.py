"""HTTP/1.1 on raw sockets through ``python -m service.http``'s protocol and the front door:
pipelined requests (with and without bodies, split anywhere) answered in order with only header
bytes counted as headers, refusals of a pipelined request answered after the requests before
it, ``Expect: 100-continue``, and every ``Content-Length`` or chunk size that is not a usable
number refused with a 4xx before the route, never a 500 or a traceback.

The route reads its body as ``/predict`` does (Starlette's ``Request.body``); the front door's
observer sees every request that reached the app, with the status it was given."""

import asyncio
import logging
import threading

import pytest
import uvicorn
from starlette.requests import Request
from uvicorn.server import ServerState

from service.api.front_door import FrontDoorMiddleware
from service.http.server import protocol_for
from service.http.settings import ServerSettings
from tests.service.http.raw_http import BAD_CHUNKS, BAD_CONTENT_LENGTHS, Connection, request, with_fields
from tests.service.http.test_server import serving
from tests.service.http.test_uvicorn_contract import Transport

MAX_BODY_BYTES = 65536
BODY = b"x" * 30_000  # over the header cap (16 KiB): counted as header bytes, it was refused with 431


# still_serving's probe: not observed, since its answer reaches the client before the front door
# records it, and a late record would land in the next test's list
PROBE = "/ok"


class Observer:
    """The front door's view: each request that reached it, with its final status (the probe's
    aside)."""

    def __init__(self):
        self.seen: list[tuple[str, int]] = []
        self.changed = threading.Condition()

    def started(self) -> None:
        pass

    def finished(self, scope, status, seconds) -> None:
        if scope["path"] == PROBE:
            return
        with self.changed:
            self.seen.append((scope["path"], status))
            self.changed.notify_all()

    def wait_for(self, count: int) -> list[tuple[str, int]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.seen) >= count, timeout=10), self.seen
            return list(self.seen)


class Served:
    def __init__(self):
        self.routes: list[str] = []  # paths whose route ran
        self.observer = Observer()

    async def route(self, scope, receive, send):
        self.routes.append(scope["path"])
        body = await Request(scope, receive).body()
        answer = b"%s %d" % (scope["path"].encode(), len(body))
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]}
        )
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def server():
    served = Served()
    front_door = FrontDoorMiddleware(
        served.route, max_body_bytes=MAX_BODY_BYTES, body_timeout_s=30, observer=served.observer
    )
    with serving(front_door, ServerSettings(header_timeout_s=30)) as (_, port):
        yield served, port


@pytest.fixture
def served(server, caplog):
    """(state, port) with the state cleared; the test fails on any error logged meanwhile (an
    exception in the app, a traceback)."""
    state, port = server
    state.routes.clear()
    state.observer.seen.clear()
    with caplog.at_level(logging.WARNING):
        yield state, port
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert not errors, [record.getMessage() for record in errors]


def texts(answers) -> list[tuple[int, bytes]]:
    return [(answer.status, answer.body) for answer in answers]


def still_serving(port: int) -> None:
    with Connection(port) as conn:
        conn.send(request("GET", PROBE))
        assert texts([conn.answer()]) == [(200, b"/ok 0")]


# pipelining


def test_a_body_and_the_start_of_the_next_requests_headers_in_one_write(served):
    """The chunk holds a 30 kB body and half of the next headers: only that half is headers."""
    state, port = served
    with Connection(port) as conn:
        conn.send(request("POST", "/a", BODY) + b"GET /b HTTP/1.1\r\nho")
        first = conn.answer()
        conn.send(b"st: test\r\n\r\n")
        assert texts([first, conn.answer()]) == [(200, b"/a 30000"), (200, b"/b 0")]
    assert state.routes == ["/a", "/b"]


def test_a_pipelined_requests_body_that_arrives_after_the_first_answer(served):
    """Nothing is reset by an answer: the second request's headers were complete before it."""
    state, port = served
    with Connection(port) as conn:
        conn.send(request("GET", "/a") + request("POST", "/b", None, ("content-length: 30000",)))
        first = conn.answer()
        conn.send(BODY)
        assert texts([first, conn.answer()]) == [(200, b"/a 0"), (200, b"/b 30000")]
        conn.send(request("GET", "/c"))  # and the connection goes on
        assert texts([conn.answer()]) == [(200, b"/c 0")]


def test_a_request_asking_for_an_upgrade_other_than_websocket_is_answered_and_the_connection_goes_on(served):
    """``Upgrade: h2c`` (curl --http2 sends it): answered as HTTP/1.1, as uvicorn does, and the
    requests after it on the connection too (the parse-ahead had stopped at it for good)."""
    state, port = served
    with Connection(port) as conn:
        conn.send(request("GET", "/a", None, ("connection: Upgrade, HTTP2-Settings", "upgrade: h2c")))
        first = conn.answer()
        conn.send(request("GET", "/b"))
        assert texts([first, conn.answer()]) == [(200, b"/a 0"), (200, b"/b 0")]
    assert state.routes == ["/a", "/b"]


def test_pipelined_requests_with_and_without_bodies_are_answered_in_order(served):
    state, port = served
    chunked = (
        b"POST /c HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    )
    with Connection(port) as conn:
        conn.send(request("GET", "/a") + request("POST", "/b", b"xyz") + chunked + request("POST", "/d", BODY))
        conn.send(request("GET", "/e"))
        answers = conn.answers(5)
    assert texts(answers) == [(200, b"/a 0"), (200, b"/b 3"), (200, b"/c 5"), (200, b"/d 30000"), (200, b"/e 0")]
    assert state.routes == ["/a", "/b", "/c", "/d", "/e"]


def test_a_chunked_body_of_many_chunks_then_the_start_of_the_next_headers(served):
    """30 kB of chunk framing around 5000 body bytes, then half of the next headers, in one
    write: the framing precedes the next request, it is not its headers."""
    state, port = served
    chunks = b"1\r\nz\r\n" * 5000 + b"0\r\nx-trailer: t\r\n\r\n"
    with Connection(port) as conn:
        conn.send(b"POST /a HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"GET /b HTTP/1")
        first = conn.answer()
        conn.send(b".1\r\nhost: test\r\n\r\n")
        assert texts([first, conn.answer()]) == [(200, b"/a 5000"), (200, b"/b 0")]


def test_endless_headers_after_a_pipelined_body_are_still_refused_after_its_answer(served):
    """The header cap still holds in the chunk a request begins in, after what precedes it."""
    state, port = served
    with Connection(port) as conn:
        conn.send(request("POST", "/a", BODY) + b"GET /b HTTP/1.1\r\nx-long: " + b"a" * 20_000)
        answers = conn.answers(2)
        assert conn.is_closed()
    assert [answer.status for answer in answers] == [200, 431] and answers[0].body == b"/a 30000"
    assert state.routes == ["/a"]


@pytest.mark.parametrize(
    ("second", "status"),
    [
        (b"POST /b HTTP/1.1\r\nhost: test\r\ncontent-length: -5\r\n\r\nabcde", 400),
        (b"GET /b HTTP/1.1\r\nhost: test\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
        (b"GET /b HTTP/1.1\r\nhost: test\r\nx-endless: " + b"a" * 20_000, 431),
        (b"POST /b HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400),
    ],
    ids=["bad-content-length", "headers-too-large", "endless-header", "bad-chunk-size"],
)
def test_a_refused_pipelined_request_is_answered_after_the_one_before_it(served, second, status):
    """The first request reached the app (it may have appended): its answer comes first, then
    the refusal, then the connection closes. The refused request never reaches the app."""
    state, port = served
    with Connection(port) as conn:
        conn.send(request("POST", "/a", b"appended") + second)
        answers = conn.answers(2)
        assert conn.is_closed()
    assert texts(answers[:1]) == [(200, b"/a 8")] and answers[1].status == status
    assert state.routes == ["/a"]


# Expect: 100-continue


def test_expect_100_continue_gets_continue_then_the_answer(served):
    state, port = served
    with Connection(port) as conn:
        conn.send(request("POST", "/a", None, ("content-length: 30000", "expect: 100-continue")))
        assert conn.answer().status == 100  # the client waits for it before sending the body
        conn.send(BODY)
        assert texts([conn.answer()]) == [(200, b"/a 30000")]


def test_expect_100_continue_on_a_pipelined_request(served):
    state, port = served
    with Connection(port) as conn:
        second = request("POST", "/b", None, ("content-length: 30000", "expect: 100-continue"))
        conn.send(request("GET", "/a") + second)
        assert texts([conn.answer()]) == [(200, b"/a 0")]
        assert conn.answer().status == 100
        conn.send(BODY)
        assert texts([conn.answer()]) == [(200, b"/b 30000")]


def test_expect_100_continue_with_a_body_over_the_cap_gets_413_and_no_continue(served):
    state, port = served
    with Connection(port) as conn:
        conn.send(request("POST", "/a", None, (f"content-length: {MAX_BODY_BYTES + 1}", "expect: 100-continue")))
        answer = conn.answer()
        assert answer.status == 413 and answer.closes
        assert conn.is_closed()
    assert state.routes == []


# Content-Length


@pytest.mark.parametrize("fields", BAD_CONTENT_LENGTHS.values(), ids=BAD_CONTENT_LENGTHS.keys())
def test_a_content_length_that_is_not_one_number_is_refused_before_the_app(served, fields):
    state, port = served
    with Connection(port) as conn:
        conn.send(with_fields("POST", "/a", fields, b"0123456789"))
        answer = conn.answer()
        assert answer.status == 400 and answer.closes, answer
        assert conn.is_closed()
    assert state.routes == []
    assert all(status == 400 for _, status in state.observer.seen)  # refused at the front door, or before it
    still_serving(port)


@pytest.mark.parametrize("value", [b"0005", b"5 "], ids=["leading-zeros", "trailing-space"])
def test_a_content_length_with_leading_zeros_or_spaces_is_a_number(served, value):
    state, port = served
    with Connection(port) as conn:
        conn.send(b"POST /a HTTP/1.1\r\nhost: test\r\ncontent-length: " + value + b"\r\n\r\nabcde")
        assert texts([conn.answer()]) == [(200, b"/a 5")]


# chunk sizes


@pytest.mark.parametrize("chunks", BAD_CHUNKS.values(), ids=BAD_CHUNKS.keys())
def test_a_malformed_chunk_size_is_400_and_the_route_sees_no_body(served, chunks):
    state, port = served
    with Connection(port) as conn:
        conn.send(with_fields("POST", "/a", [b"transfer-encoding: chunked"], chunks))
        answer = conn.answer()
        assert answer.status == 400 and answer.closes
        assert conn.is_closed()
    # the route had started (the headers were fine): its body read ends in a 400, not a 500
    assert state.observer.wait_for(1) == [("/a", 400)]
    still_serving(port)


def test_a_chunk_size_over_the_body_cap_is_413_at_the_first_byte_over(served):
    state, port = served
    with Connection(port) as conn:
        conn.send(b"POST /a HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\nfffffff\r\n")
        conn.send(b"y" * (MAX_BODY_BYTES + 1))
        answer = conn.answer()
        assert answer.status == 413 and answer.closes
    assert state.observer.wait_for(1) == [("/a", 413)]
    still_serving(port)


# header bytes: exactly those of the request, whatever framing and spacing the one before it had

CAP = ServerSettings().max_header_bytes
CHUNKED = b"POST /a HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\n"
PREVIOUS = {
    # (the request before, the answer it gets)
    "name-colon-value": (
        b"GET /a HTTP/1.1\r\nhost:test\r\n" + b"".join(b"x-h%d:v\r\n" % i for i in range(300)) + b"\r\n",
        b"/a 0",
    ),
    "spaces-around-values": (
        b"GET /a HTTP/1.1\r\nhost:    test  \r\n" + b"".join(b"x-h%d:    v   \r\n" % i for i in range(300)) + b"\r\n",
        b"/a 0",
    ),
    "chunk-sizes-with-leading-zeros": (CHUNKED + b"0000000001\r\nz\r\n" * 600 + b"0000\r\n\r\n", b"/a 600"),
    "chunk-extensions": (CHUNKED + b"1;name=value;x=y\r\nz\r\n" * 600 + b"0;end=1\r\n\r\n", b"/a 600"),
    "trailers": (
        CHUNKED + b"3\r\nabc\r\n0\r\n" + b"".join(b"x-t%d:   %d\r\n" % (i, i) for i in range(300)) + b"\r\n",
        b"/a 3",
    ),
    "empty-lines-after-it": (request("GET", "/a") + b"\r\n" * 300, b"/a 0"),
}


@pytest.mark.parametrize("previous", PREVIOUS.values(), ids=PREVIOUS.keys())
@pytest.mark.parametrize("over", [0, 1], ids=["at-the-cap", "one-byte-over"])
def test_only_the_requests_own_bytes_count_against_the_header_cap(served, previous, over):
    """The request before and the start of the next one's headers in one write: the next one's
    incomplete headers are exactly ``CAP + over`` bytes, so they are refused exactly when over the
    cap (the framing, spacing and empty lines before them counted as theirs gave a false 431; a
    byte rebuilt per header as ": " let headers over the cap through)."""
    state, port = served
    first, answer = previous
    start = b"GET /b HTTP/1.1\r\nhost: test\r\nx-long: "
    with Connection(port) as conn:
        conn.send(first + start + b"a" * (CAP + over - len(start)))
        assert texts([conn.answer()]) == [(200, answer)]
        if over:
            assert conn.answer().status == 431
            assert conn.is_closed()
        else:
            conn.send(b"\r\n\r\n")
            assert texts([conn.answer()]) == [(200, b"/b 0")]


async def _refused_after(stream: bytes, piece: int) -> bool:
    """Whether the protocol answers 431 once ``stream`` has come in writes of ``piece`` bytes."""
    config = uvicorn.Config(_answer, lifespan="off", log_level="warning")
    config.load()
    protocol = protocol_for(ServerSettings())(config, ServerState(), {}, _loop=asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    for start in range(0, len(stream), piece):
        protocol.data_received(stream[start : start + piece])
        await asyncio.sleep(0)
    for _ in range(100):  # bounded: the first answer, and a refusal after it, are a few loop turns away
        await asyncio.sleep(0)
    protocol.connection_lost(None)
    return b" 431 " in transport.written


async def _answer(scope, receive, send):
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 512, 100_000])
def test_the_header_count_is_exact_however_the_bytes_are_split(piece):
    """Delimiters (a chunk's size line, the end of headers or trailers) split across writes,
    and across the parser's slices, move nothing from one request's count to another's."""
    start = b"GET /b HTTP/1.1\r\nhost: test\r\nx-long: "
    for first, _ in PREVIOUS.values():
        stream = first + start + b"a" * (CAP - len(start))
        assert not asyncio.run(_refused_after(stream, piece)), first[:60]
        assert asyncio.run(_refused_after(stream + b"a", piece)), first[:60]
