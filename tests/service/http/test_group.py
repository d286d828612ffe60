"""service.http.group on its own: the admin change log read whole lines only and written only by a
worker that has applied every earlier line, acknowledgements of dead workers dropped, and an admin
call's wait for the others bounded (an injected clock); the state a log of admin changes leaves
(what a restarted worker loads) the state the engine's variants reach by making them one by one."""

import asyncio
import json
import os
import random

import pytest

from bundle import BundleError
from engine import Engine
from engine.batcher import BatcherConfig
from engine.variants import Variants
from service.http.group import GroupError, Routing, WorkerGroup, alive
from service.rollout import CANDIDATE, PRIMARY

DEAD = 2**22 + 4321  # above Linux's largest pid: never a live process


@pytest.fixture
def run_dir(tmp_path):
    WorkerGroup.prepare(tmp_path / "run")
    return tmp_path / "run"


def test_a_worker_applies_whole_lines_in_order_and_writes_only_at_the_end(run_dir):
    first, second = WorkerGroup(run_dir, 2, pid=os.getpid()), WorkerGroup(run_dir, 2, pid=os.getpid())
    assert first.record({"op": "promote"}) == 1
    with pytest.raises(GroupError, match="not applied"):
        second.record({"op": "rollback"})  # it has not applied the promote: its change would jump the order
    with open(run_dir / "admin.log", "ab") as log:
        log.write(b'{"op": "config", "split_b"')  # a line still being written
    applied = []

    async def apply(change):
        applied.append(change["op"])

    assert asyncio.run(second.follow(apply)) == 1 and applied == ["promote"] and second.applied == 1
    with open(run_dir / "admin.log", "ab") as log:
        log.write(b": 0.5}\n")
    assert asyncio.run(second.follow(apply)) == 1 and applied == ["promote", "config"]
    assert json.loads((run_dir / "acks" / str(os.getpid())).read_text()) == 2


def test_a_change_that_fails_on_a_follower_is_reported_to_its_maker_and_not_raised_into_an_unrelated_call(
    run_dir, tmp_path
):
    """Issue 67: a logged change that a worker could not apply was raised into whatever admin call
    on that worker followed the log next (an unrelated append answered the reload's 422) and kept
    its place, so every later call there failed the same way, while the call that made the change
    waited out CONVERGE_S. Now the follower logs it, reports it for the maker's answer
    (``workers.failed``), makes no admin change (503, it is being replaced) and follows no more."""
    from fastapi import HTTPException

    from service.http.admin import admin_change
    from service.http.metrics import Metrics
    from service.http.settings import Settings
    from service.http.state import ServingState

    maker = WorkerGroup(run_dir, 2, pid=os.getpid())
    follower = WorkerGroup(run_dir, 2, pid=os.getppid())  # another live process: the other worker
    maker.record({"op": "reload", "variant": "B", "path": str(tmp_path / "deleted-since")})
    maker.acknowledge()
    state = ServingState(Settings(bundle_dir=tmp_path), Metrics(), Engine(), group=follower)

    async def unrelated_call():
        async with admin_change(state):
            raise AssertionError("an admin change made on a worker that does not hold the group's state")

    with pytest.raises(HTTPException) as refused:
        asyncio.run(unrelated_call())
    assert refused.value.status_code == 503 and refused.value.headers["Retry-After"] == "1"
    assert "being replaced" in refused.value.detail and "bundle refused" not in refused.value.detail
    assert follower.failed["generation"] == 1 and "bundle refused" in follower.failed["reason"]
    done = asyncio.run(maker.converged(1, timeout_s=5))  # answered without waiting out the deadline
    assert (done.applied, done.workers) == (1, 2)
    assert [(f["pid"], f["generation"], f["op"]) for f in done.describe()["failed"]] == [(os.getppid(), 1, "reload")]
    maker.record({"op": "promote"})
    assert asyncio.run(follower.follow(lambda change: asyncio.sleep(0))) == 0  # it follows no more
    with pytest.raises(GroupError, match="could not apply"):
        follower.record({"op": "rollback"})


