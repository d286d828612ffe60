"""POST /admin/append on a real server: refusals before any work, the next /predict sees the
append, /info and the metrics count it, traffic during appends and reloads gets only 200s, a
restarted server serves the same memory from its log, and a pipelined append is acknowledged."""

import json
import shutil
import threading
import time

import httpx
import pytest

from loadtest.localserver import start_server, stop_server
from tests.service.http.raw_http import Connection, request

TOKEN = "append-token"
ADMIN = {"X-Admin-Token": TOKEN}
NEW = {
    "labels": [{"uid": "zz-new-label", "text": "zz-new-label: a package published after the build"}],
    "instances": [{"text": "zz-new-tool: a tool that needs the new label", "labels": ["zz-new-label"]}],
}


def start(bundle_root, appends_dir, log_path):
    env = {
        "XMCSERVE_BUNDLE_ROOT": str(bundle_root),
        "XMCSERVE_ADMIN_TOKEN": TOKEN,
        "XMCSERVE_APPEND_LOG_DIR": str(appends_dir),
        "XMCSERVE_MAX_APPEND_ITEMS": "50",
    }
    return start_server(bundle_root / "tiny-rae", log_path, extra_env=env)


@pytest.fixture(scope="module")
def appends_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("appends")


@pytest.fixture(scope="module")
def server(bundle_root, appends_dir, tmp_path_factory):
    srv = start(bundle_root, appends_dir, tmp_path_factory.mktemp("logs") / "append.log")
    yield srv
    stop_server(srv)


