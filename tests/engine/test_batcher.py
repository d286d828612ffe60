"""Micro-batcher: batching under concurrency, routing per requester, the overlap of the encode
and search stages and the back-pressure between them, bounds, errors, shutdown.

The fake predictor blocks on an event until the test releases it, so "a batch is running while
others queue" is a state the test creates, not a timing it hopes for."""

import asyncio
import threading
import time
import zlib

import numpy as np
import pytest

from engine import batcher as batcher_module
from engine.batcher import (
    BatcherConfig,
    BatcherStoppedError,
    DeadlineExceededError,
    MicroBatcher,
    QueueFullError,
)
from engine.encoder import EncodeTimes
from engine.search import Prediction, Ranking, StageTimes


def text_code(text: str) -> float:
    return float(zlib.crc32(text.encode()))


class FakeView:
    """Uids are the decimal label ids."""

    @staticmethod
    def label_ids(uids):
        return {int(u) for u in uids}


class EchoPredictor:
    """Encodes each text as its crc32 and answers it with its excluded label ids (sorted) as ids
    and that code as every score, so an answer names the request it belongs to. ``hold``: each
    batch's encoding waits for a release; ``hold_search``: each batch's search does."""

    default_ef = 100
    view = FakeView()

    def latest_view(self):
        return self.view

    def __init__(self, hold: bool = False, fail: bool = False, hold_search: bool = False):
        self.hold, self.fail, self.hold_search = hold, fail, hold_search
        self.batches: list[list[str]] = []
        self.efs: list[int | None] = []
        self.threads: set[str] = set()
        self.search_threads: set[str] = set()
        self.entered = threading.Semaphore(0)  # released once per batch whose encoding started
        self.released = threading.Semaphore(0)
        self.searching = threading.Semaphore(0)  # released once per batch whose search started
        self.search_released = threading.Semaphore(0)

    def release(self, batches: int = 1) -> None:
        for _ in range(batches):
            self.released.release()

    def release_search(self, batches: int = 1) -> None:
        for _ in range(batches):
            self.search_released.release()

    def encode(self, texts):
        self.batches.append(list(texts))
        self.threads.add(threading.current_thread().name)
        self.entered.release()
        if self.hold:
            assert self.released.acquire(timeout=30), "test never released the batch"
        if self.fail:
            raise RuntimeError("model exploded")
        # stand-ins for a lexical fusion's term vectors, which must reach the search of the same batch
        terms = [f"terms of {t}" for t in texts]
        return np.array([[text_code(t)] for t in texts]), EncodeTimes(tokenize_s=0.0, encode_s=0.001), terms

    def search(self, vectors, ks, ef=None, exclude=None, view=None, texts=None, terms=None):
        # each query's text reaches the search beside its own vector (a lexical fusion reads it)
        assert [text_code(t) for t in texts] == vectors[:, 0].tolist()
        assert terms == [f"terms of {t}" for t in texts]  # the encode stage's, handed over with the vectors
        self.efs.append(ef)
        self.search_threads.add(threading.current_thread().name)
        self.searching.release()
        if self.hold_search:
            assert self.search_released.acquire(timeout=30), "test never released the search"
        rankings = []
        for code, k, excluded in zip(vectors[:, 0], ks, exclude, strict=True):
            ids = np.array(sorted(excluded) or [0] * k, dtype=np.int64)
            rankings.append(Ranking(ids=ids, scores=np.full(len(ids), code)))
        efs = [e or self.default_ef for e in ef]  # the batcher passes each query's
        return Prediction(rankings, StageTimes(search=0.001), ef=max(efs), view=view, efs=efs)


async def batch_started(predictor: EchoPredictor) -> None:
    """Wait (off the loop) until the predictor has started encoding one more batch."""
    assert await asyncio.to_thread(predictor.entered.acquire, True, 30)


async def search_started(predictor: EchoPredictor) -> None:
    """Wait (off the loop) until the predictor has started searching one more batch."""
    assert await asyncio.to_thread(predictor.searching.acquire, True, 30)