def test_a_torn_admin_line_is_cut_by_the_next_writer_and_a_garbled_one_skipped_by_all(run_dir, caplog):
    """Issue 67: one torn admin.log line (a worker killed mid-write) refused every later admin
    change on every worker ("holds changes this worker has not applied"), and a line written after
    it made the log unreadable. Now the next worker to log cuts the torn tail (it holds the turn:
    nobody is writing) and says so, and a complete line that is not a change is skipped with a log
    line, counted as a generation by every worker alike."""
    first, second = WorkerGroup(run_dir, 2, pid=os.getpid()), WorkerGroup(run_dir, 2, pid=os.getpid())
    first.record({"op": "config", "split_b": 0.1})
    with open(run_dir / "admin.log", "ab") as log:
        log.write(b'{"op": "config", "spl')  # a worker killed while writing its change
    applied = []

    async def apply(change):
        applied.append(change)

    assert asyncio.run(second.follow(apply)) == 1  # the torn line is left: it may still be written
    assert second.record({"op": "config", "split_b": 0.2}) == 2  # cut off, then logged
    assert "torn admin change" in caplog.text
    assert asyncio.run(first.follow(apply)) == 1 and first.applied == 2
    with open(run_dir / "admin.log", "ab") as log:
        log.write(b'{"op": "conf{"op": "config", "split_b": 0.3}\n')  # torn, then another line behind it
    assert asyncio.run(first.follow(apply)) == 0 and first.applied == 3  # a whole line: it counts, skipped
    first.record({"op": "config", "split_b": 0.4})
    assert asyncio.run(second.follow(apply)) == 1 and second.applied == 4 == first.applied
    assert "skipping admin log line 3" in caplog.text
    assert [change["split_b"] for change in applied] == [0.1, 0.2, 0.4]
    starter = WorkerGroup(run_dir, 2, pid=os.getpid())
    assert [change["split_b"] for change in starter.take_log()] == [0.1, 0.2, 0.4] and starter.applied == 4


def test_dead_workers_acknowledgements_are_dropped(run_dir):
    (run_dir / "acks" / str(DEAD)).write_text("7")
    me = WorkerGroup(run_dir, 2)
    me.acknowledge()
    assert not alive(DEAD) and me.acknowledged() == {os.getpid(): 0}
    assert not (run_dir / "acks" / str(DEAD)).exists()


def test_waiting_for_the_others_ends_at_its_deadline_with_the_count(run_dir):
    me = WorkerGroup(run_dir, 2)
    me.record({"op": "promote"})
    me.acknowledge()
    (run_dir / "acks" / str(os.getppid())).write_text("0")  # a live worker that has not applied it
    ticks = iter(range(100))
    done = asyncio.run(me.converged(1, timeout_s=5, clock=lambda: next(ticks)))
    assert (done.applied, done.workers) == (1, 2)
    (run_dir / "acks" / str(os.getppid())).write_text("1")
    assert asyncio.run(me.converged(1, timeout_s=5)).describe() == {"generation": 1, "applied": 2, "workers": 2}


def test_a_new_server_starts_from_an_empty_run_directory(run_dir):
    WorkerGroup(run_dir, 2).record({"op": "promote"})
    (run_dir / "metrics" / "counter_1.db").write_bytes(b"x")
    WorkerGroup.prepare(run_dir)
    assert not (run_dir / "admin.log").exists() and not list((run_dir / "metrics").iterdir())


def made(variants: Variants, change: dict, bundles: dict[str, object]) -> None:
    """``change`` made on ``variants`` as the admin routes make it (service.http.admin)."""
    op = change["op"]
    if op == "reload":
        variants.install(change["variant"], bundles.setdefault(change["path"], object()), change["path"])
    elif op == "promote":
        variants.promote()
    elif op == "rollback":
        variants.rollback()
    else:
        variants.split_b = change["split_b"]


def routing_of(variants: Variants) -> tuple:
    previous = variants.previous.source if variants.previous else None
    return variants[PRIMARY].source, variants[CANDIDATE].source, previous, variants.split_b


