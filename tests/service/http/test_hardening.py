"""Hostile clients against a real server: every one is a clear, cheap refusal."""

import asyncio
import json
import re
import socket

import httpx
import pytest

from loadtest.localserver import start_server, stop_server

TOKEN = "hardening-token"
TEXT = "libc6: GNU C Library: Shared libraries"


@pytest.fixture(scope="module")
def server(tiny_rae_bundle, tmp_path_factory):
    env = {
        "XMCSERVE_ADMIN_TOKEN": TOKEN,
        "XMCSERVE_MAX_BODY_BYTES": "65536",
        "XMCSERVE_BODY_TIMEOUT_S": "1",
        "XMCSERVE_MAX_EXCLUDE_PER_TEXT": "50",
        "XMCSERVE_MAX_EXCLUDE_TOTAL": "80",
        "XMCSERVE_MAX_UID_BYTES": "32",
    }
    srv = start_server(tiny_rae_bundle, tmp_path_factory.mktemp("logs") / "hardening.log", extra_env=env)
    yield srv
    stop_server(srv)


def raw_exchange(server, request: bytes, limit_s: float = 30) -> tuple[int, dict]:
    """Send raw bytes on one connection and read the answer (status, JSON body)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=limit_s) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < content_length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


def content_length(data: bytes) -> int:
    match = re.search(rb"content-length: (\d+)", data.split(b"\r\n\r\n", 1)[0], re.I)
    return int(match.group(1)) if match else 0


def metric_lines(server, prefix: str) -> list[str]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return [line for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("path", ["/predict", "/admin/reload"])
def test_a_declared_huge_body_is_refused_unread_on_every_route(server, path):
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 300000000\r\n\r\n"
    status, body = raw_exchange(server, head.encode() + b'{"text": ')
    assert status == 413 and "XMCSERVE_MAX_BODY_BYTES" in body["detail"]


def test_a_chunked_body_is_refused_at_the_first_byte_over_the_cap(server):
    sent = []

    def chunks():
        for _ in range(2000):  # up to 2 MB offered; the server stops reading at 64 KiB
            sent.append(1)
            yield b" " * 1024

    r = httpx.post(f"{server.url}/predict", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "byte limit" in r.json()["detail"]


def test_a_stalled_upload_gets_408_and_leaves_nothing_in_flight(server):
    head = "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    status, body = raw_exchange(server, head.encode() + b'{"text": "li')
    assert status == 408 and "not received within" in body["detail"]
    in_flight = [line for line in metric_lines(server, "xmcserve_in_flight_requests ")]
    assert in_flight == ["xmcserve_in_flight_requests 1.0"]  # only the /metrics request itself


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"text": TEXT, "exclude": ["u"] * 51}, "limit per text is 50"),
        ({"texts": [TEXT, TEXT], "exclude": [["u"] * 45, ["v"] * 45]}, "90 uids in all; the limit is 80"),
        ({"text": TEXT, "exclude": ["x" * 33]}, "over 32 bytes"),
        ({"text": TEXT, "timeout_ms": 10**9}, "less than or equal"),
        (
            {"texts": [TEXT] * 64, "k": 1000},
            "64 texts x k 1000 = 64000 labels; the limit per response is 10000 (XMCSERVE_MAX_LABELS_PER_RESPONSE)",
        ),
    ],
)
def test_exclude_and_timeout_limits_are_422s_that_say_which(server, body, fragment):
    r = httpx.post(f"{server.url}/predict", json=body, timeout=30)
    assert r.status_code == 422 and fragment in r.text, r.text
    assert '"input"' not in r.text  # what was wrong and where, never the input itself


def test_an_answer_at_the_label_cap_is_served(server):
    """10 texts x k 1000: the cap itself, serialised off the event loop."""
    r = httpx.post(f"{server.url}/predict", json={"texts": [TEXT] * 10, "k": 1000}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    from service.api.schemas import INLINE_LABELS

    assert len(results) == 10 and sum(len(result["labels"]) for result in results) > INLINE_LABELS


@pytest.mark.parametrize(
    "raw",
    [
        b'{"text": "\\ud800"}',
        b'{"text": "ok", "exclude": ["\\udfff"]}',
        b'{"text": "ok", "\\ud800": 1}',
        b'{"texts": ["fine", "bad \\ud83d"]}',
    ],
)
def test_lone_surrogates_are_422_never_500(server, raw):
    r = httpx.post(f"{server.url}/predict", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 422, r.text
    r.json()  # the refusal itself is valid JSON


# Methods the HTTP parser knows (WebDAV, RTSP and others) but the app does not: they reach the
# app and must share one label. A made-up method (BREW0) never reaches it: the parser refuses it.
FOREIGN_METHODS = ("PROPFIND", "MKCOL", "LOCK", "UNLOCK", "REPORT", "PURGE", "LINK", "SEARCH")


def test_made_up_methods_and_paths_do_not_grow_the_metrics(server):
    async def flood():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for i in range(150):
                assert (await client.request(f"BREW{i}", "/predict")).status_code == 400
                await client.request(FOREIGN_METHODS[i % len(FOREIGN_METHODS)], "/predict")
                await client.get(f"/no/such/path/{i}")

    before = len(metric_lines(server, "xmcserve_request_duration_seconds_count"))
    asyncio.run(flood())
    after = metric_lines(server, "xmcserve_request_duration_seconds_count")
    assert len(after) <= before + 4, after  # OTHER and GET on "unmatched", with their statuses
    assert any('method="OTHER"' in line for line in after) and not any("BREW" in line for line in after)


def test_forcing_a_variant_needs_the_admin_token(server):
    url = f"{server.url}/predict"
    refused = httpx.post(url, json={"text": TEXT, "variant": "A"}, timeout=30)
    assert refused.status_code == 403 and "admin token" in refused.json()["detail"]
    wrong = httpx.post(url, json={"text": TEXT, "variant": "A"}, headers={"X-Admin-Token": "no"}, timeout=30)
    assert wrong.status_code == 403
    forced = httpx.post(url, json={"text": TEXT, "variant": "A"}, headers={"X-Admin-Token": TOKEN}, timeout=30)
    assert forced.status_code == 200 and forced.json()["variant"] == "A"


def test_the_server_still_answers_after_all_of_it(server):
    r = httpx.post(f"{server.url}/predict", json={"text": TEXT, "k": 3}, timeout=30)
    assert r.status_code == 200 and len(r.json()["results"][0]["labels"]) == 3