async def run_with(predictor, config, coro_factory, on_drop=None):
    done_batches = []
    batcher = MicroBatcher(lambda: predictor, config, lambda n, t: done_batches.append(n), on_drop)
    batcher.start()
    try:
        return await asyncio.wait_for(coro_factory(batcher), 60), done_batches
    finally:
        predictor.hold = predictor.hold_search = False
        predictor.release(100)
        predictor.release_search(100)
        await batcher.stop()


async def submit_behind_a_running_batch(batcher, predictor, first, rest):
    """Submit ``first`` (text, k, ef, exclude), wait until its batch runs, queue ``rest``, release."""
    running = asyncio.create_task(batcher.submit(*first))
    await batch_started(predictor)
    queued = [asyncio.create_task(batcher.submit(*job)) for job in rest]
    await asyncio.sleep(0)  # let the queued tasks enqueue
    predictor.release(len(rest) + 1)
    return await asyncio.gather(running, *queued)


def test_every_requester_gets_its_own_texts_and_exclusions_back():
    predictor = EchoPredictor(hold=True)
    jobs = [([f"req{i}-a", f"req{i}-b"], 3, None, [[str(i)], [str(i), str(i + 100)]]) for i in range(12)]

    async def scenario(batcher):
        return await submit_behind_a_running_batch(batcher, predictor, (["first"], 1, None, [()]), jobs)

    answers, _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=8), scenario))
    for (texts, _, _, exclude), answer in zip(jobs, answers[1:], strict=True):
        assert [r.scores[0] for r in answer.rankings] == [text_code(t) for t in texts]
        assert [r.ids.tolist() for r in answer.rankings] == [sorted(int(u) for u in e) for e in exclude]
    assert len(predictor.batches) > 2  # the twelve were spread over several batches


def test_concurrent_requests_share_batches_and_keep_their_own_k():
    predictor = EchoPredictor(hold=True)

    async def scenario(batcher):
        rest = [([f"t{i}"], i, None, [()]) for i in range(1, 11)]
        return await submit_behind_a_running_batch(batcher, predictor, (["t0"], 1, None, [()]), rest)

    answers, done = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=32), scenario))
    assert [len(b) for b in predictor.batches] == [1, 10]
    assert done == [1, 10]
    for i, answer in enumerate(answers):
        assert len(answer.rankings) == 1 and len(answer.rankings[0].ids) == max(i, 1)
    assert answers[5].batch_texts == 10 and answers[5].queue_wait_s > 0
    # one timeline per batch, shared by its answers, its readings in the order the stages ran
    first, second = answers[0].timeline, answers[1].timeline
    assert all(answer.timeline is second for answer in answers[1:])
    assert (first.number, first.requests, second.number, second.requests) == (1, 1, 2, 10)
    for line in (first, second):
        assert line.started <= line.encoded <= line.searching <= line.searched <= time.perf_counter()
    assert predictor.threads and all(name.startswith("xmcserve-encode") for name in predictor.threads)
    assert predictor.search_threads == {"xmcserve-search"}


def test_batches_never_exceed_max_batch_size_and_requests_stay_whole():
    predictor = EchoPredictor(hold=True)

    async def scenario(batcher):
        rest = [([f"a{i}", f"b{i}", f"c{i}"], 2, None, [(), (), ()]) for i in range(5)]
        return await submit_behind_a_running_batch(batcher, predictor, (["x"], 1, None, [()]), rest)

    answers, _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=7), scenario))
    assert [len(b) for b in predictor.batches] == [1, 6, 6, 3]
    assert all(len(a.rankings) == 3 for a in answers[1:])


def test_each_request_is_searched_and_answered_at_its_own_ef_whatever_its_batch():
    predictor = EchoPredictor(hold=True)

    async def scenario(batcher):
        rest = [(["y"], 1, None, [()]), (["y", "z"], 1, 50, [(), ()]), (["y"], 1, 400, [()])]
        return await submit_behind_a_running_batch(batcher, predictor, (["x"], 1, 10, [()]), rest)

    answers, _ = asyncio.run(run_with(predictor, BatcherConfig(), scenario))
    assert predictor.efs == [[10], [EchoPredictor.default_ef, 50, 50, 400]]
    assert [a.ef for a in answers] == [10, EchoPredictor.default_ef, 50, 400]  # what each one ran at


