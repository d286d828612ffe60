"""A real server (``python -m service.http`` on the tiny bundle) flooded with pipelined small
``/predict`` and ``GET /healthz`` requests on one connection by a client that reads none of the
answers: the server reads only as far as it answers, so its memory stays within 100 MB of idle
and another client's ``/healthz`` is answered meanwhile; once the flooding client reads, it gets
an answer to every request it sent, in order.

Before the protocol bounded what it parses ahead of its answers, 16 MiB of such requests were all
read and queued on the one connection (the issue measured 194 → 643 MB)."""

from __future__ import annotations

import bisect
import itertools
import json
import select
import socket
import threading
import time
from pathlib import Path

import pytest

from loadtest.localserver import start_server, stop_server
from tests.service.http.raw_http import Connection, request

FLOOD_BYTES = 16 << 20  # as much as the issue sent
FLOOD_S = 4.0  # the flood stops at its byte count, after this, or ...
STALL_S = 1.0  # ... once the server has read nothing for this long (it stopped reading: backpressure)
CLIENT_BUFFER = 64 << 10  # the flooding client's own socket buffers: what is held is the server's
RSS_SLACK_MB = 100
HEALTHZ_LIMIT_S = 0.100
PREDICT_EVERY = 20  # one /predict among this many requests
# Small requests, each one object the server would queue, but not so small that the kernel's
# buffers hold tens of thousands of them for the server to answer once the client reads.
PAD = "x-pad: " + "p" * 160


@pytest.fixture(scope="module")
def flood_server(tiny_rae_bundle, tmp_path_factory):
    server = start_server(tiny_rae_bundle, tmp_path_factory.mktemp("logs") / "flood.log")
    yield server
    stop_server(server)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def flood_requests() -> tuple[bytes, list[int], list[str]]:
    """Requests of ``FLOOD_BYTES`` in all, as one payload, with the offset each ends at and the
    request id each carries (the server returns it in ``x-request-id``)."""
    predict = json.dumps({"texts": ["libc6: GNU C Library: Shared libraries"], "k": 3}).encode()
    parts, ends, ids, total = [], [], [], 0
    for i in itertools.count():
        rid = f"r{i}"
        if i % PREDICT_EVERY == 0:
            part = request("POST", "/predict", predict, (f"x-request-id: {rid}", "content-type: application/json"))
        else:
            part = request("GET", "/healthz", None, (f"x-request-id: {rid}", PAD))
        parts.append(part)
        total += len(part)
        ends.append(total)
        ids.append(rid)
        if total >= FLOOD_BYTES:
            return b"".join(parts), ends, ids


class Sampler(threading.Thread):
    """Calls ``sample`` every ``every_s`` until stopped, keeping what it returns."""

    def __init__(self, sample, every_s: float):
        super().__init__(daemon=True)
        self.sample, self.every_s = sample, every_s
        self.values: list = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.values.append(self.sample())

    def stop(self) -> list:
        self.stopped.set()
        self.join(30)
        return self.values


def healthz_seconds(conn: Connection) -> float:
    started = time.monotonic()
    conn.send(request("GET", "/healthz"))
    assert conn.answer().status == 200
    return time.monotonic() - started


def flood(sock: socket.socket, payload: bytes) -> int:
    """Send as much of ``payload`` as the server takes, within the bounds above; the bytes sent."""
    sock.setblocking(False)
    view, sent = memoryview(payload), 0
    started = progressed = time.monotonic()
    while sent < len(payload) and time.monotonic() - started < FLOOD_S and time.monotonic() - progressed < STALL_S:
        _, writable, _ = select.select([], [sock], [], 0.05)
        if not writable:
            continue
        try:
            sent += sock.send(view[sent : sent + 65536])
        except BlockingIOError:
            continue
        progressed = time.monotonic()
    return sent


def test_a_pipelined_flood_from_a_client_that_does_not_read(flood_server):
    pid = flood_server.process.pid
    payload, ends, ids = flood_requests()
    port = int(flood_server.url.rsplit(":", 1)[1])
    with Connection(port) as probe:
        probe.send(payload[: ends[1]])  # warm: a /predict and a /healthz have run before idle is measured
        assert [answer.status for answer in probe.answers(2)] == [200, 200]
        idle = rss_mb(pid)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CLIENT_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_BUFFER)
        sock.connect(("127.0.0.1", port))
        with Connection(port, sock=sock) as flooding:
            memory = Sampler(lambda: rss_mb(pid), 0.02)
            latency = Sampler(lambda: healthz_seconds(probe), 0.05)
            memory.start()
            latency.start()
            try:
                sent = flood(sock, payload)
                time.sleep(STALL_S)  # what the server read is parsed by now
            finally:
                peak = max(memory.stop(), default=idle)
                waits = latency.stop()
            slowest_ms = max(waits, default=0) * 1000
            print(f"idle {idle:.0f} MB, peak {peak:.0f} MB, {sent} bytes taken, healthz max {slowest_ms:.1f} ms")
            assert peak - idle < RSS_SLACK_MB, (idle, peak, sent)
            assert waits and max(waits) < HEALTHZ_LIMIT_S, sorted(waits)[-5:]
            # the client finishes the request it was sending and reads: one answer per request, in order
            count = bisect.bisect_left(ends, sent) + 1  # the last request begun, whole or not
            # sent while the answers are read: the server takes the rest only as the client
            # reads answers (sent before reading, it could wait for reading that never came)
            sock.settimeout(60)
            sender = threading.Thread(target=sock.sendall, args=(payload[sent : ends[count - 1]],), daemon=True)
            sender.start()
            answers = flooding.answers(count)
            sender.join(60)
            assert not sender.is_alive(), "the rest of the last request was never taken"
    assert all(answer.status == 200 for answer in answers), {answer.status for answer in answers}
    assert [answer.headers[b"x-request-id"].decode() for answer in answers] == ids[:count]
