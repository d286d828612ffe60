"""PartCaller against fake Serve responses (no cluster): hedging keeps a slow first send, lost
replicas are sent again for as long as the deadline allows, refusals end the call, and whatever
is still running is cancelled when the call ends."""

import asyncio
import time

import pytest
from ray.exceptions import ActorDiedError, ObjectLostError
from ray.serve.exceptions import BackPressureError

from service.ray_serve.calls import MAX_IN_FLIGHT, HedgeBudget, PartCaller, PartUnavailable, split_expired


class FakeResponse:
    """Awaitable and cancellable, like Serve's DeploymentResponse: answers when ``release`` is
    set, or raises ``error`` at once."""

    def __init__(self, answer=None, error: Exception | None = None, release: asyncio.Event | None = None):
        self.answer, self.error, self.release = answer, error, release
        self.cancelled = False

    def __await__(self):
        return self._run().__await__()

    async def _run(self):
        if self.error is not None:
            raise self.error
        if self.release is not None:
            await self.release.wait()
        return self.answer

    def cancel(self):
        self.cancelled = True


def sender(responses: list[FakeResponse]):
    sent = []

    def send():
        sent.append(responses[len(sent)])
        return sent[-1]

    return send, sent


def call(caller: PartCaller, send, within_s: float = 5.0):
    return caller.call("shard-0", send, time.monotonic() + within_s)


def test_a_silent_send_is_hedged_and_the_first_answer_wins():
    failures = []
    silent = FakeResponse(release=asyncio.Event())
    send, sent = sender([silent, FakeResponse("second")])
    caller = PartCaller(attempt_timeout_s=0.01, on_failure=lambda part, reason: failures.append(reason))
    assert asyncio.run(call(caller, send)) == "second"
    assert len(sent) == 2 and silent.cancelled  # the first stopped once the hedge answered
    assert failures == ["hedged"]


def test_a_slow_live_send_still_answers_after_the_hedge():
    async def scenario():
        slow_release, hedge_release = asyncio.Event(), asyncio.Event()
        hedges = [FakeResponse("hedge", release=hedge_release) for _ in range(2)]
        send, sent = sender([FakeResponse("first", release=slow_release), *hedges])
        caller = PartCaller(attempt_timeout_s=0.01)
        running = asyncio.ensure_future(call(caller, send))
        while len(sent) < MAX_IN_FLIGHT:  # both hedges went out; the first is still running, not cancelled
            await asyncio.sleep(0.005)
        assert not sent[0].cancelled
        slow_release.set()
        answer = await running
        return answer, sent

    answer, sent = asyncio.run(scenario())
    assert answer == "first" and all(hedge.cancelled for hedge in sent[1:]) and len(sent) == MAX_IN_FLIGHT


def test_lost_replicas_are_sent_again_beyond_any_fixed_count():
    losses = [FakeResponse(error=ActorDiedError()) for _ in range(5)]
    losses.append(FakeResponse(error=ObjectLostError("00" * 28, "", "")))  # the answer lost with its node
    send, sent = sender([*losses, FakeResponse("answer")])
    failures = []
    caller = PartCaller(attempt_timeout_s=1.0, on_failure=lambda part, reason: failures.append(reason))
    assert asyncio.run(call(caller, send)) == "answer"
    assert len(sent) == 7 and failures == ["replica_lost"] * 6


def test_a_full_queue_and_an_error_end_the_call_at_once():
    full = BackPressureError(num_queued_requests=1, max_queued_requests=1)
    for error, words in ((full, "overloaded"), (ValueError("bad"), "failed")):
        send, sent = sender([FakeResponse(error=error), FakeResponse("never sent")])
        with pytest.raises(PartUnavailable, match=words):
            asyncio.run(call(PartCaller(attempt_timeout_s=1.0), send))
        assert len(sent) == 1