def test_a_request_without_ef_is_never_searched_below_the_bundle_default():
    predictor = EchoPredictor(hold=True)

    async def scenario(batcher):
        rest = [(["y"], 1, ef, [()]) for ef in (None, 20)]
        return await submit_behind_a_running_batch(batcher, predictor, (["x"], 1, 10, [()]), rest)

    asyncio.run(run_with(predictor, BatcherConfig(), scenario))
    assert predictor.efs == [[10], [EchoPredictor.default_ef, 20]]


def test_max_wait_gathers_requests_that_arrive_within_it():
    predictor = EchoPredictor()

    async def scenario(batcher):
        first = asyncio.create_task(batcher.submit(["a"], 1, None, [()]))
        await asyncio.sleep(0)
        second = asyncio.create_task(batcher.submit(["b"], 1, None, [()]))
        return await asyncio.gather(first, second)

    # a wait far longer than the test: the batch closes because it is full, not because time passed
    asyncio.run(run_with(predictor, BatcherConfig(max_wait_ms=60_000, max_batch_size=2), scenario))
    assert [len(b) for b in predictor.batches] == [2]


def test_full_queue_is_refused_at_once():
    predictor = EchoPredictor(hold=True)

    async def scenario(batcher):
        running = asyncio.create_task(batcher.submit(["run"], 1, None, [()]))
        await batch_started(predictor)
        queued = [asyncio.create_task(batcher.submit([f"q{i}"], 1, None, [()])) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError) as info:
            await batcher.submit(["one too many"], 1, None, [()])  # refused while the batch is still held
        predictor.release(3)
        await asyncio.gather(running, *queued)
        return info.value

    error, _ = asyncio.run(run_with(predictor, BatcherConfig(max_queue=2, max_batch_size=1), scenario))
    assert error.retry_after_s >= 1 and "queue full" in str(error)


def test_a_model_error_reaches_every_request_of_the_batch_and_the_worker_survives():
    predictor = EchoPredictor(fail=True)

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


def test_a_swapped_predictor_takes_the_next_batch():
    old, new = EchoPredictor(hold=True), EchoPredictor()
    current = {"p": old}

    async def scenario():
        batcher = MicroBatcher(lambda: current["p"], BatcherConfig())
        batcher.start()
        try:
            running = asyncio.create_task(batcher.submit(["on old"], 1, None, [()]))
            await batch_started(old)
            current["p"] = new
            old.release()
            after = await batcher.submit(["on new"], 1, None, [()])
            return await running, after
        finally:
            await batcher.stop()

    first, second = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert first.predictor is old and second.predictor is new


def test_a_caller_that_stops_waiting_takes_its_queued_request_out_unrun():
    predictor, drops = EchoPredictor(hold=True), []

    async def scenario(batcher):
        running = asyncio.create_task(batcher.submit(["running"], 1, None, [()]))
        await batch_started(predictor)
        gone = asyncio.create_task(batcher.submit(["gone"], 1, None, [()]))
        kept = asyncio.create_task(batcher.submit(["kept"], 1, None, [()]))
        await asyncio.sleep(0)
        gone.cancel()  # what the HTTP layer does when the client disconnects
        await asyncio.sleep(0)
        assert batcher.depth == 1
        predictor.release(3)
        return await asyncio.gather(running, kept)

    asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=1), scenario, drops.append))
    assert predictor.batches == [["running"], ["kept"]] and drops == ["client_gone"]


def test_a_request_still_queued_at_its_deadline_is_refused_and_never_run():
    predictor, drops = EchoPredictor(hold=True), []

    async def scenario(batcher):
        running = asyncio.create_task(batcher.submit(["running"], 1, None, [()]))
        await batch_started(predictor)
        with pytest.raises(DeadlineExceededError) as info:
            await batcher.submit(["late"], 1, None, [()], timeout_s=0.01)  # the held batch never frees it
        predictor.release()
        await running
        return info.value

    error, _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=1), scenario, drops.append))
    assert error.retry_after_s >= 1 and predictor.batches == [["running"]] and drops == ["deadline"]