@pytest.mark.parametrize("seed", range(20))
def test_the_folded_log_leaves_the_state_the_changes_made_one_by_one_leave(seed):
    rng = random.Random(seed)
    variants = Variants.create(BatcherConfig(), lambda name: lambda n, t, s, tags: None)
    bundles: dict[str, object] = {}
    made(variants, {"op": "reload", "variant": PRIMARY, "path": "/b/start"}, bundles)
    start, log = Routing(primary="/b/start"), []
    for _ in range(rng.randrange(1, 30)):
        # only changes that were made are logged: a promote needs a B, a rollback a previous A
        ops = ["reload", "config"] + ["promote"] * variants[CANDIDATE].ready + ["rollback"] * bool(variants.previous)
        op = rng.choice(ops)
        change = {"op": op}
        if op == "reload":
            change |= {"variant": rng.choice([PRIMARY, CANDIDATE]), "path": f"/b/{rng.randrange(4)}"}
        elif op == "config":
            change["split_b"] = rng.choice([0.0, 0.1, 0.5])
        made(variants, change, bundles)
        log.append(change)
        folded = start.replay(log)
        assert routing_of(variants) == (folded.primary, folded.candidate, folded.previous, folded.split_b), log
    assert start.replay(log).shadow_fraction is None  # no change set it: the settings' own


def test_a_config_change_keeps_what_it_does_not_name_and_an_impossible_log_is_refused():
    routing = Routing(primary="/a", split_b=0.2).after({"op": "config", "shadow_fraction": 0.5})
    assert (routing.split_b, routing.shadow_fraction) == (0.2, 0.5)
    assert routing.after({"op": "config", "split_b": 0.3}).shadow_fraction == 0.5
    with pytest.raises(GroupError, match="no B"):
        Routing(primary="/a").after({"op": "promote"})
    with pytest.raises(GroupError, match="no previous"):
        Routing(primary="/a").after({"op": "rollback"})
    with pytest.raises(GroupError, match="unknown"):
        Routing(primary="/a").after({"op": "resize"})


def test_taking_the_log_counts_every_whole_line_as_applied(run_dir):
    leader, starter = WorkerGroup(run_dir, 2, pid=os.getpid()), WorkerGroup(run_dir, 2, pid=os.getpid())
    leader.record({"op": "reload", "variant": "B", "path": "/b"})
    leader.record({"op": "promote"})
    assert [c["op"] for c in starter.take_log()] == ["reload", "promote"] and starter.applied == 2
    assert not starter.grown() and starter.take_log() == []
    assert starter.record({"op": "rollback"}) == 3  # it may log next: nothing is left unapplied


def _vet_in_turns(run_dir, bundle_dir, started, release, ran):
    """A worker process's vet of ``bundle_dir``: says it started, then waits for ``release``."""

    def vet():
        started.set()
        release.wait(30)
        ran.put(os.getpid())

    WorkerGroup(run_dir, 2).vet_once(bundle_dir, vet)


def test_a_group_vets_each_bundle_once_for_all_its_workers(run_dir, tmp_path):
    """Two workers starting together: one vets while the other waits for its mark, then loads
    without a child of its own; other manifest bytes (another bundle in that path) are vetted
    again, and a refusal is kept: the next worker is refused at once with its reason."""
    import multiprocessing as mp

    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    (bundle_dir / "manifest.json").write_text('{"bundle_id": "one"}')
    ctx = mp.get_context("spawn")
    started, release, ran = ctx.Event(), ctx.Event(), ctx.Queue()
    first = ctx.Process(target=_vet_in_turns, args=(run_dir, bundle_dir, started, release, ran))
    first.start()
    try:
        assert started.wait(60), "the first worker never began its vet"
        calls = []
        # its events kept here: a spawned child unpickles them after start() returns
        second_started, second_release = ctx.Event(), ctx.Event()
        second_release.set()
        waiting = ctx.Process(target=_vet_in_turns, args=(run_dir, bundle_dir, second_started, second_release, ran))
        waiting.start()
        release.set()
        first.join(60)
        waiting.join(60)
        assert first.exitcode == 0 and waiting.exitcode == 0
        assert ran.get(timeout=10) == first.pid
        assert ran.empty(), "the second worker vetted a bundle the first had vetted"
    finally:
        release.set()
        first.join(5)
    group = WorkerGroup(run_dir, 2)
    assert not group.vet_once(bundle_dir, lambda: calls.append("again"))
    (bundle_dir / "manifest.json").write_text('{"bundle_id": "two"}')
    assert group.vet_once(bundle_dir, lambda: calls.append("new manifest")) and calls == ["new manifest"]

    (bundle_dir / "manifest.json").write_text('{"bundle_id": "three"}')

    def refused():
        calls.append("refused")
        raise BundleError("refused by the child")

    with pytest.raises(BundleError, match="refused by the child"):
        group.vet_once(bundle_dir, refused)
    with pytest.raises(BundleError, match="another worker's vet: refused by the child"):
        WorkerGroup(run_dir, 2).vet_once(bundle_dir, refused)  # another worker: refused at once
    assert calls == ["new manifest", "refused"]


