"""Queue deadlines behind the batcher's one timer: each request is still refused at its own
deadline, whatever the deadlines queued before and after it, and requests that started are
never refused late."""

import asyncio
import time

import pytest

from engine.batcher import BatcherConfig, DeadlineExceededError
from tests.engine.test_batcher import EchoPredictor, batch_started, run_with, text_code


def test_a_short_deadline_queued_behind_a_long_one_is_refused_at_its_own_time():
    predictor, drops = EchoPredictor(hold=True), []

    async def scenario(batcher):
        running = asyncio.create_task(batcher.submit(["running"], 1, None, [()]))
        await batch_started(predictor)
        patient = asyncio.create_task(batcher.submit(["patient"], 1, None, [()], timeout_s=30))
        await asyncio.sleep(0)
        started = time.perf_counter()
        with pytest.raises(DeadlineExceededError):
            await batcher.submit(["hurried"], 1, None, [()], timeout_s=0.05)
        waited = time.perf_counter() - started
        assert batcher.depth == 1 and not patient.done()  # the long deadline is left alone
        predictor.release(2)
        return waited, await asyncio.gather(running, patient)

    (waited, answers), _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=1), scenario, drops.append))
    assert 0.04 <= waited < 5 and drops == ["deadline"]
    assert predictor.batches == [["running"], ["patient"]]
    assert [a.rankings[0].scores[0] for a in answers] == [text_code("running"), text_code("patient")]


def test_requests_answered_before_their_deadline_leave_nothing_to_refuse():
    predictor, drops = EchoPredictor(), []

    async def scenario(batcher):
        for round_ in range(3):
            await asyncio.gather(
                *(batcher.submit([f"r{round_}-{i}"], 1, None, [()], timeout_s=0.05) for i in range(20))
            )
        await asyncio.sleep(0.1)  # every deadline has passed: the timer fired and refused nothing
        answer = await batcher.submit(["last"], 1, None, [()], timeout_s=0.05)
        return answer, len(batcher._deadlines)

    (answer, heap), _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=4), scenario, drops.append))
    assert drops == [] and answer.rankings[0].scores[0] == text_code("last") and heap <= 1
