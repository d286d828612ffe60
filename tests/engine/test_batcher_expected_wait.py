"""The expected wait the load shed and the deadline check ask for on every request: the texts
queued and encoding at the recent pace, counted as jobs come and go rather than summed."""

import asyncio

from engine.batcher import BatcherConfig
from tests.engine.test_batcher import EchoPredictor, batch_started, run_with


def test_the_expected_wait_follows_the_texts_queued_and_encoding():
    predictor = EchoPredictor(hold=True)

    async def scenario(batcher):
        batcher._seconds_per_text = 0.5
        seen = [batcher.expected_wait_s()]
        running = asyncio.create_task(batcher.submit(["r1", "r2"], 1, None, [(), ()]))
        await batch_started(predictor)
        seen.append(batcher.expected_wait_s())  # two texts encoding
        queued = [asyncio.create_task(batcher.submit([f"q{i}"] * (i + 1), 1, None, [()] * (i + 1))) for i in range(3)]
        await asyncio.sleep(0)
        seen.append(batcher.expected_wait_s())  # and 1 + 2 + 3 queued
        queued[1].cancel()  # its client left: its two texts are no longer ahead of anyone
        await asyncio.sleep(0)
        seen.append(batcher.expected_wait_s())
        predictor.release(3)
        await asyncio.gather(running, queued[0], queued[2])
        seen.append(batcher.expected_wait_s())
        return seen

    seen, _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=1, workers=1), scenario))
    assert seen == [0.0, 1.0, 4.0, 3.0, 0.0]
