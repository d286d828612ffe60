"""Nothing acknowledged is ever lost: real servers appending while they are SIGKILLed, while a
compaction reads their log (either log-directory mode), on a full disk (RLIMIT_FSIZE), with a torn
final record, and with a second process on the same log. After each restart every acknowledged
append is there (a re-send answers ``repeated``, or, once folded into a compacted bundle, its label
exists) and nothing else changed (one memory version, one label per append)."""

import hashlib
import os
import random
import shutil
import signal
import threading
import time

import httpx
import pytest

from export.compact import compact_bundle
from loadtest.localserver import start_server, stop_server

TOKEN = "durability-token"
ADMIN = {"X-Admin-Token": TOKEN}
ROUNDS = 3  # SIGKILLs in one append stream
STREAM_LIMIT = 400  # appends one stream may send (its time bound is the test's)


def body(i: int, padding: int = 0) -> dict:
    text = f"zz-d-{i}: a label appended by the durability suite " + "x" * padding
    return {"labels": [{"uid": f"zz-d-{i}", "text": text}], "append_id": f"d-{i}"}


def serve(bundle, log_path, appends_dir=None, extra_env=None, **kwargs):
    env = {"XMCSERVE_ADMIN_TOKEN": TOKEN, "XMCSERVE_BUNDLE_ROOT": str(bundle.parent), **(extra_env or {})}
    if appends_dir is not None:
        env["XMCSERVE_APPEND_LOG_DIR"] = str(appends_dir)
    return start_server(bundle, log_path, extra_env=env, **kwargs)