def test_no_answer_by_the_deadline_is_part_unavailable_and_cancels_what_runs():
    silent = [FakeResponse(release=asyncio.Event()) for _ in range(MAX_IN_FLIGHT)]
    send, sent = sender(silent)  # a send past MAX_IN_FLIGHT would find no response and fail the call
    failures = []
    caller = PartCaller(attempt_timeout_s=0.01, on_failure=lambda part, reason: failures.append(reason))
    with pytest.raises(PartUnavailable, match="within the request's deadline"):
        asyncio.run(call(caller, send, within_s=0.1))
    assert len(sent) == MAX_IN_FLIGHT and all(response.cancelled for response in sent)  # no more hedges
    assert failures == ["hedged"] * (MAX_IN_FLIGHT - 1) + ["timeout"]


def test_a_send_that_raises_at_once_counts_like_one_that_fails_later():
    def send():
        raise BackPressureError(num_queued_requests=1, max_queued_requests=1)

    with pytest.raises(PartUnavailable, match="overloaded"):
        asyncio.run(call(PartCaller(attempt_timeout_s=1.0), send))


def test_a_client_that_leaves_cancels_the_sends():
    async def scenario():
        send, sent = sender([FakeResponse(release=asyncio.Event())])
        running = asyncio.ensure_future(call(PartCaller(attempt_timeout_s=10.0), send))
        while not sent:
            await asyncio.sleep(0.005)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        return sent

    assert asyncio.run(scenario())[0].cancelled


def test_hedges_stay_within_a_fraction_of_the_parts_calls():
    """With every call slow (overload, or one replica that every hedge reaches again), hedges are
    the saved burst and then a tenth of the calls, not two per call."""

    async def scenario():
        failures = []
        caller = PartCaller(0.001, lambda part, reason: failures.append(reason), hedge_fraction=0.1, hedge_burst=2)
        sends = 0
        for _ in range(40):
            release = asyncio.Event()

            def send(release=release):
                nonlocal sends
                sends += 1
                return FakeResponse("slow", release=release)

            running = asyncio.ensure_future(call(caller, send))
            await asyncio.sleep(0.02)  # past several attempt timeouts: every hedge it may send is out
            release.set()
            assert await running == "slow"
        return sends, failures

    sends, failures = asyncio.run(scenario())
    hedges = failures.count("hedged")
    assert hedges == sends - 40 and 2 + 3 <= hedges <= 2 + 4  # the burst, then 0.1 x 40 calls earned
    assert failures.count("hedge_over_budget") >= 40 - hedges


def test_the_hedge_budget_is_per_part():
    caller = PartCaller(1.0, hedge_fraction=0.5, hedge_burst=1)
    assert caller.budget("shard-0").spend() and not caller.budget("shard-0").spend()
    assert caller.budget("shard-1").spend()
    budget = HedgeBudget(fraction=0.5, burst=1)
    budget.spend()
    budget.earn()
    assert not budget.spend()
    budget.earn()
    assert budget.spend()


def test_an_answer_from_another_bundle_is_sent_again_until_a_matching_replica_answers():
    """A rolling update: the first replicas reached already serve the next bundle."""
    failures = []
    send, sent = sender([FakeResponse(("next", 1)), FakeResponse(("next", 2)), FakeResponse(("current", 3))])
    caller = PartCaller(attempt_timeout_s=1.0, on_failure=lambda part, reason: failures.append(reason))
    answer = asyncio.run(caller.call("shard-0", send, time.monotonic() + 5, lambda a: a[0] == "current"))
    assert answer == ("current", 3) and len(sent) == 3
    assert failures == ["other_bundle", "other_bundle"]


def test_only_other_bundles_answering_is_unavailable_at_the_deadline_and_says_so():
    send, sent = sender([FakeResponse(("next", i)) for i in range(100)])
    caller = PartCaller(attempt_timeout_s=1.0)
    with pytest.raises(PartUnavailable, match="only replicas serving the next bundle answered"):
        asyncio.run(caller.call("shard-0", send, time.monotonic() + 0.3, lambda a: False, "the next bundle"))
    assert 2 <= len(sent) < 100  # sent again, with a growing pause, until the deadline


def test_a_replica_drops_the_requests_whose_deadline_passed_while_queued():
    positions, live = split_expired([("a", 10.0), ("b", 4.0), ("c", 5.0001), ("d", 5.0)], now=5.0)
    assert positions == [0, 2] and live == ["a", "c"]
