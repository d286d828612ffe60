"""service.http.group on its own: the admin change log read whole lines only and written only by a
worker that has applied every earlier line, acknowledgements of dead workers dropped, and an admin
call's wait for the others bounded (an injected clock)."""

import asyncio
import json
import os

import pytest

from service.http.group import GroupError, WorkerGroup, alive

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


def test_a_change_that_fails_to_apply_is_raised_and_not_counted_as_applied(run_dir):
    writer, follower = WorkerGroup(run_dir, 2), WorkerGroup(run_dir, 2)
    writer.record({"op": "reload", "variant": "B", "path": "/nowhere"})

    async def fail(change):
        raise RuntimeError("cannot load")

    with pytest.raises(RuntimeError):
        asyncio.run(follower.follow(fail))
    assert follower.applied == 0 and follower.grown()


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
