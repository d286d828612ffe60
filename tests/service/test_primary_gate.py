"""The in-process shadow yields to the primary: shadow work waits for a quiet primary and is
aborted (ONNX Runtime's terminate flag) the moment a primary request arrives."""

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

from service.bundle import load_bundle
from service.primary_gate import PrimaryActivity, PrimaryGate

TEXTS = ["python3-numpy: fast arrays for Python", "libc6: GNU C Library: Shared libraries"]


def test_activity_counts_requests_and_when_the_last_one_ended():
    activity = PrimaryActivity(quiet_s=0.05)
    gate = PrimaryGate(activity.shared)
    time.sleep(0.06)
    assert gate.quiet()
    activity.enter()
    activity.enter()
    activity.leave()
    assert activity.in_flight == 1 and gate.primary_busy() and not gate.quiet()
    activity.leave()
    assert activity.in_flight == 0 and not gate.primary_busy()
    assert not gate.quiet()  # idle, but not for quiet_s yet
    assert gate.wait_for_quiet(time.monotonic() + 5)
    assert gate.quiet()


def test_wait_for_quiet_gives_up_at_the_deadline_while_the_primary_is_busy():
    activity = PrimaryActivity(quiet_s=0.0)
    activity.enter()
    gate = PrimaryGate(activity.shared)
    started = time.monotonic()
    assert not gate.wait_for_quiet(started + 0.05)
    assert 0.05 <= time.monotonic() - started < 2


def test_a_waiting_shadow_sleeps_until_the_primary_goes_idle():
    activity = PrimaryActivity(quiet_s=0.01)
    gate = PrimaryGate(activity.shared)
    activity.enter()
    seen = {}

    def wait():
        cpu = time.thread_time()
        seen["quiet"] = gate.wait_for_quiet(time.monotonic() + 10)
        seen["cpu_s"] = time.thread_time() - cpu
        seen["at"] = time.monotonic()

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()  # still waiting: the primary has a request in flight
    left = time.monotonic()
    activity.leave()  # the idle transition writes the wake-up byte
    waiter.join(10)
    assert seen["quiet"]
    assert seen["at"] - left < 0.2  # woken by leave(), then quiet_s, not by a late re-check
    assert seen["cpu_s"] < 0.1  # asleep while waiting, not polling


def test_on_the_event_loop_the_shadow_is_woken_only_once_the_primary_stayed_quiet():
    activity = PrimaryActivity(quiet_s=0.2)
    gate = PrimaryGate(activity.shared)
    woken = threading.Event()

    def wait():
        if gate.wait_for_quiet(time.monotonic() + 20):
            woken.set()

    async def scenario():
        activity.enter()
        waiter = threading.Thread(target=wait)
        waiter.start()
        await asyncio.sleep(0.3)
        activity.leave()  # idle: the loop arms a 0.2 s timer...
        await asyncio.sleep(0.05)
        activity.enter()  # ...but a request arrives before it fires: no wake-up
        await asyncio.sleep(0.3)
        early = woken.is_set()
        activity.leave()
        left = time.monotonic()
        while not woken.is_set() and time.monotonic() - left < 5:
            await asyncio.sleep(0.01)
        waiter.join(5)
        return early, time.monotonic() - left

    early, after_s = asyncio.run(scenario())
    assert not early
    assert 0.19 <= after_s < 1.0  # woken once quiet for 0.2 s, not before


def test_disabled_gate_never_waits_or_aborts():
    gate = PrimaryGate(None)
    assert not gate.enabled and gate.watcher is None and gate.quiet()
    options = SimpleNamespace(terminate=False)
    assert gate.run(options, lambda: 42) == 42


def abortable_work(options, limit_s=10.0):
    """Stands in for an ONNX call: runs until its terminate flag is set (or ``limit_s``)."""

    def work():
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if options.terminate:
                raise RuntimeError("Exiting due to terminate flag being set to true.")
            time.sleep(0.0005)
        return "finished"

    return work


def test_a_primary_request_aborts_running_shadow_work():
    activity = PrimaryActivity(quiet_s=0.0)
    gate = PrimaryGate(activity.shared)
    options = SimpleNamespace(terminate=False)
    threading.Timer(0.05, activity.enter).start()
    started = time.monotonic()
    assert gate.run(options, abortable_work(options)) is None
    assert time.monotonic() - started < 1.0  # aborted soon after the request, not at the 10 s limit
    assert gate.interrupted == 1


def test_failures_that_are_not_aborts_are_raised():
    gate = PrimaryGate(PrimaryActivity().shared)

    def broken():
        raise ValueError("model broke")

    with pytest.raises(ValueError, match="model broke"):
        gate.run(SimpleNamespace(terminate=False), broken)
    assert gate.interrupted == 0


def test_onnx_runtime_call_is_aborted_through_run_options(tiny_rae_bundle):
    encoder = load_bundle(tiny_rae_bundle).encoder
    activity = PrimaryActivity(quiet_s=0.0)
    gate = PrimaryGate(activity.shared)
    options = ort.RunOptions()
    runs = []

    def encode_repeatedly():  # real session calls with the gate's options until one is refused
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            runs.append(encoder.encode(TEXTS * 8, options)[0])
        return "finished"

    threading.Timer(0.1, activity.enter).start()
    assert gate.run(options, encode_repeatedly) is None
    assert runs and all(np.isfinite(r).all() for r in runs)
    # the flag aborts every later call with these options too: the lane makes new ones per unit
    with pytest.raises(Exception, match="terminate"):
        encoder.encode(TEXTS, options)