class Stream:
    """Appends ``body(i)`` for i = first, first + 1, … one at a time from a thread until stopped,
    keeping the ids acknowledged (200), the one in flight when the server went away, and every
    other status."""

    def __init__(self, url: str, first: int, padding: int = 0, pause_s: float = 0.0):
        self.url, self.next, self.padding, self.pause_s = url, first, padding, pause_s
        self.acked: list[int] = []
        self.unanswered: list[int] = []
        self.other: list[tuple[int, int, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers=ADMIN, timeout=30) as client:
            for _ in range(STREAM_LIMIT):
                if self.stop.wait(self.pause_s):
                    return
                i, self.next = self.next, self.next + 1
                try:
                    r = client.post("/admin/append", json=body(i, self.padding))
                except httpx.HTTPError:
                    self.unanswered.append(i)
                    return
                if r.status_code == 200:
                    self.acked.append(i)
                else:
                    self.other.append((i, r.status_code, r.text))

    def wait_for(self, acked: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < acked and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.05)
        assert len(self.acked) >= acked, (self.acked, self.other)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


def memory(client: httpx.Client) -> dict:
    return client.get("/info").json()["routing"]["variants"]["A"]["memory"]


def resend(client: httpx.Client, i: int, padding: int = 0) -> httpx.Response:
    return client.post("/admin/append", json=body(i, padding), headers=ADMIN)


def assert_logged(client: httpx.Client, acked: list[int]) -> None:
    """Every acknowledged append is in the memory: its re-send is answered ``repeated``."""
    lost = [i for i in acked if (r := resend(client, i)).status_code != 200 or not r.json()["repeated"]]
    assert not lost, f"{len(lost)} of {len(acked)} acknowledged appends lost: {lost[:10]}"


@pytest.fixture
def own_bundle(tiny_rae_bundle, tmp_path):
    """A copy, so that its default log directory (beside it) is this test's."""
    shutil.copytree(tiny_rae_bundle, tmp_path / "root" / "live")
    return tmp_path / "root" / "live"


def test_sigkill_during_an_append_stream_loses_no_acknowledged_append(tiny_rae_bundle, tmp_path):
    rng = random.Random(30)
    appends = tmp_path / "appends"
    acked, first = [], 0
    server = serve(tiny_rae_bundle, tmp_path / "server-0.log", appends)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            base_labels = memory(client)["labels"]
        for round_ in range(1, ROUNDS + 1):
            stream = Stream(server.url, first)
            stream.wait_for(5)
            time.sleep(rng.uniform(0.0, 1.5))  # a random point of the stream
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.wait(30)
            stream.end()
            assert not stream.other, stream.other[:3]
            acked += stream.acked
            if round_ == 2:  # and a record torn by the kill, as if it died mid-write
                with (appends / os.listdir(appends)[0]).open("ab") as log:
                    log.write(b'0c3f {"bundle_id": "torn')
            server = serve(tiny_rae_bundle, tmp_path / f"server-{round_}.log", appends)
            with httpx.Client(base_url=server.url, timeout=30) as client:
                assert_logged(client, acked)
                # the append in flight at the kill: logged or not, its re-send makes it applied
                for i in stream.unanswered:
                    assert resend(client, i).status_code == 200
                acked += stream.unanswered
                now = memory(client)
                assert now["version"] == len(acked) and now["labels"] == base_labels + len(acked), now
            first = stream.next
        print(f"\ndurability: {ROUNDS} SIGKILLs, {len(acked)} appends acknowledged, 0 lost")
    finally:
        stop_server(server)


@pytest.mark.parametrize("shared_dir", [True, False], ids=["XMCSERVE_APPEND_LOG_DIR", "default-dir"])
def test_a_compaction_while_the_server_appends_refuses_nothing_and_loses_nothing(
    own_bundle, tmp_path, shared_dir, monkeypatch
):
    monkeypatch.delenv("XMCSERVE_APPEND_LOG_DIR")  # the default, unless the test gives one
    appends = tmp_path / "appends" if shared_dir else None
    server = serve(own_bundle, tmp_path / "live.log", appends)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            base_labels = memory(client)["labels"]
        stream = Stream(server.url, 0, pause_s=0.02)  # paced: it must outlast the compaction
        stream.wait_for(5)
        compacted = own_bundle.parent / "compacted"
        compact_bundle(own_bundle, compacted, appends_dir=appends)
        during = len(stream.acked)
        stream.wait_for(during + 5)  # appends go on after the compaction read the log
        stream.end()
        assert not stream.other and not stream.unanswered, stream.other[:3]
    finally:
        stop_server(server)
    server = serve(compacted, tmp_path / "compacted.log", appends)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            # folded appends' labels exist; those the source logged after the compaction replay
            answers = [resend(client, i) for i in stream.acked]
            lost = [i for i, r in zip(stream.acked, answers, strict=True) if not present(r)]
            assert not lost, f"{len(lost)} of {len(stream.acked)} acknowledged appends lost: {lost[:10]}"
            assert memory(client)["labels"] == base_labels + len(stream.acked)
    finally:
        stop_server(server)


def present(answer: httpx.Response) -> bool:
    return (answer.status_code == 200 and answer.json()["repeated"]) or (
        answer.status_code == 422 and "already exists" in answer.text
    )


def test_a_full_disk_refuses_appends_with_503_and_keeps_every_acknowledged_one(tiny_rae_bundle, tmp_path):
    appends, padding = tmp_path / "appends", 1800  # ~2.1 KB a record: the limit is met within 20
    server = serve(tiny_rae_bundle, tmp_path / "full.log", appends, file_size_limit=24 << 10)
    acked, refused = [], []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for i in range(40):
                r = resend(client, i, padding)
                assert r.status_code in (200, 503), r.text
                (acked if r.status_code == 200 else refused).append(i)
                if len(refused) >= 3:
                    break
            assert acked and len(refused) == 3 and "nothing appended" in r.text and r.headers["retry-after"]
            assert refused == list(range(len(acked), len(acked) + 3))  # refused from the first failure on
            ok = client.post("/predict", json={"text": "libc6: GNU C Library", "k": 5})
            assert ok.status_code == 200  # the primary path is not taken down
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(30)
    finally:
        stop_server(server)
    server = serve(tiny_rae_bundle, tmp_path / "freed.log", appends)  # space freed
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert memory(client)["version"] == len(acked)
            assert all(resend(client, i, padding).json()["repeated"] for i in acked)
            # the refused appends were not applied: their retries are
            assert [resend(client, i, padding).json()["repeated"] for i in refused] == [False] * 3
            assert memory(client)["version"] == len(acked) + 3
    finally:
        stop_server(server)


def test_a_second_process_on_the_same_log_serves_but_only_the_first_appends(tiny_rae_bundle, tmp_path):
    """One writer per lineage: a second server on the same log directory starts (a shadow, a
    replica that only answers queries) and its appends get 409 while the first one writes."""
    appends = tmp_path / "appends"
    first = serve(tiny_rae_bundle, tmp_path / "first.log", appends)
    second = None
    try:
        with httpx.Client(base_url=first.url, timeout=30) as client:
            assert resend(client, 0).status_code == 200 and memory(client)["version"] == 1
        second = serve(tiny_rae_bundle, tmp_path / "second.log", appends)
        with httpx.Client(base_url=second.url, timeout=30) as client:
            assert memory(client)["version"] == 1  # it replayed the first one's append
            refused = resend(client, 1)
            assert refused.status_code == 409 and "held for writing by another process" in refused.text
            assert str(appends) in refused.text and memory(client)["version"] == 1
        with httpx.Client(base_url=first.url, timeout=30) as client:
            assert resend(client, 1).status_code == 200 and memory(client)["version"] == 2
    finally:
        stop_server(first)
        if second is not None:
            stop_server(second)


def test_a_logged_append_that_no_longer_applies_stops_the_load_unless_the_operator_skips_it(tiny_rae_bundle, tmp_path):
    appends = tmp_path / "appends"
    server = serve(tiny_rae_bundle, tmp_path / "first.log", appends)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert resend(client, 0).status_code == 200
    finally:
        stop_server(server)
    [log_path] = appends.iterdir()
    record = log_path.read_bytes()
    other_id = record.replace(b'"append_id":"d-0"', b'"append_id":"d-other"').split(b" ", 1)[1]
    log_path.write_bytes(record + hashlib.sha256(other_id[:-1]).hexdigest().encode() + b" " + other_id)
    with pytest.raises(RuntimeError, match=r"appends.log:2 .*no longer applies.*already exists"):
        serve(tiny_rae_bundle, tmp_path / "refused.log", appends)
    env = {"XMCSERVE_REPLAY_SKIP_REFUSED": "true"}
    server = serve(tiny_rae_bundle, tmp_path / "skipping.log", appends, extra_env=env)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            [skipped] = memory(client)["replay_skipped"]
            assert skipped["line"] == 2 and skipped["append_id"] == "d-other" and "already exists" in skipped["reason"]
            assert 'xmcserve_replay_skipped_total{variant="A"} 1.0' in client.get("/metrics").text
            assert memory(client)["version"] == 1
    finally:
        stop_server(server)
