import os
import subprocess
import sys
import threading

import pytest

from service.cpu_priority import confined_cpu_count, parse_cpus, thread_policy, yield_cpu

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")


@linux_only
def test_yield_cpu_lowers_only_the_calling_thread_and_its_children():
    seen = {}

    def lowered():
        seen["got"] = yield_cpu()
        seen["self"] = thread_policy(threading.get_native_id())
        child = threading.Thread(target=lambda: seen.update(child=thread_policy(threading.get_native_id())))
        child.start()
        child.join()

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen == {"got": "idle", "self": "idle", "child": "idle"}
    assert thread_policy(threading.get_native_id()) == "normal"  # the test's own thread is untouched


@linux_only
def test_yield_cpu_of_another_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert yield_cpu(child.pid) == "idle"
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
    finally:
        child.kill()
        child.wait()


def test_parse_cpus():
    assert parse_cpus("0-1,4") == {0, 1, 4} and parse_cpus(" 3 ") == {3}
    assert parse_cpus(None) is None and parse_cpus("") is None
    for bad in ("3-1", "x", "1,,2", "-1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


several_cores = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ cores to pin to one"
)


@several_cores
def test_pin_process_confines_threads_started_before_and_after():
    last = max(os.sched_getaffinity(0))
    script = f"""
import os, threading, time
from service.cpu_priority import confined_cpu_count, pin_process
before = threading.Thread(target=time.sleep, args=(2,), daemon=True)
before.start()
pin_process([{last}])
after = threading.Thread(target=time.sleep, args=(2,), daemon=True)
after.start()
masks = {{frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}}
print(confined_cpu_count(), sorted(next(iter(masks))) if len(masks) == 1 else sorted(map(sorted, masks)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["1", f"[{last}]"]
    # this process, unless something outside confines it: the cores it may use are the machine's
    assert confined_cpu_count() in (None, len(os.sched_getaffinity(0)))
