"""A client that goes away while its request waits, told by the server itself
(:mod:`service.http.disconnect`): the request is cancelled without a watcher task."""

import asyncio

from service.http.app import answer_unless_disconnected
from service.http.disconnect import EXTENSION, ClientGone


def test_the_server_signal_of_a_lost_connection_cancels_the_waiting_work():
    """With the server's ClientGone (no watcher task): the connection's loss cancels the wait,
    which ends as None (the handler's 499), and the work awaited is cancelled."""

    async def scenario():
        client_gone, cancelled = ClientGone(), asyncio.Event()

        async def work():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        task = asyncio.create_task(answer_unless_disconnected(client_gone, work()))
        await asyncio.sleep(0)
        client_gone.lost()
        answer = await task
        await asyncio.wait_for(cancelled.wait(), 5)
        return answer, client_gone

    answer, client_gone = asyncio.run(scenario())
    assert answer is None and not client_gone._callbacks


def test_an_answer_before_the_connection_is_lost_is_returned_and_the_callback_dropped():
    async def scenario():
        client_gone = ClientGone()

        async def work():
            return "answer"

        answer = await answer_unless_disconnected(client_gone, work())
        client_gone.lost()  # later: nothing is waiting any more, nothing is cancelled
        return answer, client_gone

    answer, client_gone = asyncio.run(scenario())
    assert answer == "answer" and client_gone.gone


def test_a_connection_already_lost_cancels_at_once():
    async def scenario():
        client_gone = ClientGone()
        client_gone.lost()

        async def work():
            await asyncio.sleep(30)
            return "too late"

        return await asyncio.wait_for(answer_unless_disconnected(client_gone, work()), 5)

    assert asyncio.run(scenario()) is None


class Transport(asyncio.Transport):
    """What the protocol writes, and whether it closed."""

    def __init__(self):
        super().__init__()
        self.written, self.closing = b"", False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data):
        self.written += data

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def set_protocol(self, protocol):
        pass


def test_the_protocol_gives_each_request_its_connection_signal_and_fires_it_when_lost():
    """GuardedProtocol puts its connection's ClientGone in each request's scope and calls what a
    handler registered there when the connection is lost, before the answer."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from service.http.server import GuardedProtocol

    async def scenario():
        registered, fired = asyncio.Event(), asyncio.Event()

        async def app(scope, receive, send):
            scope["extensions"][EXTENSION].add(fired.set)
            registered.set()
            await asyncio.Event().wait()  # waits for an answer that never comes

        config = Config(app=app, lifespan="off")
        config.load()
        protocol = GuardedProtocol(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(Transport())
        protocol.data_received(b"POST /predict HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        await asyncio.wait_for(registered.wait(), 5)
        assert not fired.is_set()
        protocol.connection_lost(None)
        await asyncio.wait_for(fired.wait(), 5)
        for task in protocol.tasks:
            task.cancel()

    asyncio.run(scenario())
