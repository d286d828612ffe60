"""The in-process shadow's child process: same rankings as the candidate computed in place,
idle CPU class, bundle changes followed, failures reported per copy and survived."""

import asyncio
import os
import time

import pytest

from service.bundle import load_bundle
from service.encoder import EncoderOptions
from service.search import Predictor
from service.shadow import ShadowRequest, ranked
from service.shadow_lane import ShadowLane, ShadowLaneError

TEXTS = ["python3-numpy: fast arrays for Python", "libc6: GNU C Library: Shared libraries"]


@pytest.fixture(scope="module")
def predictors(bundle_root):
    return {name: Predictor(load_bundle(bundle_root / name)) for name in ("tiny-rae", "tiny-labels")}


def request(texts=TEXTS, exclude=None) -> ShadowRequest:
    return ShadowRequest(list(texts), 5, None, exclude or [[] for _ in texts], [], 0.01, "A")


def in_place(predictor: Predictor, texts=TEXTS, exclude=None):
    exclude = [predictor.bundle.label_ids(e) for e in (exclude or [[] for _ in texts])]
    return ranked(predictor.predict(list(texts), 5, None, exclude).rankings, predictor.bundle.label_uids)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def uids(result):
    return [[uid for uid, _ in r] for r in result]


def test_lane_answers_like_the_candidate_in_an_idle_child(predictors):
    current = {"p": predictors["tiny-rae"]}
    lane = ShadowLane(lambda: current["p"], EncoderOptions(), verify=True, timeout_s=60)

    async def scenario():
        lane.warm()
        first = await lane.call(request())
        threads = [int(t) for t in os.listdir(f"/proc/{lane.pid}/task")] if hasattr(os, "SCHED_IDLE") else []
        policy = {os.sched_getscheduler(t) for t in threads} or None
        excluded = first[0][0][0]
        without = await lane.call(request(TEXTS[:1], [[excluded]]))
        current["p"] = predictors["tiny-labels"]  # B reloaded: the child follows on the next copy
        after_reload = await lane.call(request())
        await lane.close()
        return first, policy, without, after_reload

    first, policy, without, after_reload = run(scenario())
    assert uids(first) == uids(in_place(predictors["tiny-rae"]))
    for (uid_a, score_a), (uid_b, score_b) in zip(first[0], in_place(predictors["tiny-rae"])[0], strict=True):
        assert uid_a == uid_b and score_a == pytest.approx(score_b, abs=1e-4)
    if policy is not None:  # every thread of the child (ONNX Runtime's, BLAS's) is idle-class
        assert policy == {os.SCHED_IDLE}
    assert first[0][0][0] not in uids(without)[0]
    assert uids(without) == uids(in_place(predictors["tiny-rae"], TEXTS[:1], [[first[0][0][0]]]))
    assert uids(after_reload) == uids(in_place(predictors["tiny-labels"]))


def test_no_candidate_expired_copies_and_a_killed_child(predictors):
    current = {"p": None}
    lane = ShadowLane(lambda: current["p"], EncoderOptions(), verify=False, timeout_s=60)

    async def scenario():
        outcomes = {}
        try:
            await lane.call(request())
        except ShadowLaneError as exc:
            outcomes["none"] = str(exc)
        current["p"] = predictors["tiny-rae"]
        await lane.call(request())  # child up, bundle loaded
        os.kill(lane.pid, 9)
        deadline = time.monotonic() + 30
        while lane._process.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        outcomes["restarted"] = await lane.call(request())  # a new child takes the next copy
        lane._timeout_s = -1.0  # every copy is past its deadline when the child sees it
        try:
            await lane.call(request())
        except ShadowLaneError as exc:
            outcomes["expired"] = str(exc)
        await lane.close()
        return outcomes

    outcomes = run(scenario())
    assert "no candidate" in outcomes["none"]
    assert uids(outcomes["restarted"]) == uids(in_place(predictors["tiny-rae"]))
    assert "expired" in outcomes["expired"]
