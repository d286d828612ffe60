"""A client that goes away while its request waits: the request is cancelled (and so taken out
of the queue by the batcher), not computed for nobody."""

import asyncio

from service.http.app import answer_unless_gone


class FakeRequest:
    """What answer_unless_gone reads of a request: ``receive``, which reports the disconnect once
    ``gone`` is set."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_a_disconnect_cancels_the_waiting_work():
    async def scenario():
        request, cancelled = FakeRequest(), asyncio.Event()

        async def work():
            try:
                await asyncio.Event().wait()  # would wait forever
            except asyncio.CancelledError:
                cancelled.set()
                raise

        task = asyncio.create_task(answer_unless_gone(request, work()))
        await asyncio.sleep(0)
        request.gone.set()
        answer = await task
        await asyncio.wait_for(cancelled.wait(), 5)
        return answer

    assert asyncio.run(scenario()) is None


def test_an_answer_before_any_disconnect_is_returned():
    async def scenario():
        async def work():
            return "answer"

        return await answer_unless_gone(FakeRequest(), work())

    assert asyncio.run(scenario()) == "answer"
