"""The shadow worker process: batching, comparisons and log written in the child, a dead, slow or
garbage-answering shadow counted and never waited for, a killed child settled and replaced."""

import asyncio
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.localserver import free_port
from service.http.metrics import Metrics
from service.rollout.shadow import Copy, ShadowConfig, ShadowMirror, ShadowRequest, text_digest
from service.rollout.shadow_worker import ShadowWorker


def request(texts, k=2) -> ShadowRequest:
    texts = list(texts)
    return ShadowRequest(texts, k, None, [[] for _ in texts], [[("x", 1.0), ("y", 0.5)] for _ in texts], 0.01, "A")


def copy(texts, k=2) -> Copy:
    return Copy(request(texts, k), time.monotonic() + 60)


def metric(metrics: Metrics, name: str, **labels) -> float:
    """A shadow metric's value; every one is labelled with the mirrored variant, A here."""
    return metrics.registry.get_sample_value(name, {"variant": "A", **labels}) or 0.0


def start_mirror(url: str, config: ShadowConfig):
    metrics = Metrics()
    worker = ShadowWorker(config, url)
    return ShadowMirror(config, metrics, url, worker), worker, metrics


async def settle(worker: ShadowWorker, limit_s: float = 60) -> None:
    """Let the event loop run (the worker's results arrive through it) until nothing is outstanding."""
    deadline = time.monotonic() + limit_s
    while worker.outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert worker.outstanding == 0, f"{worker.outstanding} copies still outstanding after {limit_s}s"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 180))


class EchoShadow(BaseHTTPRequestHandler):
    """A shadow whose answer to each text names the text; records every call. ``mode``: ``echo``,
    ``hang`` (answers only once ``release`` is set) or ``garbage`` (a 200 that is no /predict answer)."""

    calls: list[tuple[int, int]] = []
    mode = "echo"
    release = threading.Event()

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((len(body["texts"]), body["k"]))
        if self.mode == "hang":
            self.release.wait(30)
        results = [{"labels": [{"uid": t, "score": 1.0}, {"uid": "x", "score": 0.5}]} for t in body["texts"]]
        answer = {"results": results} if self.mode != "garbage" else {"results": results[:1], "note": "half"}
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def echo_server():
    EchoShadow.calls, EchoShadow.mode, EchoShadow.release = [], "echo", threading.Event()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), EchoShadow)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    EchoShadow.release.set()
    httpd.shutdown()


def test_copies_share_calls_and_are_compared_and_logged_in_the_worker(echo_server, tmp_path):
    log_path = tmp_path / "shadow.jsonl"
    config = ShadowConfig(
        fraction=1.0, batch_texts=4, batch_wait_s=0.2, timeout_s=30, log=log_path, log_max_bytes=10**6, log_backups=1
    )
    shadow, worker, metrics = start_mirror(echo_server, config)
    offers = [request([f"t{i}"]) for i in range(10)] + [request(["u0", "u1"], k=5)]

    async def scenario():
        shadow.start()
        try:
            assert all(shadow.offer(r) for r in offers)
            await settle(worker)
        finally:
            worker.close()

    run(scenario())
    assert metric(metrics, "xmcserve_shadow_compared_texts_total") == 12
    assert metric(metrics, "xmcserve_shadow_overlap_count") == 12
    # the one label both share, "x": 1.0 in A's answer, 0.5 in the echo's
    assert metric(metrics, "xmcserve_shadow_score_delta_count") == 12
    assert metric(metrics, "xmcserve_shadow_score_delta_sum") == 6.0
    assert sum(n for n, _ in EchoShadow.calls) == 12
    assert all(n <= 4 for n, _ in EchoShadow.calls) and len(EchoShadow.calls) < 11  # copies shared calls
    assert (2, 5) in EchoShadow.calls  # the k = 5 copy went alone
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    # answers matched (the echo names the text; the log names it by digest, the text itself left out)
    assert len(lines) == 12 and all(text_digest(x["shadow_top"][0]) == x["text_sha256"] for x in lines)
    assert not any("text" in x for x in lines)
    assert all(x["target"] == echo_server and x["primary_top"] == ["x", "y"] for x in lines)
    assert lines[0]["overlap"] == 0.5  # A: x, y; B: text, x


