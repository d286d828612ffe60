"""The shadow worker process: batching, remote and in-process targets, comparisons and log written
in the child, failures and deadlines counted, the primary yielded to, a dead child replaced."""

import asyncio
import json
import os
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench.localserver import free_port
from service.engine.bundle import load_bundle
from service.engine.encoder import EncoderOptions
from service.http.metrics import Metrics
from service.primary_gate import PrimaryActivity
from service.engine.search import Predictor
from service.rollout.shadow import Copy, ShadowConfig, ShadowMirror, ShadowRequest, ranked
from service.rollout.shadow_worker import CandidateTarget, ShadowWorker, UnitPacer, WorkerSpec, split_answers, take_batch

TEXTS = ["python3-numpy: fast arrays for Python", "libc6: GNU C Library: Shared libraries"]


def request(texts, k=2) -> ShadowRequest:
    texts = list(texts)
    return ShadowRequest(texts, k, None, [[] for _ in texts], [[("x", 1.0), ("y", 0.5)] for _ in texts], 0.01, "A")


def copy(texts, k=2, bundle=None) -> Copy:
    return Copy(request(texts, k), time.monotonic() + 60, bundle)


def metric(metrics: Metrics, name: str, **labels) -> float:
    """A shadow metric's value; every one is labelled with the mirrored variant, A here."""
    return metrics.registry.get_sample_value(name, {"variant": "A", **labels}) or 0.0


def test_take_batch_keeps_k_ef_and_bundle_apart_and_the_rest_in_order():
    pending = deque([copy(["a"]), copy(["b"], k=5), copy(["c", "d"]), copy(["e", "f"]), copy(["g"])])
    batch = take_batch(pending, batch_texts=4)
    assert [c.request.texts for c in batch] == [["a"], ["c", "d"], ["g"]]
    assert [c.request.texts for c in pending] == [["b"], ["e", "f"]]
    big = deque([copy([str(i) for i in range(9)]), copy(["z"])])
    assert len(take_batch(big, batch_texts=4)) == 1  # a copy over the limit still goes, alone
    other_bundle = deque([copy(["a"], bundle=("p", "1")), copy(["b"], bundle=("p", "2"))])
    assert len(take_batch(other_bundle, batch_texts=4)) == 1


def test_split_answers_gives_each_copy_its_texts_answers():
    batch = [copy(["a"]), copy(["b", "c"])]
    answers = [[("A", 1.0)], [("B", 1.0)], [("C", 1.0)]]
    assert split_answers(answers, batch) == [[[("A", 1.0)]], [[("B", 1.0)], [("C", 1.0)]]]


def test_unit_pacer_spaces_units_and_gives_up_at_the_deadline():
    pacer = UnitPacer(texts_per_s=20)  # one one-text unit per 50 ms
    started = time.monotonic()
    assert all(pacer.take(started + 5) for _ in range(4))
    assert 0.14 <= time.monotonic() - started < 1.0  # the first at once, three more 50 ms apart
    assert not pacer.take(time.monotonic() - 1)  # its turn would come after the deadline
    four_texts = UnitPacer(texts_per_s=80)  # a four-text unit also takes 50 ms of the budget
    started = time.monotonic()
    assert all(four_texts.take(started + 5, texts=4) for _ in range(4))
    assert 0.14 <= time.monotonic() - started < 1.0
    unlimited = UnitPacer(texts_per_s=0)
    started = time.monotonic()
    assert all(unlimited.take(started) for _ in range(100)) and time.monotonic() - started < 0.1


def test_unit_pacer_backs_off_after_aborts_in_a_row_and_clears_when_a_unit_finishes():
    pacer = UnitPacer(backoff_min_s=0.01, backoff_max_s=0.04)
    seen = []
    for _ in range(4):
        pacer.aborted()
        seen.append(pacer.backoff_s)
    assert seen == [0.01, 0.02, 0.04, 0.04]  # doubling, capped
    started = time.monotonic()
    assert pacer.take(started + 5)
    assert 0.03 <= time.monotonic() - started < 0.5  # waited the back-off
    assert not (pacer.aborted() or pacer.take(time.monotonic()))  # the back-off outlasts the deadline
    pacer.finished()
    assert pacer.backoff_s == 0.0
    off = UnitPacer(backoff_max_s=0.0)
    off.aborted()
    assert off.backoff_s == 0.0 and off.take(time.monotonic())


class AlwaysInterrupted:
    """A gate whose primary is never quiet for long: every unit is aborted at once."""

    def __init__(self):
        self.units = 0

    def wait_for_quiet(self, deadline):
        return time.monotonic() < deadline

    def run(self, run_options, work):
        self.units += 1
        return None


def test_a_candidate_that_is_always_cut_short_tries_seldom(predictors):
    """Under sustained primary load units are aborted one after another: with the back-off the
    candidate starts a handful in half a second instead of one per gap."""
    predictor = predictors["tiny-rae"]
    units = {}
    for backoff_max_s in (0.08, 0.0):
        gate = AlwaysInterrupted()
        target = CandidateTarget(EncoderOptions(), True, gate, UnitPacer(backoff_max_s=backoff_max_s))
        deadline = time.monotonic() + 0.5
        assert target._encode_when_quiet(predictor, TEXTS, deadline) is None
        units[backoff_max_s] = gate.units
    # 0, 10, 30, 70, 150, 230, 310, 390, 470 ms: at most 9 starts (+1 for timer slack)
    assert 5 <= units[0.08] <= 10
    assert units[0.0] > 100