def top_uids(client: httpx.Client, text: str, k: int = 5) -> list[str]:
    r = client.post("/predict", json={"text": text, "k": k})
    assert r.status_code == 200, r.text
    return [label["uid"] for label in r.json()["results"][0]["labels"]]


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({"instances": [{"text": "a tool", "labels": ["no-such-uid"]}]}, 422, "unknown label uids"),
        ({"labels": [{"uid": "libc6", "text": "libc6 again"}]}, 422, "already exists"),
        ({"labels": [NEW["labels"][0], NEW["labels"][0]]}, 422, "given twice"),
        ({"labels": [{"uid": "fresh", "text": "  "}]}, 422, "empty"),
        ({"instances": [{"text": "a tool", "labels": []}]}, 422, "at least 1"),
        ({}, 422, "nothing to append"),
        ({"labels": [{"uid": f"u{i}", "text": f"label {i}"} for i in range(51)]}, 422, "at most 50"),
        ({"labels": [], "extra": 1}, 422, "extra"),
    ],
)
def test_bad_appends_get_a_4xx_and_change_nothing(server, body, status, reason):
    r = httpx.post(f"{server.url}/admin/append", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == status and reason in r.text, r.text
    memory = httpx.get(f"{server.url}/info", timeout=30).json()["routing"]["variants"]["A"]["memory"]
    assert memory["version"] == 0


def test_an_append_is_served_counted_and_survives_a_restart(server, bundle_root, appends_dir, tmp_path):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert "zz-new-label" not in top_uids(client, NEW["instances"][0]["text"])
        r = client.post("/admin/append", json={**NEW, "append_id": "first"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["version"] == 1 and answer["repeated"] is False and answer["instances"] == 1
        assert top_uids(client, NEW["instances"][0]["text"])[0] == "zz-new-label"
        again = client.post("/admin/append", json={**NEW, "append_id": "first"}, headers=ADMIN).json()
        assert again["repeated"] is True and again["version"] == 1
        memory = client.get("/info").json()["routing"]["variants"]["A"]["memory"]
        assert memory["version"] == 1 and memory["appended_labels"] == 1 and memory["appended_instances"] == 1
        metrics = client.get("/metrics").text
        assert 'xmcserve_appends_total{outcome="applied",variant="A"} 1.0' in metrics
        assert 'xmcserve_appended_keys_total{kind="instance",variant="A"} 1.0' in metrics
        expected = top_uids(client, NEW["instances"][0]["text"], k=10)
    # the module's server still holds its log (one writer per log): the restart reads a copy of it
    restarted = start(bundle_root, shutil.copytree(appends_dir, tmp_path / "appends"), tmp_path / "restarted.log")
    try:
        with httpx.Client(base_url=restarted.url, timeout=60) as client:
            assert top_uids(client, NEW["instances"][0]["text"], k=10) == expected
            # issue 67: the appends replayed at load are counted as /info shows them (they read 0)
            metrics = client.get("/metrics").text
            assert 'xmcserve_appended_keys_total{kind="label",variant="A"} 1.0' in metrics
            assert 'xmcserve_appended_keys_total{kind="instance",variant="A"} 1.0' in metrics
    finally:
        stop_server(restarted)


def test_predict_during_appends_and_reloads_answers_every_request(bundle_root, tmp_path):
    srv = start(bundle_root, tmp_path / "appends", tmp_path / "hammer.log")
    done, answers = threading.Event(), []

    def client_loop(worker: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            for i in range(2000):  # bounded; the appends below end the loop much earlier
                if done.is_set():
                    return
                r = client.post("/predict", json={"text": f"zz-hammer-{i % 5}: new tool", "k": 5})
                answers.append(r.status_code)

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(3)]
    try:
        for thread in threads:
            thread.start()
        with httpx.Client(base_url=srv.url, timeout=120, headers=ADMIN) as admin:
            for step in range(6):
                before = len(answers)
                if step == 3:  # a reload of the same bundle replays its log: nothing is lost
                    r = admin.post("/admin/reload", json={"variant": "A", "bundle": "tiny-rae"})
                else:
                    uid = f"zz-hammer-{step}"
                    instances = [{"text": f"{uid}: new tool {j}", "labels": [uid]} for j in range(10)]
                    r = admin.post(
                        "/admin/append", json={"labels": [{"uid": uid, "text": uid}], "instances": instances}
                    )
                assert r.status_code == 200, r.text
                deadline = time.monotonic() + 60
                while len(answers) < before + 5 and time.monotonic() < deadline:
                    time.sleep(0.05)
            memory = admin.get("/info").json()["routing"]["variants"]["A"]["memory"]
            assert memory["version"] == 5 and memory["appended_instances"] == 50
    finally:
        done.set()
        for thread in threads:
            thread.join(60)
        stop_server(srv)
    assert len(answers) >= 30 and set(answers) == {200}, [a for a in answers if a != 200][:3]


def test_an_append_id_with_a_lone_surrogate_is_a_422_not_a_500(server):
    raw = b'{"labels": [{"uid": "zz-surrogate", "text": "zz-surrogate: text"}], "append_id": "id-\\ud800"}'
    headers = {**ADMIN, "content-type": "application/json"}
    r = httpx.post(f"{server.url}/admin/append", content=raw, headers=headers, timeout=60)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "append_id"], r.text


def test_a_pipelined_append_is_acknowledged_in_order_not_refused(server):
    """HTTP/1.1 pipelining on raw sockets: an append sent behind another request, its 30 kB body
    (more than the header cap) arriving after the first answer, a malformed request behind it.
    The append is applied and acknowledged with its 200, then the malformed request gets its 400;
    its body was once counted as header bytes and the applied append answered 431."""
    label = {"uid": "zz-pipelined", "text": "zz-pipelined: a label appended over a pipelined connection"}
    body = json.dumps({"labels": [label], "append_id": "pipelined"}).encode()[:-1] + b" " * 30_000 + b"}"
    fields = ("content-type: application/json", f"content-length: {len(body)}", f"x-admin-token: {TOKEN}")
    with Connection(int(server.url.rsplit(":", 1)[1])) as conn:
        conn.send(request("GET", "/healthz") + request("POST", "/admin/append", None, fields))
        assert conn.answer().status == 200
        conn.send(body + b"POST /admin/append HTTP/1.1\r\nhost: test\r\ncontent-length: -1\r\n\r\n")
        append, refused = conn.answers(2)
    assert append.status == 200, append
    assert json.loads(append.body)["repeated"] is False and len(json.loads(append.body)["label_ids"]) == 1
    assert refused.status == 400 and refused.closes
    r = httpx.post(
        f"{server.url}/admin/append", json={"labels": [label], "append_id": "pipelined"}, headers=ADMIN, timeout=60
    )
    assert r.status_code == 200 and r.json()["repeated"] is True  # applied once, by the pipelined request