def test_a_request_that_would_wait_past_its_deadline_is_refused_before_queueing():
    predictor, drops = EchoPredictor(hold=True), []

    async def scenario(batcher):
        batcher._seconds_per_text = 1.0  # the recent pace: a second per text
        running = asyncio.create_task(batcher.submit(["running"], 1, None, [()]))
        await batch_started(predictor)
        with pytest.raises(DeadlineExceededError):
            await batcher.submit(["hopeless"], 1, None, [()], timeout_s=0.5)  # one text ahead: ~1 s
        assert batcher.depth == 0
        predictor.release()
        return await running

    asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=1), scenario, drops.append))
    assert drops == ["deadline"] and predictor.batches == [["running"]]


def background_behind_requests(predictor: EchoPredictor, work):
    """A scenario: a batch is running; ``work`` is queued to run when idle, then three requests
    are queued after it; everything is released. Returns ``work``'s result."""

    async def scenario(batcher):
        running = asyncio.create_task(batcher.submit(["first"], 1, None, [()]))
        await batch_started(predictor)
        idle = asyncio.create_task(batcher.run_when_idle(work))
        await asyncio.sleep(0)
        queued = [asyncio.create_task(batcher.submit([f"q{i}"], 1, None, [()])) for i in range(3)]
        await asyncio.sleep(0)
        predictor.release(2)
        await asyncio.gather(running, *queued)
        return await idle

    return scenario


def test_background_work_runs_on_the_encode_thread_only_when_no_request_waits():
    """Work queued with run_when_idle (an append's encoding) yields to requests queued before
    and after it, and runs on the encode thread, never beside a batch's encoding."""
    predictor = EchoPredictor(hold=True)

    def background():  # what the batcher had computed when the background work got its turn
        return len(predictor.batches), threading.current_thread().name

    scenario = background_behind_requests(predictor, background)
    (batches_before, thread), _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=8), scenario))
    assert [len(b) for b in predictor.batches] == [1, 3]  # the requests queued after it went first
    assert batches_before == 2 and thread.startswith("xmcserve-encode")


def test_background_work_that_waited_too_long_runs_before_the_next_batch(monkeypatch):
    """Under load that never empties the queue, background work still advances: once it has
    waited BACKGROUND_MAX_WAIT_S it goes before the next batch (here the limit is 0)."""
    monkeypatch.setattr(batcher_module, "BACKGROUND_MAX_WAIT_S", 0.0)
    predictor = EchoPredictor(hold=True)

    scenario = background_behind_requests(predictor, lambda: len(predictor.batches))
    batches_before, _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=8), scenario))
    assert batches_before == 1  # right after the running batch, ahead of the queued requests


def test_the_encoder_runs_the_next_batch_while_the_previous_one_is_searched():
    predictor = EchoPredictor(hold_search=True)

    async def scenario(batcher):
        first = asyncio.create_task(batcher.submit(["first"], 1, None, [()]))
        await search_started(predictor)  # the first batch is held in its search
        second = asyncio.create_task(batcher.submit(["second"], 1, None, [()]))
        await batch_started(predictor)  # first's encoding
        await batch_started(predictor)  # second's: it did not wait for first's search
        assert not first.done() and not second.done()
        predictor.release_search(2)
        return await asyncio.gather(first, second)

    answers, done = asyncio.run(run_with(predictor, BatcherConfig(), scenario))
    assert predictor.batches == [["first"], ["second"]] and done == [1, 1]
    assert [a.rankings[0].scores[0] for a in answers] == [text_code("first"), text_code("second")]


def test_an_idle_batcher_searches_a_lone_batch_on_its_encode_thread():
    """Nothing queued, nothing before the search thread, the other encode thread idle: the batch
    is searched where it was encoded, one thread hand-off fewer."""
    predictor = EchoPredictor()

    async def scenario(batcher):
        return await batcher.submit(["alone"], 1, None, [()])

    answer, _ = asyncio.run(run_with(predictor, BatcherConfig(workers=2), scenario))
    assert answer.rankings[0].scores[0] == text_code("alone")
    assert predictor.search_threads == predictor.threads and all(
        name.startswith("xmcserve-encode") for name in predictor.search_threads
    )


