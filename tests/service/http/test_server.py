"""The uvicorn protocol of ``python -m service.http`` against real sockets on 127.0.0.1: a
client that never reads its answer is cut off after the write timeout with a reset, freeing
what the server and its kernel had buffered for it, while a client that reads gets the whole
answer; request headers over the size limit are refused with 431, however they arrive."""

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from service.http.server import uvicorn_options
from service.http.settings import ServerSettings

ANSWER_BYTES = 32 << 20  # far more than the kernel's socket buffers and the transport's high-water mark
WRITE_TIMEOUT_S = 0.5


async def large_answer(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(ANSWER_BYTES).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"x" * ANSWER_BYTES})


async def small_answer(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def serving(app, settings: ServerSettings):
    options = uvicorn_options(settings) | {"factory": False, "log_level": "warning"}
    config = uvicorn.Config(app, host="127.0.0.1", port=0, **options)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=asyncio.run, args=(srv.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield srv, srv.servers[0].sockets[0].getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.fixture
def server():
    with serving(large_answer, ServerSettings(write_timeout_s=WRITE_TIMEOUT_S, header_timeout_s=30)) as running:
        yield running


def ask(port: int, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
    return sock


def wait_until(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def kept_by_the_kernel(port: int) -> list[tuple[str, int]]:
    """(TCP state, bytes queued to send) of each socket the server's side still has on ``port``
    besides the listener (/proc/net/tcp: states in hex, 04 FIN-WAIT-1, 0A LISTEN)."""
    kept = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if int(local.rsplit(":", 1)[1], 16) == port and state != "0A":
                kept.append((state, int(queues.split(":")[0], 16)))
    return kept


def test_clients_that_never_read_are_cut_off_and_release_their_answers(server):
    srv, port = server
    idle = [ask(port, receive_buffer=4096) for _ in range(4)]
    try:
        assert wait_until(lambda: len(srv.server_state.connections) == 4, within_s=10)
        # held while the client reads nothing, and no longer than the write timeout (with slack
        # for a loaded machine): the buffered 32 MB answers go with the connections
        assert wait_until(lambda: not srv.server_state.connections, within_s=WRITE_TIMEOUT_S + 10)
        # reset, not closed: the kernel keeps nothing of the unread answers (a FIN would wait in
        # FIN-WAIT-1 behind them for as long as the client reads nothing, outside the connection cap)
        assert wait_until(lambda: not kept_by_the_kernel(port), within_s=10), kept_by_the_kernel(port)
        received = 0  # the client then reads at most what its kernel held, and the reset
        with pytest.raises(ConnectionResetError):
            while chunk := idle[0].recv(1 << 20):
                received += len(chunk)
        assert received < ANSWER_BYTES // 4
    finally:
        for sock in idle:
            sock.close()


def test_a_client_that_reads_gets_the_whole_answer(server):
    _, port = server
    with ask(port) as sock:
        received = 0
        while received < ANSWER_BYTES:
            chunk = sock.recv(1 << 20)
            assert chunk, f"connection closed after {received} bytes"
            received += len(chunk)
    assert received > ANSWER_BYTES  # the headers and the whole body


MAX_HEADER_BYTES = 2048


def exchange(port: int, chunks: list[bytes]) -> bytes:
    """Send ``chunks`` one by one, then read until the server closes or has answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # refused before the rest arrived
            time.sleep(0.01)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and answer.startswith(b"HTTP/1.1 200"):
                break
        return answer


@pytest.mark.parametrize(
    "chunks",
    [
        [b"GET / HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 4000 + b"\r\n\r\n"],  # one write, complete
        [b"GET / HTTP/1.1\r\nhost: t\r\n"] + [b"x-h%d: %s\r\n" % (i, b"b" * 200) for i in range(30)],  # never ends
        [b"GET /" + b"p" * 3000 + b" HTTP/1.1\r\nhost: t\r\n\r\n"],  # a long target
    ],
    ids=["one-large-header", "many-headers-trickled", "long-target"],
)
def test_headers_over_the_limit_are_refused_with_431(chunks):
    with serving(small_answer, ServerSettings(max_header_bytes=MAX_HEADER_BYTES, header_timeout_s=30)) as (_, port):
        answer = exchange(port, chunks)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        # headers within the limit, with a body far larger than the limit, are served
        body = b"x" * 50_000
        ok = exchange(port, [b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 50000\r\n\r\n" + body])
        assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