class FakeTime:
    """An injected clock that moves only when the retry pauses (each pause recorded)."""

    def __init__(self):
        self.now, self.pauses = 0.0, []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def busy_loads(monkeypatch, busy_first: int) -> list:
    """The engine's ``load_predictor`` raising MemoryBusy (an append log held past the read wait)
    on its first ``busy_first`` calls, then loading; returns the record of its calls."""
    import engine.serving
    from engine import MemoryBusy

    calls, real_load = [], engine.serving.load_predictor

    def load(path, *args, **kwargs):
        calls.append(path)
        if len(calls) <= busy_first:
            raise MemoryBusy(f"{path}: another worker held its append log past the read wait; load it again")
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(engine.serving, "load_predictor", load)
    return calls


def follower_state(run_dir, bundle_root, fake: FakeTime):
    from engine import BusyRetry
    from service.http.metrics import Metrics
    from service.http.settings import Settings
    from service.http.state import ServingState

    maker = WorkerGroup(run_dir, 2, pid=os.getpid())
    follower = WorkerGroup(run_dir, 2, pid=os.getppid())  # another live process: the other worker
    maker.record({"op": "reload", "variant": "B", "path": str(bundle_root / "tiny-rae")})
    maker.acknowledge()
    state = ServingState(
        Settings(bundle_dir=bundle_root / "tiny-rae"),
        Metrics(),
        Engine(),
        group=follower,
        busy_retry=BusyRetry(clock=fake.clock, sleep=fake.sleep),
    )
    return maker, follower, state


def test_a_follower_outwaits_an_append_log_held_past_the_read_wait_and_applies_the_change(
    run_dir, bundle_root, monkeypatch, caplog
):
    """A writer's brief hold on the lineage's append log (MemoryBusy) made a follower's load of
    another worker's reload a failed change: it reported failure and stopped itself. It is tried
    again (pausing, a log line each) and the change applied."""
    from service.http.admin import follow_group

    fake = FakeTime()
    calls = busy_loads(monkeypatch, busy_first=2)
    maker, follower, state = follower_state(run_dir, bundle_root, fake)
    assert asyncio.run(follow_group(state)) == 1
    assert follower.failed is None and not (run_dir / "failures" / str(os.getppid())).exists()
    assert len(calls) == 3 and fake.pauses == [0.05, 0.1]
    assert state.engine.predictor(CANDIDATE) is not None
    assert sum("trying again" in r.getMessage() for r in caplog.records) == 2
    assert asyncio.run(maker.converged(1, timeout_s=0)).describe() == {"generation": 1, "applied": 2, "workers": 2}


def test_a_follower_whose_append_log_stays_held_past_the_bound_reports_the_change_failed(
    run_dir, bundle_root, monkeypatch
):
    from engine.serving import BUSY_TRIES, BUSY_WITHIN_S
    from service.http.admin import follow_group

    fake = FakeTime()
    calls = busy_loads(monkeypatch, busy_first=10**6)
    maker, follower, state = follower_state(run_dir, bundle_root, fake)
    assert asyncio.run(follow_group(state)) == 0
    assert follower.failed["generation"] == 1 and "append log" in follower.failed["reason"]
    assert (run_dir / "failures" / str(os.getppid())).exists()
    assert sum(fake.pauses) == pytest.approx(BUSY_WITHIN_S) and len(calls) == len(fake.pauses) + 1 <= BUSY_TRIES
    assert max(fake.pauses) <= 2.0 and state.engine.predictor(CANDIDATE) is None
    done = asyncio.run(maker.converged(1, timeout_s=0))
    assert [(f["pid"], f["op"]) for f in done.failed] == [(os.getppid(), "reload")]


