"""XMCSERVE_WORKERS=2 on a real server: the two worker processes on one port answer as one server.
An append acknowledged by either is in the next /predict of both, in one order (ids never
differ); an admin change made through either is in force in both when its call answers; /metrics
sums both; a worker killed with SIGKILL is replaced by one that serves the same state."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from loadtest.localserver import start_server, stop_server
from service.http.group import alive
from tests.conftest import wait_for
from tests.service.http.test_durability import ADMIN, TOKEN, Stream, body  # its append streams, token included

WORKERS = 2
TRIES = 200  # new connections opened to find each worker (the kernel deals them out)


def start(bundle_root, tmp_path, name="workers", bundle="tiny-rae"):
    run_dir = tmp_path / f"{name}-run"
    env = {
        "XMCSERVE_BUNDLE_ROOT": str(bundle_root),
        "XMCSERVE_ADMIN_TOKEN": TOKEN,
        "XMCSERVE_APPEND_LOG_DIR": str(tmp_path / "appends"),
        "XMCSERVE_WORKERS": str(WORKERS),
        "XMCSERVE_RUN_DIR": str(run_dir),
    }
    server = start_server(bundle_root / bundle, tmp_path / f"{name}.log", extra_env=env, timeout_s=180)
    wait_for(lambda: len(list((run_dir / "acks").glob("[0-9]*"))) == WORKERS, limit_s=120)
    return server


def live_workers(run_dir) -> set[int]:
    """The workers that have started serving and are alive."""
    return {int(f.name) for f in (run_dir / "acks").glob("[0-9]*") if alive(int(f.name))}


def pid_of(client: httpx.Client) -> int:
    return client.get("/info").json()["worker"]["pid"]


def clients_per_worker(url: str) -> dict[int, httpx.Client]:
    """A keep-alive client (one connection, so one worker) for each worker."""
    found: dict[int, httpx.Client] = {}
    for _ in range(TRIES):
        client = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1))
        pid = pid_of(client)
        if pid in found:
            client.close()
        else:
            found[pid] = client
        if len(found) == WORKERS:
            return found
    for client in found.values():
        client.close()
    raise AssertionError(f"found {len(found)} of {WORKERS} workers in {TRIES} connections")


def top_uids(client: httpx.Client, text: str, k: int = 5) -> list[str]:
    r = client.post("/predict", json={"text": text, "k": k})
    assert r.status_code == 200, r.text
    return [label["uid"] for label in r.json()["results"][0]["labels"]]


def memory(client: httpx.Client, variant: str = "A") -> dict:
    return client.get("/info").json()["routing"]["variants"][variant]["memory"]


def label(i: int) -> dict:
    return {"labels": [{"uid": f"zz-w-{i}", "text": f"zz-w-{i}: a label appended through worker traffic"}]}


@pytest.fixture
def server(bundle_root, tmp_path):
    srv = start(bundle_root, tmp_path)
    yield srv
    stop_server(srv)


def test_an_append_through_one_worker_is_in_the_next_predict_of_every_worker(server):
    workers = clients_per_worker(server.url)
    try:
        first, second = workers.values()
        text = label(0)["labels"][0]["text"]
        assert "zz-w-0" not in top_uids(second, text)
        r = first.post("/admin/append", json={**label(0), "append_id": "w-0"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert top_uids(second, text)[0] == "zz-w-0"  # no wait: the next batch reads the log first
        # a retry through the other worker is the same append, with the same id
        again = second.post("/admin/append", json={**label(0), "append_id": "w-0"}, headers=ADMIN).json()
        assert again["repeated"] is True and again["label_ids"] == r.json()["label_ids"]
        assert memory(first) == memory(second)
    finally:
        for client in workers.values():
            client.close()


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(120)
"""


