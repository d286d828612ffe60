"""Faults around a serving process: its bundle deleted or overwritten under it, SIGTERM with a
full queue or with a request on its way, connections that never send a request."""

import asyncio
import shutil
import signal
import socket
import time

import httpx
import pytest

from bundle.manifest import INDEX_FILE, LABELS_FILE
from loadtest.localserver import start_server, stop_server

TOKEN = "faults-token"
TEXT = {"text": "libc6: GNU C Library: Shared libraries", "k": 5}


@pytest.fixture
def own_bundle(tiny_rae_bundle, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(tiny_rae_bundle, root / "live")
    return root


def test_a_deleted_bundle_directory_keeps_serving_and_its_reload_fails_cleanly(own_bundle, tmp_path):
    env = {"XMCSERVE_BUNDLE_ROOT": str(own_bundle), "XMCSERVE_ADMIN_TOKEN": TOKEN}
    srv = start_server(own_bundle / "live", tmp_path / "deleted.log", extra_env=env)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            before = client.post("/predict", json=TEXT).json()
            shutil.rmtree(own_bundle / "live")
            for _ in range(5):
                after = client.post("/predict", json=TEXT)
                assert after.status_code == 200 and after.json()["results"] == before["results"]
            admin = {"X-Admin-Token": TOKEN}
            reload = client.post("/admin/reload", json={"variant": "A", "bundle": "live"}, headers=admin)
            assert reload.status_code == 422 and "no manifest.json" in reload.json()["detail"]
            assert client.post("/predict", json=TEXT).json()["bundle_id"] == before["bundle_id"]
    finally:
        stop_server(srv)


def test_bundle_files_overwritten_under_a_running_server_do_not_change_its_answers(own_bundle, tmp_path):
    srv = start_server(own_bundle / "live", tmp_path / "overwritten.log")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            before = client.post("/predict", json=TEXT).json()
            for name in (LABELS_FILE, INDEX_FILE):
                (own_bundle / "live" / name).write_bytes(b"\x00garbage" * 100)
            assert client.post("/predict", json=TEXT).json() == before
    finally:
        stop_server(srv)


def test_sigterm_with_a_full_queue_answers_or_refuses_every_request(tiny_rae_bundle, tmp_path):
    """Every request in flight at SIGTERM ends: answered, refused with 503, or its connection
    closed; none is left waiting."""
    env = {"XMCSERVE_MAX_BATCH_SIZE": "1", "XMCSERVE_MAX_QUEUE": "256", "XMCSERVE_GRACEFUL_SHUTDOWN_S": "3"}
    srv = start_server(tiny_rae_bundle, tmp_path / "sigterm.log", extra_env=env)
    body = {"texts": [TEXT["text"]] * 32, "k": 5, "timeout_ms": 1000}

    async def flood():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:

            async def one():
                try:
                    return (await client.post("/predict", json=body)).status_code
                except httpx.TransportError as exc:  # closed or refused once the server stopped
                    return type(exc).__name__

            tasks = [asyncio.create_task(one()) for _ in range(60)]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # the queue is full by now
            srv.process.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    try:
        outcomes = asyncio.run(flood())
        srv.process.wait(60)  # uvicorn re-raises SIGTERM after its graceful shutdown: exit code -15
        assert "Application shutdown complete" in srv.log(), srv.log()[-2000:]
    finally:
        stop_server(srv)
    assert "ReadTimeout" not in outcomes and "PoolTimeout" not in outcomes
    assert set(outcomes) <= {200, 503, "RemoteProtocolError", "ConnectError", "ReadError"}, outcomes
    assert outcomes.count(200) >= 1


def test_a_connection_that_sends_no_request_is_closed_after_the_header_timeout(tiny_rae_bundle, tmp_path):
    srv = start_server(tiny_rae_bundle, tmp_path / "headers.log", extra_env={"XMCSERVE_HEADER_TIMEOUT_S": "0.5"})
    host, port = srv.url.removeprefix("http://").split(":")
    try:
        with (
            socket.create_connection((host, int(port)), timeout=30) as idle,
            socket.create_connection((host, int(port)), timeout=30) as slow,
        ):
            slow.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\n")  # headers that never end
            assert idle.recv(1) == b"" and slow.recv(1) == b""  # the server closed both (not the 30 s timeout)
        assert httpx.post(f"{srv.url}/predict", json=TEXT, timeout=30).status_code == 200
    finally:
        stop_server(srv)


def test_a_request_sent_just_after_sigterm_on_an_open_connection_is_answered_not_reset(tiny_rae_bundle, tmp_path):
    """A connection accepted before SIGTERM whose request comes after it: answered with
    ``connection: close`` within the drain grace, not closed under the client (a reset)."""
    srv = start_server(tiny_rae_bundle, tmp_path / "drain.log")
    host, port = srv.url.removeprefix("http://").split(":")
    body = b'{"text": "libc6", "k": 3}'
    request = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    request += b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    try:
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            # the server has accepted it once a request on another connection is answered
            assert httpx.post(f"{srv.url}/predict", json=TEXT, timeout=30).status_code == 200
            srv.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while "Shutting down" not in srv.log() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert "Shutting down" in srv.log(), srv.log()[-2000:]
            conn.sendall(request)
            answer = b""
            while chunk := conn.recv(65536):  # read to the close: the server ends the connection
                answer += chunk
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 200") and b"connection: close" in head, answer[:500]
        srv.process.wait(60)
        assert "Application shutdown complete" in srv.log(), srv.log()[-2000:]
    finally:
        stop_server(srv)
