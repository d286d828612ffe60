"""Real servers: admin auth, reload (good, corrupt, escaping), A/B routing, promote, shadows that
are dead or slow never delaying the primary."""

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from bench.localserver import free_port, start_server, stop_server

TOKEN = "s3cret-token"
ADMIN = {"X-Admin-Token": TOKEN}
TEXT = {"text": "libc6: GNU C Library: Shared libraries", "k": 5}


@pytest.fixture(scope="module")
def server(bundle_root, tmp_path_factory):
    env = {"XMCSERVE_BUNDLE_ROOT": str(bundle_root), "XMCSERVE_ADMIN_TOKEN": TOKEN}
    srv = start_server(bundle_root / "tiny-rae", tmp_path_factory.mktemp("logs") / "ab.log", extra_env=env)
    yield srv
    stop_server(srv)


def post(server, path, body=None, headers=None):
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_admin_needs_the_token(server):
    assert post(server, "/admin/promote").status_code == 401
    assert post(server, "/admin/promote", headers={"X-Admin-Token": "wrong"}).status_code == 403
    assert httpx.get(f"{server.url}/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_admin_is_off_without_a_configured_token(tiny_rae_bundle, tmp_path):
    srv = start_server(tiny_rae_bundle, tmp_path / "noadmin.log")
    try:
        r = post(srv, "/admin/promote", headers={"X-Admin-Token": "anything"})
        assert r.status_code == 403 and "admin API disabled" in r.text
    finally:
        stop_server(srv)


def test_reload_ab_split_promote_flow(server):
    a_id = post(server, "/predict", TEXT).json()["bundle_id"]

    # a corrupt bundle is refused with the reason; A keeps answering
    bad = post(server, "/admin/reload", {"variant": "A", "bundle": "corrupt"}, ADMIN)
    assert bad.status_code == 422 and "checksum mismatch" in bad.text
    assert post(server, "/predict", TEXT).json()["bundle_id"] == a_id

    # paths may not leave the bundle root
    escape = post(server, "/admin/reload", {"variant": "B", "bundle": "../outside-bundle"}, ADMIN)
    assert escape.status_code == 400 and "outside the bundle root" in escape.text

    loaded = post(server, "/admin/reload", {"variant": "B", "bundle": "tiny-labels"}, ADMIN)
    assert loaded.status_code == 200, loaded.text
    b_id = loaded.json()["bundle_id"]
    assert b_id != a_id
    forced = post(server, "/predict", {**TEXT, "variant": "B"}).json()
    assert forced["variant"] == "B" and forced["bundle_id"] == b_id

    # split 30 %: sticky per key, about 30 % of keys on B
    state = post(server, "/admin/config", {"split_b": 0.3}, ADMIN).json()
    assert state["split_b"] == 0.3
    seen = {}
    for i in range(60):
        key = f"user-{i}"
        variants = {post(server, "/predict", TEXT, {"X-Request-Key": key}).json()["variant"] for _ in range(2)}
        assert len(variants) == 1  # sticky
        seen[key] = variants.pop()
    assert 0.1 < list(seen.values()).count("B") / len(seen) < 0.55

    promoted = post(server, "/admin/promote", headers=ADMIN).json()
    assert promoted["promoted_bundle_id"] == b_id and promoted["split_b"] == 0.0
    after = post(server, "/predict", TEXT).json()
    assert after["bundle_id"] == b_id and after["variant"] == "A"
    assert post(server, "/predict", {**TEXT, "variant": "B"}).status_code == 409  # B is empty now
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'xmcserve_reloads_total{outcome="refused",variant="A"} 1.0' in metrics
    assert 'variant="B"' in metrics


class SleepyShadow(BaseHTTPRequestHandler):
    """A shadow that answers /predict only after DELAY_S."""

    DELAY_S = 3.0

    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.DELAY_S)
        body = json.dumps({"results": [{"labels": []}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("shadow_kind", ["dead", "sleepy"])
def test_a_bad_shadow_never_delays_the_primary(tiny_rae_bundle, tmp_path, shadow_kind):
    httpd = None
    if shadow_kind == "sleepy":
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), SleepyShadow)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
    else:
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        "XMCSERVE_SHADOW_URL": url,
        "XMCSERVE_SHADOW_FRACTION": "1.0",
        "XMCSERVE_SHADOW_TIMEOUT_MS": "1000",
        "XMCSERVE_SHADOW_QUEUE": "4",
    }
    srv = start_server(tiny_rae_bundle, tmp_path / "shadow.log", extra_env=env)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            for _ in range(12):
                started = time.perf_counter()
                r = client.post("/predict", json=TEXT)
                elapsed = time.perf_counter() - started
                assert r.status_code == 200
                assert elapsed < SleepyShadow.DELAY_S / 3  # answered long before the shadow would
            time.sleep(1.5)  # let the shadow timeouts fire
            metrics = client.get("/metrics").text
        reason = "timeout" if shadow_kind == "sleepy" else "error"
        dropped = [line for line in metrics.splitlines() if line.startswith("xmcserve_shadow_dropped_total")]
        assert any(f'reason="{reason}"' in line and not line.endswith(" 0.0") for line in dropped), dropped
        if shadow_kind == "sleepy":
            assert any('reason="queue_full"' in line for line in dropped), dropped
    finally:
        stop_server(srv)
        if httpd:
            httpd.shutdown()


def test_in_process_shadow_compares_and_logs(bundle_root, tmp_path):
    log_path = tmp_path / "shadow.jsonl"
    env = {
        "XMCSERVE_CANDIDATE_BUNDLE_DIR": str(bundle_root / "tiny-labels"),
        "XMCSERVE_SHADOW_FRACTION": "1.0",
        "XMCSERVE_SHADOW_LOG": str(log_path),
        "XMCSERVE_SHADOW_TIMEOUT_MS": "20000",  # a loaded CI machine: the idle-class child may wait
    }
    srv = start_server(bundle_root / "tiny-rae", tmp_path / "inproc.log", extra_env=env)
    records = []
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            deadline = time.monotonic() + 60
            i = 0
            while len(records) < 4 and time.monotonic() < deadline:
                body = {"text": f"python3-module-{i}: a module", "k": 5}
                assert client.post("/predict", json=body).json()["variant"] == "A"
                i += 1
                time.sleep(0.2)
                if log_path.exists():
                    records = [json.loads(x) for x in log_path.read_text().splitlines()]
            metrics = client.get("/metrics").text
        assert len(records) >= 4 and all(0.0 <= r["overlap"] <= 1.0 for r in records)
        assert "xmcserve_shadow_overlap_count" in metrics
    finally:
        stop_server(srv)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_a_server_can_run_idle_class(bundle_root, tmp_path):
    env = {"XMCSERVE_CPU_PRIORITY": "idle"}
    srv = start_server(bundle_root / "tiny-rae", tmp_path / "idle.log", extra_env=env)
    try:
        info = httpx.get(f"{srv.url}/info", timeout=30).json()
        assert info["cpu_priority"] == "idle" and info["ort_spinning"] is False
        assert os.sched_getscheduler(srv.process.pid) == os.SCHED_IDLE
        threads = list(Path(f"/proc/{srv.process.pid}/task").iterdir())
        assert len(threads) > 1 and all(os.sched_getscheduler(int(t.name)) == os.SCHED_IDLE for t in threads)
        assert httpx.post(f"{srv.url}/predict", json=TEXT, timeout=30).status_code == 200
    finally:
        stop_server(srv)