def start_mirror(spec: WorkerSpec, config: ShadowConfig, candidate=None, activity=None):
    metrics = Metrics()
    worker = ShadowWorker(spec, activity)
    target = spec.remote_url or "B"
    return ShadowMirror(config, metrics, target, worker, candidate), worker, metrics


async def settle(worker: ShadowWorker, limit_s: float = 60) -> None:
    """Let the event loop run (the worker's results arrive through it) until nothing is outstanding."""
    deadline = time.monotonic() + limit_s
    while worker.outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert worker.outstanding == 0, f"{worker.outstanding} copies still outstanding after {limit_s}s"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 180))


class EchoShadow(BaseHTTPRequestHandler):
    """A remote shadow whose answer to each text names the text; records every call."""

    calls: list[tuple[int, int]] = []
    delay_s = 0.0

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((len(body["texts"]), body["k"]))
        time.sleep(self.delay_s)
        results = [{"labels": [{"uid": t, "score": 1.0}, {"uid": "x", "score": 0.5}]} for t in body["texts"]]
        payload = json.dumps({"results": results}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def echo_server():
    EchoShadow.calls, EchoShadow.delay_s = [], 0.0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), EchoShadow)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_remote_copies_share_calls_and_are_compared_and_logged_in_the_worker(echo_server, tmp_path):
    log_path = tmp_path / "shadow.jsonl"
    config = ShadowConfig(fraction=1.0, batch_texts=4, batch_wait_s=0.2, timeout_s=30)
    spec = WorkerSpec(
        config=config.__dict__,
        remote_url=echo_server,
        log={"path": str(log_path), "max_bytes": 1_000_000, "backups": 1},
        target=echo_server,
    )
    shadow, worker, metrics = start_mirror(spec, config)
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
    assert len(lines) == 12 and all(x["shadow_top"] == [x["text"], "x"] for x in lines)  # answers matched
    assert all(x["target"] == echo_server and x["primary_top"] == ["x", "y"] for x in lines)
    assert lines[0]["overlap"] == 0.5  # A: x, y; B: text, x


def test_dead_and_slow_remotes_are_counted_not_waited_for(echo_server):
    dead = ShadowConfig(fraction=1.0, timeout_s=5)
    nowhere = f"http://127.0.0.1:{free_port()}"
    shadow, worker, metrics = start_mirror(WorkerSpec(config=dead.__dict__, remote_url=nowhere), dead)

    async def dead_scenario():
        try:
            assert all(shadow.offer(request(["a"])) for _ in range(3))
            await settle(worker)
        finally:
            worker.close()

    run(dead_scenario())
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="error") == 3

    EchoShadow.delay_s = 3.0
    slow = ShadowConfig(fraction=1.0, timeout_s=0.3, batch_wait_s=0.0)
    shadow, worker, metrics = start_mirror(WorkerSpec(config=slow.__dict__, remote_url=echo_server), slow)

    async def slow_scenario():
        try:
            shadow.set_fraction(1.0)  # (already on) the child's start-up is not part of what is timed
            worker.start()
            await asyncio.sleep(1.0)
            started = time.monotonic()
            shadow.offer(request(["a"]))
            await settle(worker)
            return time.monotonic() - started
        finally:
            worker.close()

    assert run(slow_scenario()) < 2.5  # given up at the deadline, not after the 3 s answer
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="timeout") == 1


@pytest.fixture(scope="module")
def predictors(bundle_root):
    return {name: Predictor(load_bundle(bundle_root / name)) for name in ("tiny-rae", "tiny-labels")}


def in_place_top(predictor: Predictor, texts=TEXTS) -> list[list[str]]:
    rankings = predictor.predict(list(texts), 5, None, [[] for _ in texts]).rankings
    return [[uid for uid, _ in r] for r in ranked(rankings, predictor.bundle.label_uids)]


def candidate_spec(config: ShadowConfig, log_path: Path) -> WorkerSpec:
    return WorkerSpec(
        config=config.__dict__,
        encoder=EncoderOptions().__dict__,
        verify=True,
        log={"path": str(log_path), "max_bytes": 1_000_000, "backups": 1},
    )


def logged_tops(log_path: Path) -> list[list[str]]:
    return [json.loads(x)["shadow_top"] for x in log_path.read_text().splitlines()]


