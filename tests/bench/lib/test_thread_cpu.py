"""bench.lib.thread_cpu reads a thread's CPU from /proc lines whose name holds spaces and
parentheses, names its rows by the Python thread, sums the deltas of a window so that the rows
add up to the process's CPU, and bench.lib.profiling spreads each row's CPU over its own samples'
stages."""

import json
import os
import subprocess
import sys
import time

import pytest

from bench.lib.profiling import NATIVE, OTHER, UNSAMPLED, samples_by_thread, stage_cpu_us
from bench.lib.thread_cpu import (
    EXITED,
    TICK_NS,
    Snapshot,
    TaskStat,
    deltas,
    label,
    parse_dump,
    parse_schedstat,
    parse_stat,
    per_request_us,
    processes,
    snapshot,
)


def stat_line(tid: int, comm: str, utime: int, stime: int) -> str:
    # proc(5): pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime ...
    return f"{tid} ({comm}) S 1 1 1 0 -1 4194368 10 0 0 0 {utime} {stime} 0 0 20 0 7 0 2441299 47226 0\n"


@pytest.mark.parametrize("comm", ["python", "my (odd) thread", ") (", "a) S 1 2 3 4"])
def test_a_stat_line_is_read_whatever_the_thread_is_called(comm):
    stat = parse_stat(stat_line(4321, comm, 7, 5))
    assert (stat.tid, stat.comm, stat.ticks) == (4321, comm, 12)


def test_schedstat_gives_the_cpu_in_ns_the_wait_for_a_core_and_the_slices():
    stat = parse_schedstat(parse_stat(stat_line(7, "x (y)", 1, 2)), "91883822 130100660 218\n")
    assert (stat.comm, stat.ticks, stat.ns, stat.wait_ns, stat.slices) == ("x (y)", 3, 91883822, 130100660, 218)


def test_a_line_that_is_not_a_stat_line_is_refused():
    with pytest.raises(ValueError):
        parse_stat("nothing here")


def snap(process_ticks: dict, threads: list[tuple[int, str, int]]) -> Snapshot:
    """Threads of ``ns`` CPU each, having waited for a core half as long, in ``ns // 10**6`` slices."""
    return Snapshot(process_ticks, {tid: TaskStat(tid, comm, 0, ns, ns // 2, ns // 10**6) for tid, comm, ns in threads})


def test_the_rows_of_a_window_are_named_and_add_up_to_the_process():
    ms = 10**6
    before = snap({10: 100}, [(10, "python", 500 * ms), (11, "python", 200 * ms), (12, "python", 50 * ms)])
    after = snap(
        {10: 100 + 70},  # 700 ms of the process (clock ticks of 10 ms)
        [
            (10, "python", 800 * ms),  # the loop: 300 ms
            (11, "python", 300 * ms),  # encode-0: 100 ms
            (13, "python", 150 * ms),  # encode-1, born in the window: 150 ms
            (14, "python", 40 * ms),  # a native thread: 40 ms
        ],  # 12 ended in the window
    )
    names = {10: "MainThread", 11: "xmcserve-encode-0", 13: "xmcserve-encode-1", 12: "asyncio_0"}
    rows = deltas(before, after, names)
    assert rows["MainThread"] == {
        "threads": 1,
        "cpu_s": pytest.approx(0.3),
        "wait_s": pytest.approx(0.15),
        "slices": 300,
    }
    assert rows["xmcserve-encode-*"] == {
        "threads": 2,
        "cpu_s": pytest.approx(0.25),
        "wait_s": pytest.approx(0.125),
        "slices": 250,
    }
    assert rows["native: python"]["cpu_s"] == pytest.approx(0.04)
    process_s = 70 * TICK_NS / 1e9
    assert rows[EXITED]["cpu_s"] == pytest.approx(process_s - 0.59)
    assert sum(row["cpu_s"] for row in rows.values()) == pytest.approx(process_s)
    per_request = per_request_us(rows, answered=100)
    assert per_request["MainThread"] == {
        "threads": 1,
        "cpu_us_per_request": 3000.0,
        "runqueue_wait_us_per_request": 1500.0,
        "timeslices_per_request": 3.0,
    }
    assert per_request[EXITED]["runqueue_wait_us_per_request"] is None
    assert list(per_request)[0] == "MainThread"  # largest first


def test_a_thread_id_reused_in_the_window_counts_from_zero():
    before = snap({1: 0}, [(7, "python", 900)])
    after = snap({1: 0}, [(7, "python", 300)])  # lower than before: another thread now
    assert deltas(before, after, {})["native: python"]["cpu_s"] == pytest.approx(300e-9)


def test_numbers_are_folded_so_rows_match_across_servers():
    assert label("xmcserve-encode-12") == "xmcserve-encode-*"
    assert label("ThreadPoolExecutor-0_3") == "ThreadPoolExecutor-*_*"
    assert label("MainThread") == "MainThread"


def test_py_spy_dump_names_native_thread_ids():
    dump = [
        {"pid": 5, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": 5, "frames": []},
        {"pid": 5, "thread_id": 2, "thread_name": "xmcserve-search", "os_thread_id": 9, "frames": []},
        {"pid": 5, "thread_id": 3, "thread_name": None, "os_thread_id": 11, "frames": []},
    ]
    assert parse_dump(json.dumps(dump)) == {5: "MainThread", 9: "xmcserve-search", 11: "thread 11"}


def test_this_process_and_a_child_are_read_from_proc():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    try:
        assert child.pid in processes(os.getpid())
        before = snapshot(os.getpid(), children=False)
        deadline = time.process_time() + 0.05
        while time.process_time() < deadline:  # 50 ms of CPU on this thread
            pass
        after = snapshot(os.getpid(), children=False)
    finally:
        child.kill()
        child.wait(timeout=10)
    tid = os.getpid()  # pytest runs the test on the main thread
    assert after.thread_s(tid) - before.thread_s(tid) >= 0.04
    assert after.cpu_s >= before.cpu_s


COLLAPSED = """\
process 5:"python server.py";thread (5): MainThread;data_received (uvicorn/protocols/http/httptools_impl.py:2) 30
process 5:"python server.py";thread (5): MainThread;Runner.run (asyncio/runners.py:118) 70
thread (9): xmcserve-encode-0;Thread.run (threading.py:1);MicroBatcher._encode_loop (engine/batcher.py:3) 10
thread (10): xmcserve-encode-1;Thread.run (threading.py:1);Predictor.knn (engine/search.py:4) 30
"""


def test_each_threads_cpu_is_spread_over_its_own_samples_stages(tmp_path):
    collapsed = tmp_path / "profile.txt"
    collapsed.write_text(COLLAPSED)
    samples = samples_by_thread(collapsed)
    assert set(samples) == {"MainThread", "xmcserve-encode-*"}
    thread_us = {"MainThread": 1000.0, "xmcserve-encode-*": 400.0, "native: python": 50.0, EXITED: 5.0}
    thread_us["asyncio_*"] = 20.0  # a Python thread never caught running
    split = stage_cpu_us(thread_us, samples)
    assert split["by_thread"]["MainThread"] == {OTHER: 700.0, "http_protocol": 300.0}
    assert split["by_thread"]["xmcserve-encode-*"] == {"hnsw_search": 300.0, "batcher": 100.0}
    assert split["by_stage"][NATIVE] == 50.0 and split["by_stage"][EXITED] == 5.0
    assert split["by_stage"][UNSAMPLED] == 20.0
    assert sum(split["by_stage"].values()) == pytest.approx(sum(thread_us.values()))
    assert split["other_leaves"] == {"Runner.run (asyncio/runners.py:118)": 700.0}
