"""Micro-batcher: batching under concurrency, bounds, errors, shutdown."""

import asyncio
import threading
import time

import numpy as np
import pytest

from service.engine.batcher import BatcherConfig, BatcherStoppedError, MicroBatcher, QueueFullError
from service.engine.search import Prediction, Ranking, StageTimes


class FakeBundle:
    @staticmethod
    def label_ids(uids):
        return {int(u) for u in uids}


class FakePredictor:
    """Records the batches it is given; each takes ``delay_s`` on the batch thread."""

    default_ef = 100
    bundle = FakeBundle()

    def __init__(self, delay_s=0.05, fail=False):
        self.delay_s = delay_s
        self.fail = fail
        self.batches: list[list[str]] = []
        self.efs: list[int | None] = []
        self.threads: set[str] = set()

    def predict(self, texts, ks, ef=None, exclude=None, encoder=None):
        self.batches.append(list(texts))
        self.efs.append(ef)
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("model exploded")
        rankings = [Ranking(ids=np.arange(k), scores=np.full(k, float(i))) for i, k in enumerate(ks)]
        return Prediction(rankings, StageTimes(encode=self.delay_s))


async def run_with(predictor, config, coro_factory):
    done_batches = []
    batcher = MicroBatcher(lambda: predictor, config, on_batch_done=lambda n, t: done_batches.append(n))
    batcher.start()
    try:
        return await coro_factory(batcher), done_batches
    finally:
        await batcher.stop()


def test_concurrent_requests_share_batches_and_keep_their_own_k():
    predictor = FakePredictor()

    async def scenario(batcher):
        first = asyncio.create_task(batcher.submit(["t0"], 1, None, [()]))
        await asyncio.sleep(0.01)  # t0 is running; the next ten queue up behind it
        rest = [asyncio.create_task(batcher.submit([f"t{i}"], i, None, [()])) for i in range(1, 11)]
        return await asyncio.gather(first, *rest)

    answers, done = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=32), scenario))
    assert [len(b) for b in predictor.batches] == [1, 10]
    assert done == [1, 10]
    for i, answer in enumerate(answers):
        assert len(answer.rankings) == 1 and len(answer.rankings[0].ids) == max(i, 1)
    assert answers[5].batch_texts == 10 and answers[5].queue_wait_s > 0.03
    assert predictor.threads and all(name.startswith("xmcserve-batch") for name in predictor.threads)


def test_batches_never_exceed_max_batch_size_and_requests_stay_whole():
    predictor = FakePredictor(delay_s=0.02)

    async def scenario(batcher):
        blocker = asyncio.create_task(batcher.submit(["x"], 1, None, [()]))
        await asyncio.sleep(0.005)
        jobs = [
            asyncio.create_task(batcher.submit([f"a{i}", f"b{i}", f"c{i}"], 2, None, [(), (), ()])) for i in range(5)
        ]
        return await asyncio.gather(blocker, *jobs)

    answers, _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=7), scenario))
    assert [len(b) for b in predictor.batches] == [1, 6, 6, 3]
    assert all(len(a.rankings) == 3 for a in answers[1:])


def test_widest_ef_of_a_batch_is_used():
    predictor = FakePredictor()

    async def scenario(batcher):
        blocker = asyncio.create_task(batcher.submit(["x"], 1, 10, [()]))
        await asyncio.sleep(0.01)
        jobs = [asyncio.create_task(batcher.submit(["y"], 1, ef, [()])) for ef in (None, 50, 400)]
        return await asyncio.gather(blocker, *jobs)

    asyncio.run(run_with(predictor, BatcherConfig(), scenario))
    assert predictor.efs == [10, 400]


def test_max_wait_gathers_requests_that_arrive_soon_after():
    predictor = FakePredictor(delay_s=0.0)

    async def scenario(batcher):
        first = asyncio.create_task(batcher.submit(["a"], 1, None, [()]))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(batcher.submit(["b"], 1, None, [()]))
        return await asyncio.gather(first, second)

    asyncio.run(run_with(predictor, BatcherConfig(max_wait_ms=200), scenario))
    assert [len(b) for b in predictor.batches] == [2]


def test_full_queue_is_refused_at_once():
    predictor = FakePredictor(delay_s=0.2)

    async def scenario(batcher):
        running = asyncio.create_task(batcher.submit(["run"], 1, None, [()]))
        await asyncio.sleep(0.02)
        queued = [asyncio.create_task(batcher.submit([f"q{i}"], 1, None, [()])) for i in range(2)]
        await asyncio.sleep(0)
        started = time.perf_counter()
        with pytest.raises(QueueFullError) as info:
            await batcher.submit(["one too many"], 1, None, [()])
        refused_after = time.perf_counter() - started
        await asyncio.gather(running, *queued)
        return info.value, refused_after

    (error, refused_after), _ = asyncio.run(run_with(predictor, BatcherConfig(max_queue=2), scenario))
    assert error.retry_after_s >= 1 and "queue full" in str(error)
    assert refused_after < 0.05


def test_a_model_error_reaches_every_request_of_the_batch_and_the_worker_survives():
    predictor = FakePredictor(delay_s=0.01, fail=True)

    async def scenario(batcher):
        results = await asyncio.gather(
            *[batcher.submit([f"t{i}"], 1, None, [()]) for i in range(3)], return_exceptions=True
        )
        predictor.fail = False
        after = await batcher.submit(["ok"], 1, None, [()])
        return results, after

    (results, after), _ = asyncio.run(run_with(predictor, BatcherConfig(), scenario))
    assert all(isinstance(r, RuntimeError) and "exploded" in str(r) for r in results)
    assert len(after.rankings) == 1


def test_stop_fails_requests_running_or_queued():
    predictor = FakePredictor(delay_s=0.2)

    async def scenario():
        batcher = MicroBatcher(lambda: predictor, BatcherConfig(max_batch_size=1))
        batcher.start()
        running = asyncio.create_task(batcher.submit(["a"], 1, None, [()]))
        await asyncio.sleep(0.02)
        queued = asyncio.create_task(batcher.submit(["b"], 1, None, [()]))
        await asyncio.sleep(0.01)
        await batcher.stop()
        return await asyncio.gather(running, queued, return_exceptions=True)

    running, queued = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert isinstance(running, BatcherStoppedError) and isinstance(queued, BatcherStoppedError)


def test_a_swapped_predictor_takes_the_next_batch():
    old, new = FakePredictor(delay_s=0.05), FakePredictor(delay_s=0.0)
    current = {"p": old}

    async def scenario():
        batcher = MicroBatcher(lambda: current["p"], BatcherConfig())
        batcher.start()
        try:
            running = asyncio.create_task(batcher.submit(["on old"], 1, None, [()]))
            await asyncio.sleep(0.01)
            current["p"] = new
            after = await batcher.submit(["on new"], 1, None, [()])
            return await running, after
        finally:
            await batcher.stop()

    first, second = asyncio.run(scenario())
    assert first.predictor is old and second.predictor is new


def test_a_request_without_ef_is_never_searched_below_the_bundle_default():
    predictor = FakePredictor()

    async def scenario(batcher):
        blocker = asyncio.create_task(batcher.submit(["x"], 1, 10, [()]))
        await asyncio.sleep(0.01)
        jobs = [asyncio.create_task(batcher.submit(["y"], 1, ef, [()])) for ef in (None, 20)]
        return await asyncio.gather(blocker, *jobs)

    asyncio.run(run_with(predictor, BatcherConfig(), scenario))
    assert predictor.efs == [10, FakePredictor.default_ef]
