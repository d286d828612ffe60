"""Real servers: admin auth, reload (good, corrupt, escaping), A/B routing, promote, shadows that
are dead or slow never delaying the primary."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from loadtest.localserver import free_port, start_server, stop_server
from tests.conftest import wait_for

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


def admin_routes(server) -> list[tuple[str, str]]:
    """(method, path) of every /admin route the live server documents."""
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    return [(method.upper(), path) for path, ops in paths.items() if path.startswith("/admin") for method in ops]


def test_every_admin_route_needs_the_token(server):
    routes = admin_routes(server)
    assert {path for _, path in routes} >= {"/admin/state", "/admin/reload", "/admin/promote", "/admin/config"}
    for method, path in routes:
        url = f"{server.url}{path}"
        assert httpx.request(method, url, timeout=30).status_code == 401, path
        assert httpx.request(method, url, headers={"X-Admin-Token": "wrong"}, timeout=30).status_code == 403, path
        bearer = httpx.request(method, url, headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert bearer.status_code == 403, path
    assert httpx.get(f"{server.url}/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_admin_is_off_without_a_configured_token(tiny_rae_bundle, tmp_path):
    srv = start_server(tiny_rae_bundle, tmp_path / "noadmin.log")
    try:
        for method, path in admin_routes(srv):
            r = httpx.request(method, f"{srv.url}{path}", headers={"X-Admin-Token": "anything"}, timeout=30)
            assert r.status_code == 403 and "admin API disabled" in r.text, path
    finally:
        stop_server(srv)


def test_reload_and_promote_under_concurrent_traffic_answer_every_request(bundle_root, tmp_path):
    """Clients keep posting while B is loaded, split, promoted and A reloaded twice: every answer
    is a 200 from one whole bundle."""
    env = {"XMCSERVE_BUNDLE_ROOT": str(bundle_root), "XMCSERVE_ADMIN_TOKEN": TOKEN}
    # a log directory of its own: the module's server holds the one beside tiny-rae (one writer per log)
    env["XMCSERVE_APPEND_LOG_DIR"] = str(tmp_path / "appends")
    srv = start_server(bundle_root / "tiny-rae", tmp_path / "swap.log", extra_env=env)
    done = threading.Event()
    answers: list[tuple[int, str | None]] = []

    def client_loop(worker: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            for i in range(2000):  # bounded; the swaps below end the loop much earlier
                if done.is_set():
                    return
                r = client.post("/predict", json=TEXT, headers={"X-Request-Key": f"{worker}-{i}"})
                answers.append((r.status_code, r.json().get("bundle_id") if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(3)]
    try:
        for thread in threads:
            thread.start()
        steps = [
            ("/admin/reload", {"variant": "B", "bundle": "tiny-labels"}),
            ("/admin/config", {"split_b": 0.5}),
            ("/admin/promote", None),
            ("/admin/reload", {"variant": "A", "bundle": "tiny-rae"}),
            ("/admin/reload", {"variant": "A", "bundle": "tiny-labels"}),
        ]
        for path, body in steps:
            before = len(answers)
            r = post(srv, path, body, ADMIN)
            assert r.status_code == 200, (path, r.text)
            wait_for(lambda before=before: len(answers) >= before + 5)  # traffic ran across each swap
    finally:
        done.set()
        for thread in threads:
            thread.join(60)
        stop_server(srv)
    statuses = [status for status, _ in answers]
    assert len(answers) >= 25 and set(statuses) == {200}, [a for a in answers if a[0] != 200][:3]
    assert len({bundle for _, bundle in answers}) == 2  # both bundles answered, nothing else


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
    forced = post(server, "/predict", {**TEXT, "variant": "B"}, ADMIN).json()
    assert forced["variant"] == "B" and forced["bundle_id"] == b_id

    # split 30 %: sticky per key, about 30 % of keys on B
    state = post(server, "/admin/config", {"split_b": 0.3}, ADMIN).json()
    assert state["split_b"] == 0.3
    # mirroring without a shadow is refused whole: the split beside it is not applied either
    refused = post(server, "/admin/config", {"split_b": 0.9, "shadow_fraction": 0.5}, ADMIN)
    assert refused.status_code == 409 and "no shadow configured" in refused.text
    assert httpx.get(f"{server.url}/admin/state", headers=ADMIN).json()["split_b"] == 0.3
    # forcing a variant is an operator's call: 403 without the token, whatever the missing token's 401 elsewhere
    unforced = post(server, "/predict", {**TEXT, "variant": "B"})
    assert unforced.status_code == 403 and "forcing a variant needs the admin token" in unforced.text
    seen = {}
    for i in range(60):
        key = f"user-{i}"
        variants = {post(server, "/predict", TEXT, {"X-Request-Key": key}).json()["variant"] for _ in range(2)}
        assert len(variants) == 1  # sticky
        seen[key] = variants.pop()
    assert 0.1 < list(seen.values()).count("B") / len(seen) < 0.55

    nothing_to_undo = post(server, "/admin/rollback", headers=ADMIN)
    assert nothing_to_undo.status_code == 409 and "no previous A bundle" in nothing_to_undo.text

    promoted = post(server, "/admin/promote", headers=ADMIN).json()
    assert promoted["promoted_bundle_id"] == b_id and promoted["split_b"] == 0.0
    after = post(server, "/predict", TEXT).json()
    assert after["bundle_id"] == b_id and after["variant"] == "A"
    assert post(server, "/predict", {**TEXT, "variant": "B"}, ADMIN).status_code == 409  # B is empty now

    # every slot shows a path /admin/reload takes; the previous A is kept loaded for a rollback
    state = httpx.get(f"{server.url}/admin/state", headers=ADMIN).json()
    assert state["variants"]["A"]["bundle"] == "tiny-labels" and state["variants"]["B"]["bundle"] is None
    assert state["previous"] == {"bundle_id": a_id, "source": state["previous"]["source"], "bundle": "tiny-rae"}
    back = post(server, "/admin/rollback", headers=ADMIN)
    assert back.status_code == 200, back.text
    assert back.json()["restored_bundle_id"] == a_id and back.json()["previous"]["bundle_id"] == b_id
    assert post(server, "/predict", TEXT).json()["bundle_id"] == a_id
    again = post(server, "/admin/rollback", headers=ADMIN).json()  # a second rollback undoes the first
    assert again["restored_bundle_id"] == b_id and post(server, "/predict", TEXT).json()["bundle_id"] == b_id
    reloaded = post(server, "/admin/reload", {"variant": "A", "bundle": again["previous"]["bundle"]}, ADMIN)
    assert reloaded.status_code == 200 and reloaded.json()["bundle_id"] == a_id  # reloadable by that path
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'xmcserve_reloads_total{outcome="refused",variant="A"} 1.0' in metrics
    assert 'variant="B"' in metrics


class HangingShadow(BaseHTTPRequestHandler):
    """A shadow that answers /predict only once ``release`` is set (the test sets it at the end)."""

    release = threading.Event()

    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.release.wait(60)
        body = json.dumps({"results": [{"labels": []}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def dropped_counts(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("xmcserve_shadow_dropped_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("shadow_kind", ["dead", "hanging"])
def test_a_bad_shadow_never_delays_the_primary(tiny_rae_bundle, tmp_path, shadow_kind):
    """Every primary answer comes back while the hanging shadow still holds its first call: the
    primary never waited for it; the copies are dropped and counted."""
    httpd = None
    HangingShadow.release = threading.Event()
    if shadow_kind == "hanging":
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), HangingShadow)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
    else:
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        "XMCSERVE_SHADOW_URL": url,
        "XMCSERVE_SHADOW_FRACTION": "1.0",
        # hanging: copies expire while the shadow holds them; dead: long enough that the refused
        # connection, not the deadline, settles them
        "XMCSERVE_SHADOW_TIMEOUT_MS": "500" if shadow_kind == "hanging" else "30000",
        "XMCSERVE_SHADOW_QUEUE": "4",
    }
    srv = start_server(tiny_rae_bundle, tmp_path / "shadow.log", extra_env=env)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            for _ in range(12):
                assert client.post("/predict", json=TEXT).status_code == 200
            assert not HangingShadow.release.is_set()
            reason = "timeout" if shadow_kind == "hanging" else "error"
            dropped = wait_for(lambda: (d := dropped_counts(client)).get(reason) and d)
            if shadow_kind == "hanging":
                assert dropped.get("queue_full", 0) > 0, dropped
            assert client.get("/readyz").status_code == 200
    finally:
        HangingShadow.release.set()
        stop_server(srv)
        if httpd:
            httpd.shutdown()


def test_a_remote_xmcserve_shadow_compares_and_logs(bundle_root, tmp_path):
    log_path = tmp_path / "shadow.jsonl"
    # its own log directory: the module's server may hold tiny-labels' default one (loaded into B)
    own_logs = {"XMCSERVE_APPEND_LOG_DIR": str(tmp_path / "shadow-appends")}
    shadow = start_server(bundle_root / "tiny-labels", tmp_path / "shadow-server.log", extra_env=own_logs)
    env = {
        "XMCSERVE_SHADOW_URL": shadow.url,
        "XMCSERVE_SHADOW_FRACTION": "1.0",
        "XMCSERVE_SHADOW_LOG": str(log_path),
        "XMCSERVE_SHADOW_TIMEOUT_MS": "20000",
        "XMCSERVE_APPEND_LOG_DIR": str(tmp_path / "appends"),  # the module's server holds the default one
    }
    srv = start_server(bundle_root / "tiny-rae", tmp_path / "primary.log", extra_env=env)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            for i in range(6):
                body = {"text": f"python3-module-{i}: a module", "k": 5}
                assert client.post("/predict", json=body).json()["variant"] == "A"

            def logged():
                lines = log_path.read_text().splitlines() if log_path.exists() else []
                return [json.loads(x) for x in lines] if len(lines) >= 6 else None

            records = wait_for(logged)
            metrics = client.get("/metrics").text
            info = client.get("/info").json()
        assert all(0.0 <= r["overlap"] <= 1.0 and r["target"] == shadow.url for r in records)
        assert 'xmcserve_shadow_compared_texts_total{variant="A"} 6.0' in metrics
        assert info["routing"]["shadow"]["target"] == shadow.url
    finally:
        stop_server(srv)
        stop_server(shadow)