def test_a_catch_up_is_outwaited_when_following_and_answers_503_at_once_for_a_client():
    """A promote or rollback another worker made catches its incoming A up: a held log is tried
    again there; the worker's own admin call (a client, who retries) answers 503 with Retry-After
    at once, as before."""
    from types import SimpleNamespace

    from fastapi import HTTPException

    from engine import BusyRetry, MemoryBusy
    from service.http.admin import promote_candidate
    from service.http.metrics import Metrics
    from service.http.settings import Settings
    from service.http.state import ServingState

    tries = []

    def catch_up():
        tries.append(1)
        if len(tries) <= 2:
            raise MemoryBusy("another worker held the append log past the read wait")
        return 0

    def bundle(name):
        return SimpleNamespace(memory=SimpleNamespace(catch_up=catch_up), bundle=SimpleNamespace(bundle_id=name))

    engine = Engine()
    engine.install(PRIMARY, bundle("a"), "/a")
    engine.install(CANDIDATE, incoming := bundle("b"), "/b")
    fake = FakeTime()
    swap = asyncio.run(engine.promote(BusyRetry(clock=fake.clock, sleep=fake.sleep)))
    assert len(tries) == 3 and fake.pauses == [0.05, 0.1] and swap.predictor is incoming
    tries.clear()
    engine.install(CANDIDATE, bundle("c"), "/c")
    state = ServingState(Settings(), Metrics(None), engine)
    with pytest.raises(HTTPException) as busy:
        asyncio.run(promote_candidate(state))
    assert busy.value.status_code == 503 and busy.value.headers["Retry-After"] == "1" and len(tries) == 1
    assert engine.predictor(PRIMARY) is incoming  # nothing changed


def test_an_event_is_claimed_by_the_first_worker_only_and_a_new_run_starts_unclaimed(run_dir):
    first, second = WorkerGroup(run_dir, 2, pid=1), WorkerGroup(run_dir, 2, pid=2)
    assert first.claim("replay_skipped A b1 /x 2") and not second.claim("replay_skipped A b1 /x 2")
    assert second.claim("replay_skipped A b1 /x 3")  # another event
    WorkerGroup.prepare(run_dir)
    assert second.claim("replay_skipped A b1 /x 2")


def test_the_appends_a_start_up_replay_skipped_are_counted_once_by_a_group(run_dir, monkeypatch):
    """Every worker starting on a bundle replays its log alike: the group's summed
    ``xmcserve_replay_skipped_total`` counted the skips once per worker; now by the first only,
    while a single server and a reload's maker count them as before."""
    from types import SimpleNamespace

    from service.http.metrics import Metrics
    from service.http.settings import Settings
    from service.http.state import ServingState

    predictor = SimpleNamespace(
        view=SimpleNamespace(replay_skipped=({"offset": 0}, {"offset": 10})), bundle=SimpleNamespace(bundle_id="b1")
    )

    def counted(group, at_start=True) -> float:
        metrics = Metrics(None)
        engine = SimpleNamespace(install=lambda *a: None, variants=(), predictor=lambda name: None)
        state = ServingState(Settings(), metrics, engine, group=group)
        state.install(PRIMARY, predictor, "/bundles/b1", at_start=at_start)
        return metrics.replay_skipped.labels(variant=PRIMARY)._value.get()

    assert counted(WorkerGroup(run_dir, 2, pid=1)) == 2
    assert counted(WorkerGroup(run_dir, 2, pid=2)) == 0  # the group's second worker
    assert counted(None) == 2  # a single server
    assert counted(WorkerGroup(run_dir, 2, pid=2), at_start=False) == 2  # a reload's maker