def test_a_batch_goes_to_the_search_thread_when_no_other_encoder_is_free():
    """One encode thread held in its encoding: the other hands its batch to the search thread
    rather than search it, so arrivals are never left without an encoder for a search's length;
    a single encode thread always hands over."""
    predictor = EchoPredictor(hold=True)

    async def scenario(batcher):
        held = asyncio.create_task(batcher.submit(["held"], 1, None, [()]))
        await batch_started(predictor)
        second = asyncio.create_task(batcher.submit(["second"], 1, None, [()]))
        await batch_started(predictor)
        predictor.release()  # one of the two: whichever goes first finds the other encoding
        await search_started(predictor)
        first_searched_on = set(predictor.search_threads)
        predictor.release()
        await asyncio.gather(held, second)
        return first_searched_on

    first_searched_on, _ = asyncio.run(run_with(predictor, BatcherConfig(workers=2), scenario))
    assert first_searched_on == {"xmcserve-search"}
    alone = EchoPredictor()
    asyncio.run(run_with(alone, BatcherConfig(workers=1), lambda b: b.submit(["x"], 1, None, [()])))
    assert alone.search_threads == {"xmcserve-search"}


def test_a_stalled_search_stops_the_encoder_after_the_handoff_fills_and_requests_stay_queued():
    """Back-pressure: with the search held, the encoder runs ahead by the hand-off's batches plus
    the one it cannot hand over, and the rest wait in the request queue (bounded, 429 beyond)."""
    predictor = EchoPredictor(hold_search=True)
    ahead = 1 + batcher_module.HANDOFF_BATCHES + 1  # searching + handed off + blocked on the hand-off
    requests = ahead + 3

    async def scenario(batcher):
        tasks = [asyncio.create_task(batcher.submit([f"t{i}"], 1, None, [()])) for i in range(requests)]
        for _ in range(ahead):
            await batch_started(predictor)
        # the encoder is now blocked; it must not take another batch however long we look
        assert not await asyncio.to_thread(predictor.entered.acquire, True, 0.2)
        assert batcher.depth == requests - ahead and batcher.in_flight_batches == ahead
        predictor.release_search(requests)
        return await asyncio.gather(*tasks)

    answers, _ = asyncio.run(run_with(predictor, BatcherConfig(max_batch_size=1), scenario))
    assert [a.rankings[0].scores[0] for a in answers] == [text_code(f"t{i}") for i in range(requests)]
    assert predictor.batches == [[f"t{i}"] for i in range(requests)]  # in arrival order


def test_a_search_error_reaches_its_batch_only_and_both_stages_go_on():
    predictor = EchoPredictor()
    search = predictor.search

    def failing_once(vectors, *args, **kwargs):
        predictor.search = search
        raise RuntimeError("index exploded")

    predictor.search = failing_once

    async def scenario(batcher):
        failed = await asyncio.gather(batcher.submit(["a"], 1, None, [()]), return_exceptions=True)
        return failed[0], await batcher.submit(["b"], 1, None, [()])

    (failed, after), _ = asyncio.run(run_with(predictor, BatcherConfig(), scenario))
    assert isinstance(failed, RuntimeError) and "index exploded" in str(failed)
    assert after.rankings[0].scores[0] == text_code("b")


def test_stop_fails_requests_in_either_stage_and_in_the_queue():
    predictor = EchoPredictor(hold=True, hold_search=True)

    async def scenario():
        batcher = MicroBatcher(lambda: predictor, BatcherConfig(max_batch_size=1))
        batcher.start()
        searching = asyncio.create_task(batcher.submit(["a"], 1, None, [()]))
        await batch_started(predictor)
        predictor.release()
        await search_started(predictor)
        encoding = asyncio.create_task(batcher.submit(["b"], 1, None, [()]))
        await batch_started(predictor)
        queued = asyncio.create_task(batcher.submit(["c"], 1, None, [()]))
        await asyncio.sleep(0)
        await batcher.stop()
        predictor.release(5)
        predictor.release_search(5)
        results = await asyncio.gather(searching, encoding, queued, return_exceptions=True)
        with pytest.raises(BatcherStoppedError):
            await batcher.submit(["after"], 1, None, [()])
        return results

    results = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert all(isinstance(r, BatcherStoppedError) for r in results)
