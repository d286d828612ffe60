"""Calls from the ingress to a part of the deployment (the encoder, a shard), with a deadline.

A call still unanswered after ``attempt_timeout_s`` is **hedged**: another send goes out while
the earlier ones keep running, and whichever answers first wins ("The Tail at Scale"); one more
goes out each ``attempt_timeout_s`` after that, up to :data:`MAX_IN_FLIGHT` at once, within a
**budget** per part (:class:`HedgeBudget`, like Finagle's retry budget): hedges are at most a
fraction of the part's calls, so under overload — every call slow, or a part with one replica
that every hedge reaches again — hedging does not multiply the load it is slowed by. A replica on
a node that was just lost is silent until Ray declares the node dead (seconds later), and Serve
may route a hedge to that same replica until then: each further hedge is one more chance of a
live one. A slow but live replica still answers (its answer is taken if it comes first, and its
work is not thrown away to start again at the back of a queue).

A send whose replica is found lost (its actor, worker or node died, or its answer's object was
lost with the node) is sent again, after a short pause, for as long as the deadline allows: Serve
routes the new send to a replica it still believes alive. A full queue (``BackPressureError``) and
any other error end the call at once. An answer the caller does not ``accept`` — during a
rolling update, a replica already (or still) on another bundle than the ingress's — is sent again
the same way, so that a replica on the request's bundle answers it. Every way a call ends without
an answer is a :class:`PartUnavailable`, which the ingress answers with ``503``.

Each send carries the time left to the request's deadline (:func:`time_left`), and a replica
drops work whose deadline passed while it queued (:func:`split_expired`): an answer nobody waits
for is not computed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import (
    ActorUnavailableError,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    WorkerCrashedError,
)
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

# The replica or its node is gone, not the request at fault: send it again.
REPLICA_LOST = (
    RayActorError,
    ActorUnavailableError,
    NodeDiedError,
    WorkerCrashedError,
    ObjectLostError,
    ReplicaUnavailableError,
)
# Sends of one call in flight at once: the first and two hedges. With one replica of two lost,
# a hedge lands on the silent one about half the time until Serve drops it from its routing.
MAX_IN_FLIGHT = 3
# Pause before sending again after a lost replica, growing with each loss (Serve's routing
# table needs a moment to drop the dead replica).
LOST_BACKOFF_S = 0.05
# Hedges per part: a tenth of its calls, and up to 10 saved for a burst after a quiet spell.
HEDGE_FRACTION = 0.1
HEDGE_BURST = 10.0


class HedgeBudget:
    """Each call earns ``fraction`` of a hedge, up to ``burst`` saved; a hedge spends one."""

    def __init__(self, fraction: float = HEDGE_FRACTION, burst: float = HEDGE_BURST):
        self.fraction, self.burst = fraction, burst
        self.balance = burst

    def earn(self) -> None:
        self.balance = min(self.balance + self.fraction, self.burst)

    def spend(self) -> bool:
        if self.balance < 1:
            return False
        self.balance -= 1
        return True


def time_left(deadline: float) -> float:
    """Seconds to ``deadline`` (``time.monotonic()``), what a send tells its replica: monotonic
    clocks are per machine, so a replica turns it into its own deadline on arrival."""
    return max(deadline - time.monotonic(), 0.0)


def split_expired(requests: list[tuple[Any, float]], now: float) -> tuple[list[int], list[Any]]:
    """The positions and items of the ``(item, deadline)`` requests still wanted at ``now``."""
    live = [(i, item) for i, (item, deadline) in enumerate(requests) if deadline > now]
    return [i for i, _ in live], [item for _, item in live]


@dataclass(frozen=True)
class CallContext:
    """What a part call carries besides its work, so one request id and one trace follow a
    request into the encoder and shard replicas: the ingress request's ``X-Request-Id`` and its
    W3C trace headers (``traceparent``, ``tracestate``; empty when tracing is off)."""

    request_id: str = "-"
    trace_headers: dict[str, str] = field(default_factory=dict)


class PartUnavailable(RuntimeError):
    """A part of the deployment did not answer in time (or could not): the request gets 503."""


class PartCaller:
    """Deadline-bound, hedged calls; ``on_failure(part, reason)`` counts what went wrong
    (``hedged``, ``hedge_over_budget``, ``replica_lost``, ``other_bundle``, ``queue_full``,
    ``error``, ``timeout``)."""

    def __init__(
        self,
        attempt_timeout_s: float,
        on_failure: Callable[[str, str], None] = lambda part, reason: None,
        hedge_fraction: float = HEDGE_FRACTION,
        hedge_burst: float = HEDGE_BURST,
    ):
        self.attempt_timeout_s = attempt_timeout_s
        self.on_failure = on_failure
        self.hedge_fraction, self.hedge_burst = hedge_fraction, hedge_burst
        self.budgets: dict[str, HedgeBudget] = {}

    def budget(self, part: str) -> HedgeBudget:
        if part not in self.budgets:
            self.budgets[part] = HedgeBudget(self.hedge_fraction, self.hedge_burst)
        return self.budgets[part]

    async def call(
        self,
        part: str,
        send: Callable[[], Any],
        deadline: float,
        accept: Callable[[Any], bool] = lambda answer: True,
        refusal: str = "another bundle",
    ):
        """The first accepted answer of ``send()`` — a Serve ``DeploymentResponse``, awaitable
        and cancellable — sent again or hedged as above, before ``deadline``
        (``time.monotonic()``); :class:`PartUnavailable` otherwise. An answer ``accept`` refuses
        is counted (``other_bundle``) and sent again like a lost replica's; ``refusal`` says what
        such answers were, for the 503 when only they came."""
        in_flight: dict[asyncio.Future, Any] = {}
        budget = self.budget(part)
        budget.earn()
        lost = refused = 0
        over_budget = False
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.on_failure(part, "timeout")
                    if refused:
                        raise PartUnavailable(f"{part}: only replicas serving {refusal} answered within the deadline")
                    raise PartUnavailable(f"no answer from {part} within the request's deadline")
                if not in_flight and not self._send(part, send, in_flight):
                    lost += 1
                    await asyncio.sleep(min(LOST_BACKOFF_S * lost, remaining))
                    continue
                can_hedge = len(in_flight) < MAX_IN_FLIGHT
                done, _ = await asyncio.wait(
                    in_flight,
                    timeout=min(remaining, self.attempt_timeout_s) if can_hedge else remaining,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:
                    if can_hedge and deadline - time.monotonic() > 0:
                        if budget.spend():
                            self.on_failure(part, "hedged")
                            self._send(part, send, in_flight)
                        elif not over_budget:  # counted once per call; later waits try the budget again
                            over_budget = True
                            self.on_failure(part, "hedge_over_budget")
                    continue
                for finished in done:
                    in_flight.pop(finished)
                    if finished.exception() is not None:
                        lost += self._lost_or_raise(part, finished.exception())
                    elif accept(finished.result()):
                        return finished.result()
                    else:  # e.g. a replica on the other side of a rolling update: ask again
                        self.on_failure(part, "other_bundle")
                        refused += 1
                        lost += 1
                if not in_flight:  # every send lost its replica: pause, then send again
                    await asyncio.sleep(min(LOST_BACKOFF_S * lost, max(deadline - time.monotonic(), 0)))
        finally:  # answered, failed, or the client left: stop what is still running
            for waiting, response in in_flight.items():
                waiting.cancel()
                response.cancel()

    def _send(self, part: str, send: Callable[[], Any], in_flight: dict) -> bool:
        """Send once more; False when the send itself found the replica lost."""
        try:
            response = send()
        except Exception as exc:  # a refusal raised at send time counts like one raised later
            self._lost_or_raise(part, exc)
            return False
        in_flight[asyncio.ensure_future(_awaited(response))] = response
        return True

    def _lost_or_raise(self, part: str, exc: BaseException) -> int:
        """1 for a lost replica (the caller sends again); raises for anything else."""
        if isinstance(exc, REPLICA_LOST):
            self.on_failure(part, "replica_lost")
            return 1
        if isinstance(exc, BackPressureError):
            self.on_failure(part, "queue_full")
            raise PartUnavailable(f"{part} is overloaded (its queue is full)") from None
        self.on_failure(part, "error")
        raise PartUnavailable(f"{part} failed ({type(exc).__name__}: {str(exc)[:200]})") from None


async def _awaited(response):
    return await response