@pytest.mark.parametrize("fault", ["dead", "garbage"])
def test_a_dead_or_garbage_answering_shadow_is_counted_as_errors(echo_server, fault):
    EchoShadow.mode = fault
    url = f"http://127.0.0.1:{free_port()}" if fault == "dead" else echo_server
    config = ShadowConfig(fraction=1.0, timeout_s=30, batch_wait_s=0.0)
    shadow, worker, metrics = start_mirror(url, config)

    async def scenario():
        try:
            assert all(shadow.offer(request(["a", "b"])) for _ in range(3))
            await settle(worker)
        finally:
            worker.close()

    run(scenario())
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="error") == 3
    assert metric(metrics, "xmcserve_shadow_compared_texts_total") == 0


def test_a_slow_shadow_is_dropped_at_the_deadline_not_waited_for(echo_server):
    """The shadow answers only after the test releases it, which it does once the copy is
    settled: the drop can only have come from the copy's deadline."""
    EchoShadow.mode = "hang"
    config = ShadowConfig(fraction=1.0, timeout_s=0.3, batch_wait_s=0.0)
    shadow, worker, metrics = start_mirror(echo_server, config)

    async def scenario():
        try:
            shadow.offer(request(["a"]))
            await settle(worker)
            return EchoShadow.release.is_set()
        finally:
            EchoShadow.release.set()
            worker.close()

    assert run(scenario()) is False
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="timeout") == 1


def test_a_killed_worker_settles_what_it_held_as_errors_and_restarts(echo_server):
    EchoShadow.mode = "hang"
    config = ShadowConfig(fraction=1.0, timeout_s=60, batch_wait_s=0.0)
    shadow, worker, metrics = start_mirror(echo_server, config)

    async def scenario():
        try:
            for _ in range(3):
                assert shadow.offer(request(["a"], k=5))
            while sum(n for n, _ in EchoShadow.calls) < 3:  # every copy is in a call the shadow holds
                await asyncio.sleep(0.05)
            held = worker.outstanding
            os.kill(worker.pid, 9)
            await settle(worker)
            EchoShadow.mode = "echo"
            EchoShadow.release.set()
            assert shadow.offer(request(["b"]))  # the next copy starts a new child
            await settle(worker)
            return held
        finally:
            worker.close()

    assert run(scenario()) == 3
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="error") == 3
    assert metric(metrics, "xmcserve_shadow_compared_texts_total") == 1


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_child_that_dies_at_start_is_restarted_with_growing_back_off_not_per_copy():
    """A URL the child cannot use kills it at start; the copies offered meanwhile are dropped
    (``worker_down``) instead of each spawning a process, and each restart waits longer."""
    clock = FakeClock()
    config = ShadowConfig(fraction=1.0, timeout_s=60, batch_wait_s=0.0)
    metrics = Metrics()
    worker = ShadowWorker(config, "http://[::1", clock=clock)  # httpx refuses it: the child dies at start
    shadow = ShadowMirror(config, metrics, "bad", worker)

    async def dies(exits: int) -> None:
        deadline = time.monotonic() + 60
        while worker.exits < exits:
            assert time.monotonic() < deadline, "the child did not die"
            await asyncio.sleep(0.02)

    async def scenario():
        started, delays = [], []
        try:
            for advance in (0.0, 0.0, 1.0, 2.0):  # the waits the back-off asks for: 0, then 1, then 2
                clock.now += advance
                assert shadow.offer(request(["a"]))
                started.append(worker.pid)
                await dies(len([pid for pid in started if pid]))
                delays.append(worker.restart_delay_s)
                clock.now += worker.restart_delay_s / 2  # half the wait: the next copy starts nothing
                if worker.restart_delay_s:
                    assert shadow.offer(request(["b"])) and worker.pid is None
                clock.now -= worker.restart_delay_s / 2
            return started, delays
        finally:
            worker.close()

    started, delays = run(scenario())
    assert all(started) and len(set(started)) == 4  # four children in all, each started after its wait
    assert delays == [0.0, 1.0, 2.0, 4.0] and worker.exits == 4
    assert metric(metrics, "xmcserve_shadow_worker_exits_total") == 4
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="worker_down") == 3
    assert worker.outstanding == 0
