"""How far ahead of its answers ``python -m service.http``'s protocol reads one connection: at
most ``XMCSERVE_PIPELINE_MAX_REQUESTS`` requests and ``XMCSERVE_PIPELINE_MAX_BYTES`` bytes are
parsed behind the one being answered, and none while the client reads no answers; the rest waits
in the socket (reading paused) and is answered, in order, once answers make room.

The server runs in this process, so the test looks at its connection's protocol directly: how
many requests it queued is a count, not a timing."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from service.http.settings import ServerSettings
from tests.conftest import wait_for
from tests.service.http.raw_http import Connection, request
from tests.service.http.test_server import serving

BIG_ANSWER = 16 << 20  # far more than the kernel's socket buffers and the transport's high-water mark


class App:
    """``/wait`` answers once the test opens the gate; ``/big`` answers BIG_ANSWER bytes; any
    other path answers its path and body length."""

    def __init__(self):
        self.gate = threading.Event()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        size, more = 0, True
        while more:
            message = await receive()
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        if scope["path"] == "/wait":
            await asyncio.to_thread(self.gate.wait, 30)
        answer = b"x" * BIG_ANSWER if scope["path"] == "/big" else b"%s %d" % (scope["path"].encode(), size)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]}
        )
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture
def served(request):
    """(app, server, port) for the ServerSettings the test is parametrized with (indirect)."""
    app = App()
    try:
        with serving(app, ServerSettings(header_timeout_s=30, **request.param)) as (srv, port):
            yield app, srv, port
    finally:
        app.gate.set()


def only_connection(srv):
    return wait_for(lambda: next(iter(srv.server_state.connections), None), limit_s=10)


def paths(answers) -> list[bytes]:
    return [answer.body.split(b" ")[0] for answer in answers]


@pytest.mark.parametrize("served", [{"pipeline_max_requests": 8}], indirect=True)
def test_no_more_requests_are_parsed_ahead_than_the_cap(served):
    app, srv, port = served
    following = [request("GET", f"/r{i}") for i in range(200)]
    with Connection(port) as conn:
        conn.send(request("GET", "/wait") + b"".join(following))  # one write: all of it is read at once
        protocol = only_connection(srv)
        wait_for(lambda: len(protocol.pipeline) >= 8, limit_s=10)
        assert len(protocol.pipeline) == 8  # the other 191 wait: in the socket, or read and held unparsed
        app.gate.set()
        answers = conn.answers(201)
    assert paths(answers) == [b"/wait"] + [f"/r{i}".encode() for i in range(200)]


@pytest.mark.parametrize("served", [{"pipeline_max_bytes": 16384}], indirect=True)
def test_no_more_bytes_are_parsed_ahead_than_the_cap(served):
    app, srv, port = served
    with Connection(port) as conn:
        conn.send(request("GET", "/wait") + b"".join(request("POST", f"/r{i}", b"b" * 3000) for i in range(50)))
        protocol = only_connection(srv)
        wait_for(lambda: len(protocol.pipeline) >= 5, limit_s=10)
        bodies = sum(len(cycle.body) for cycle, _ in protocol.pipeline)
        assert len(protocol.pipeline) <= 6 and bodies <= 16384, (len(protocol.pipeline), bodies)
        app.gate.set()
        answers = conn.answers(51)
    assert [answer.body for answer in answers[1:]] == [f"/r{i} 3000".encode() for i in range(50)]


@pytest.mark.parametrize("served", [{"pipeline_max_requests": 1000, "keep_alive_s": 1}], indirect=True)
def test_nothing_is_parsed_while_the_client_reads_no_answers(served):
    """The send buffer over its high-water mark (the client reads nothing): the requests that
    follow are held unparsed, however many the request cap would allow, and kept past the
    keep-alive timeout (the connection is not idle: its requests wait for the client to read)."""
    app, srv, port = served
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    with Connection(port, sock=sock) as conn:
        conn.send(request("GET", "/big"))
        protocol = only_connection(srv)
        wait_for(lambda: protocol.flow.write_paused, limit_s=10)
        following = b"".join(request("GET", f"/r{i}") for i in range(50))
        conn.send(following)
        # read: held unparsed (or, were it parsed, queued)
        wait_for(lambda: len(getattr(protocol, "_held", b"")) == len(following) or protocol.pipeline, limit_s=10)
        assert not protocol.pipeline and protocol.cycle.scope["path"] == "/big"
        time.sleep(2)  # past XMCSERVE_KEEP_ALIVE_S
        received = bytearray()  # the client reads again: the big answer, then one per request held
        while (end := received.find(b"\r\n\r\n")) < 0 or len(received) < end + 4 + BIG_ANSWER:
            chunk = sock.recv(1 << 20)
            assert chunk, f"closed after {len(received)} bytes"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        conn.buffer = bytes(received[end + 4 + BIG_ANSWER :])
        answers = conn.answers(50)
    assert paths(answers) == [f"/r{i}".encode() for i in range(50)]


@pytest.mark.parametrize("served", [{"pipeline_max_bytes": 16384}], indirect=True)
def test_a_nearly_full_pipeline_holds_the_next_headers_instead_of_feeding_them_a_byte_at_a_time(served):
    """A queued body that leaves a byte of room: the next request's headers (not counted until
    complete) were fed to the parser one byte a call, a parser call per byte on the event loop;
    now they wait whole for an answer to make room, and every request is answered in order."""
    app, srv, port = served
    header = ("x-pad: " + "p" * 8000).encode()
    queued = request("POST", "/b", b"b" * 100)
    with Connection(port) as conn:
        conn.send(request("GET", "/wait"))
        protocol = only_connection(srv)
        wait_for(lambda: protocol.cycle is not None and protocol.cycle.scope["path"] == "/wait", limit_s=10)
        slices = []
        feed_slice = protocol._feed_slice
        protocol._feed_slice = lambda piece: (slices.append(len(piece)), feed_slice(piece))
        # /b as the cap counts it (target, each header + 4, body), and one byte more
        protocol.pipeline_max_bytes = len("/b") + len("host") + len("test") + 4 + len("content-length100") + 4 + 100 + 1
        conn.send(queued + request("GET", "/c", None, (header.decode(),)))
        wait_for(lambda: len(protocol.pipeline) == 1 and protocol._held, limit_s=10)
        assert len(slices) < 20, f"{len(slices)} parser calls for one queued request and the next's headers"
        app.gate.set()
        answers = conn.answers(3)
    assert paths(answers) == [b"/wait", b"/b", b"/c"]