def test_a_worker_that_cannot_read_the_others_appends_in_time_answers_503_not_a_stale_result(server, tmp_path):
    """Issue 67: a search that could not take the log's shared lock within its wait ran without
    the newest records, so an acknowledged append was missing from the other worker's answer. Now
    that worker answers 503 with Retry-After while the log is held, and the append once it is not."""
    workers = clients_per_worker(server.url)
    holder = None
    try:
        first, second = workers.values()
        r = first.post("/admin/append", json={**label(1), "append_id": "w-1"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        log_path = tmp_path / "appends" / f"{r.json()['bundle_id']}.appends.log"
        # a worker between its write and its apply holds the log (as another append would)
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(log_path)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        text = label(1)["labels"][0]["text"]
        stale = second.post("/predict", json={"text": text, "k": 5})
        assert stale.status_code == 503 and stale.headers["retry-after"] == "1", stale.text
        assert top_uids(first, text)[0] == "zz-w-1"  # the worker that applied it needs no read
        holder.kill()
        holder.wait(30)
        assert top_uids(second, text)[0] == "zz-w-1"
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait(30)
        for client in workers.values():
            client.close()


def test_appends_racing_through_both_workers_get_one_order_and_distinct_ids(server):
    workers = clients_per_worker(server.url)
    per_worker = 15
    ids: dict[str, int] = {}
    failures: list[str] = []

    def append_through(client: httpx.Client, offset: int) -> None:
        for i in range(offset, offset + per_worker):
            r = client.post("/admin/append", json={**label(i), "append_id": f"w-{i}"}, headers=ADMIN)
            if r.status_code != 200:
                failures.append(r.text)
                return
            ids.update(r.json()["label_ids"])

    try:
        threads = [
            threading.Thread(target=append_through, args=(client, n * per_worker))
            for n, client in enumerate(workers.values())
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not failures and len(ids) == WORKERS * per_worker, failures[:3]
        assert len(set(ids.values())) == len(ids)  # never one id for two labels
        for client in workers.values():
            top_uids(client, "any text")  # a batch: the worker reads what the other logged
            mem = memory(client)
            assert mem["version"] == WORKERS * per_worker and mem["appended_labels"] == WORKERS * per_worker, mem
            # and every label under the id it was acknowledged with, in this worker too
            for i in (0, WORKERS * per_worker - 1):
                again = client.post("/admin/append", json={**label(i), "append_id": f"w-{i}"}, headers=ADMIN).json()
                assert again["repeated"] and again["label_ids"] == {f"zz-w-{i}": ids[f"zz-w-{i}"]}, again
    finally:
        for client in workers.values():
            client.close()


def test_admin_changes_through_one_worker_are_in_force_in_every_worker_when_answered(server):
    workers = clients_per_worker(server.url)
    try:
        first, second = workers.values()
        start_a = first.get("/info").json()["routing"]["variants"]["A"]["bundle_id"]
        r = first.post("/admin/reload", json={"bundle": "tiny-labels", "variant": "B"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["workers"]["applied"] == WORKERS
        candidate = r.json()["bundle_id"]
        assert second.get("/info").json()["routing"]["variants"]["B"]["bundle_id"] == candidate
        r = second.post("/admin/config", json={"split_b": 0.25}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["workers"]["applied"] == WORKERS, r.text
        assert first.get("/info").json()["routing"]["split_b"] == 0.25
        r = second.post("/admin/promote", headers=ADMIN)
        assert r.status_code == 200, r.text
        for client in (first, second):
            routing = client.get("/info").json()["routing"]
            assert routing["variants"]["A"]["bundle_id"] == candidate and routing["split_b"] == 0.0
        r = first.post("/admin/rollback", headers=ADMIN)
        assert r.status_code == 200, r.text
        for client in (first, second):
            assert client.get("/info").json()["routing"]["variants"]["A"]["bundle_id"] == start_a
        # a refused change is made nowhere and logged nowhere
        r = second.post("/admin/reload", json={"bundle": "corrupt", "variant": "B"}, headers=ADMIN)
        assert r.status_code == 422
        assert {client.get("/info").json()["worker"]["admin_generation"] for client in (first, second)} == {4}
        # issue 67: a reload counts once in the group (it counted once per worker that applied it)
        for client in (first, second):
            text = client.get("/metrics").text
            assert 'xmcserve_reloads_total{outcome="loaded",variant="B"} 1.0' in text, text[:3000]
            assert 'xmcserve_reloads_total{outcome="refused",variant="B"} 1.0' in text
    finally:
        for client in workers.values():
            client.close()


def test_metrics_of_either_worker_count_the_requests_of_both(server):
    workers = clients_per_worker(server.url)
    try:
        for client in workers.values():
            for i in range(3):
                top_uids(client, f"text {i}")
        for client in workers.values():
            text = client.get("/metrics").text
            assert f'xmcserve_predicted_texts_total{{variant="A"}} {3.0 * WORKERS}' in text, text[:2000]
            assert 'xmcserve_bundle_info{bundle_id="' in text
    finally:
        for client in workers.values():
            client.close()


def test_a_killed_worker_is_replaced_by_one_in_the_same_state(server, bundle_root):
    workers = clients_per_worker(server.url)
    try:
        first, second = workers.values()
        r = first.post("/admin/reload", json={"bundle": "tiny-labels", "variant": "B"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert first.post("/admin/append", json={**label(7), "append_id": "w-7"}, headers=ADMIN).status_code == 200
        victim = pid_of(second)
        second.close()
        os.kill(victim, signal.SIGKILL)
        # uvicorn's supervisor starts another worker; it applies the admin log and the append log
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                replacement = clients_per_worker(server.url)
            except (AssertionError, httpx.HTTPError):
                time.sleep(0.5)
                continue
            if victim not in replacement:
                break
            for client in replacement.values():
                client.close()
        else:
            raise AssertionError("no replacement worker within 120 s")
        try:
            for pid, client in replacement.items():
                routing = client.get("/info").json()["routing"]
                assert routing["variants"]["B"]["bundle_id"] == r.json()["bundle_id"], pid
                assert top_uids(client, label(7)["labels"][0]["text"])[0] == "zz-w-7", pid
        finally:
            for client in replacement.values():
                client.close()
    finally:
        first.close()


def replaced(url: str, victim: int, limit_s: float = 120) -> dict[int, httpx.Client]:
    """A client per worker once the supervisor has replaced ``victim`` (and it serves)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            workers = clients_per_worker(url)
        except (AssertionError, httpx.HTTPError):
            time.sleep(0.5)
            continue
        if victim not in workers:
            return workers
        for client in workers.values():
            client.close()
    raise AssertionError(f"no replacement worker within {limit_s:.0f} s")


def test_a_replacement_worker_loads_what_the_group_serves_not_its_history(bundle_root, tmp_path):
    """The bundle the server started with is reloaded away and deleted, as an operator does with
    old bundles: a worker killed after that is replaced by one serving the group's A, its rollback
    target, B and the split, loaded without the deleted bundle (no restart loop). A B the log
    names that no longer loads keeps a replacement out (it would split traffic differently), and
    the other worker serves on."""
    root = tmp_path / "root"
    for name in ("tiny-rae", "tiny-labels", "start", "candidate"):
        shutil.copytree(bundle_root / ("tiny-labels" if name == "tiny-labels" else "tiny-rae"), root / name)
    server = start(root, tmp_path, bundle="start")
    try:
        workers = clients_per_worker(server.url)
        first, second = workers.values()
        for bundle, variant in (("tiny-rae", "A"), ("tiny-labels", "A"), ("candidate", "B")):
            r = first.post("/admin/reload", json={"bundle": bundle, "variant": variant}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["workers"]["applied"] == WORKERS, r.text
        assert second.post("/admin/config", json={"split_b": 0.3}, headers=ADMIN).status_code == 200
        served = first.get("/admin/state", headers=ADMIN).json()
        shutil.rmtree(root / "start")
        victim = pid_of(second)
        for client in workers.values():
            client.close()
        os.kill(victim, signal.SIGKILL)
        workers = replaced(server.url, victim)
        try:
            for pid, client in workers.items():
                state = client.get("/admin/state", headers=ADMIN).json()
                assert [state["variants"][v]["bundle"] for v in "AB"] == ["tiny-labels", "candidate"], pid
                assert state["variants"]["A"]["bundle_id"] == served["variants"]["A"]["bundle_id"], pid
                assert (state["previous"]["bundle"], state["split_b"]) == ("tiny-rae", 0.3), pid
                assert client.get("/info").json()["worker"]["admin_generation"] == 4, pid
            r = first_client(workers).post("/admin/rollback", headers=ADMIN)  # made by both, the new one too
            assert r.status_code == 200 and r.json()["workers"]["applied"] == WORKERS, r.text
            for client in workers.values():
                assert client.get("/admin/state", headers=ADMIN).json()["variants"]["A"]["bundle"] == "tiny-rae"
            shutil.rmtree(root / "candidate")
            survivor, victim = list(workers)
        finally:
            for client in workers.values():
                client.close()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: "cannot start; exiting in 5 s" in server.log_path.read_text(), limit_s=120)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for i in range(5):  # the survivor answers meanwhile
                assert top_uids(client, f"text {i}"), i
        assert alive(survivor)
    finally:
        stop_server(server)


def first_client(workers: dict[int, httpx.Client]) -> httpx.Client:
    return next(iter(workers.values()))


def test_sigkilled_workers_during_append_streams_lose_no_acknowledged_append(server):
    """Two append streams, each on a connection of its own (so on either worker), while a worker
    is killed three times, maybe in the middle of a write or holding a lock: every acknowledged
    append is in every worker afterwards, each label once, under one id everywhere."""
    run_dir = server.log_path.parent / "workers-run"
    sent: list[int] = []
    first = 0
    for _ in range(3):
        streams = [Stream(server.url, first), Stream(server.url, first + 1000)]
        for stream in streams:
            stream.wait_for(3)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            victim = pid_of(client)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda victim=victim: not alive(victim), limit_s=60)  # reaped by the supervisor
        for stream in streams:
            stream.end()
            assert not stream.other, stream.other[:3]
            sent += stream.acked + stream.unanswered
        # an append in flight on the dead worker's connection: re-sent, it is applied or repeated
        with httpx.Client(base_url=server.url, timeout=60, headers=ADMIN) as client:
            for i in [i for stream in streams for i in stream.unanswered]:
                assert client.post("/admin/append", json=body(i)).status_code == 200
        first += 2000
    wait_for(lambda: len(live_workers(run_dir)) == WORKERS, limit_s=120)  # the last replacement is up
    ids: dict[str, int] = {}
    workers = clients_per_worker(server.url)
    try:
        for client in workers.values():
            for i in sent:
                r = client.post("/admin/append", json=body(i), headers=ADMIN)
                assert r.status_code == 200 and r.json()["repeated"], r.text
                for uid, label_id in r.json()["label_ids"].items():
                    assert ids.setdefault(uid, label_id) == label_id  # the same id in every worker
            mem = memory(client)
            assert mem["version"] == len(sent) and mem["appended_labels"] == len(sent), mem
        assert len(set(ids.values())) == len(ids) == len(sent)
    finally:
        for client in workers.values():
            client.close()
