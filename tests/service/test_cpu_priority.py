import os
import subprocess
import sys
import threading

import pytest

from service.cpu_priority import thread_policy, yield_cpu

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