def test_candidate_answers_like_b_in_place_follows_reloads_and_survives_a_killed_worker(predictors, tmp_path):
    log_path = tmp_path / "shadow.jsonl"
    config = ShadowConfig(fraction=1.0, timeout_s=60)
    current = {"p": predictors["tiny-rae"]}
    shadow, worker, metrics = start_mirror(candidate_spec(config, log_path), config, lambda: current["p"])

    async def scenario():
        try:
            shadow.start()  # warm: the worker loads B
            assert shadow.offer(request(TEXTS, k=5))
            await settle(worker)
            first = logged_tops(log_path)
            tasks = os.listdir(f"/proc/{worker.pid}/task") if hasattr(os, "SCHED_IDLE") else []
            policies = {os.sched_getscheduler(int(t)) for t in tasks}

            current["p"] = predictors["tiny-labels"]  # B reloaded: the worker follows on the next copy
            assert shadow.offer(request(TEXTS, k=5))
            await settle(worker)

            os.kill(worker.pid, 9)
            deadline = time.monotonic() + 30
            while worker.pid is not None and time.monotonic() < deadline:  # the loop notices the EOF
                await asyncio.sleep(0.05)
            assert shadow.offer(request(TEXTS[:1], k=5))  # a new worker takes the next copy
            await settle(worker)
            return first, policies
        finally:
            worker.close()

    first, policies = run(scenario())
    assert first == in_place_top(predictors["tiny-rae"])
    if policies:  # no gate without activity: every thread of the worker is idle-class
        assert policies == {os.SCHED_IDLE}
    tops = logged_tops(log_path)
    assert tops[2:4] == in_place_top(predictors["tiny-labels"])
    assert tops[4:] == in_place_top(predictors["tiny-labels"], TEXTS[:1])
    assert metric(metrics, "xmcserve_shadow_compared_texts_total") == 5


def gated_candidate(predictors, tmp_path):
    """A mirror to the in-process tiny-rae bundle that yields to a primary the test drives."""
    activity = PrimaryActivity()
    config = ShadowConfig(fraction=1.0, timeout_s=60)
    spec = candidate_spec(config, tmp_path / "shadow.jsonl")
    return activity, start_mirror(spec, config, lambda: predictors["tiny-rae"], activity)


def test_a_killed_worker_settles_what_it_held_as_errors(predictors, tmp_path):
    activity, (shadow, worker, metrics) = gated_candidate(predictors, tmp_path)

    async def scenario():
        try:
            activity.enter()  # the primary stays busy: the copies wait in the worker
            for _ in range(3):
                assert shadow.offer(request(TEXTS, k=5))
            await asyncio.sleep(1.0)
            held = worker.outstanding
            os.kill(worker.pid, 9)
            await settle(worker)
            return held
        finally:
            activity.leave()
            worker.close()

    assert run(scenario()) == 3
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="error") == 3


def test_candidate_computes_only_while_the_primary_is_quiet(predictors, tmp_path):
    activity, (shadow, worker, metrics) = gated_candidate(predictors, tmp_path)

    async def scenario():
        try:
            shadow.start()
            assert shadow.offer(request(TEXTS, k=5))
            await settle(worker)  # child up and B loaded while the primary is idle
            tasks = os.listdir(f"/proc/{worker.pid}/task") if hasattr(os, "SCHED_IDLE") else []
            normal = [t for t in tasks if os.sched_getscheduler(int(t)) != os.SCHED_IDLE]

            activity.enter()  # a primary request in flight
            assert shadow.offer(request(TEXTS, k=5))
            await asyncio.sleep(0.5)
            waited = worker.outstanding == 1
            activity.leave()
            await settle(worker)

            shadow.config.timeout_s = 0.3
            activity.enter()  # busy past the copy's deadline: dropped, nothing computed
            assert shadow.offer(request(TEXTS, k=5))
            await settle(worker)
            activity.leave()
            return tasks, normal, waited
        finally:
            worker.close()

    tasks, normal, waited = run(scenario())
    assert waited, "the copy was computed while the primary had a request in flight"
    assert metric(metrics, "xmcserve_shadow_compared_texts_total") == 4
    assert metric(metrics, "xmcserve_shadow_dropped_total", reason="timeout") == 1
    if tasks:  # only the gate's watcher keeps the normal class: it must preempt the worker's compute
        assert len(normal) == 1 and len(tasks) > 1


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ cores to pin to one"
)
def test_a_candidate_on_cores_of_its_own_computes_only_there(predictors, tmp_path):
    last = max(os.sched_getaffinity(0))
    config = ShadowConfig(fraction=1.0, timeout_s=60, yield_to_primary=False)
    spec = candidate_spec(config, tmp_path / "shadow.jsonl")
    spec.cpus = [last]
    shadow, worker, metrics = start_mirror(spec, config, lambda: predictors["tiny-rae"])

    async def scenario():
        try:
            shadow.start()
            assert shadow.offer(request(TEXTS, k=5))
            await settle(worker)
            tasks = os.listdir(f"/proc/{worker.pid}/task")
            return {frozenset(os.sched_getaffinity(int(t))) for t in tasks}, len(tasks)
        finally:
            worker.close()

    masks, threads = run(scenario())
    assert masks == {frozenset({last})} and threads > 1  # every thread, ONNX Runtime's included
    assert metric(metrics, "xmcserve_shadow_compared_texts_total") == 2
    assert logged_tops(tmp_path / "shadow.jsonl") == in_place_top(predictors["tiny-rae"])
