"""The recent shadow comparisons, kept in memory for the rollout page (``GET /admin/agreement``).

A bounded ring: the last ``capacity`` compared texts (time, overlap@k, Kendall's τ, score and
latency deltas, and the text itself, so the page can show where A and B disagreed most) and the
last ``capacity`` drop events (time, reason, copies; drops within one second and for one reason
share an event). Nothing else keeps the texts; they live only here, in this process's memory, and
only the admin API reads them. At the default 2048 entries and the default 2 KiB text limit the
ring holds at most ~5 MB.

Entries are added when the worker's results reach the event loop (comparisons) and when a copy is
dropped for a full queue (one deque append): no work on a request unless the shadow is on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_CAPACITY = 2048


@dataclass(frozen=True)
class Compared:
    """One mirrored text as the shadow worker compared it (see :func:`service.rollout.shadow.compare`)."""

    ts: float
    text: str
    k: int
    overlap: float
    kendall_tau: float | None
    score_delta: float | None
    latency_delta_s: float


class AgreementHistory:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time):
        self.capacity = capacity
        self._clock = clock
        # plain tuples: an append is the shadow's cost; Compared objects are built when the page reads
        self._compared: deque[tuple] = deque(maxlen=capacity)
        self._dropped: deque[list] = deque(maxlen=capacity)  # [second, reason, copies]

    def add_compared(self, samples: Iterable[tuple]) -> None:
        """``samples``: (text, k, overlap, kendall_tau, score_delta, latency_delta_s) per text."""
        now = self._clock()
        self._compared.extend((now, *sample) for sample in samples)

    def add_dropped(self, reason: str, copies: int) -> None:
        second = int(self._clock())
        last = self._dropped[-1] if self._dropped else None
        if last is not None and last[0] == second and last[1] == reason:
            last[2] += copies
        else:
            self._dropped.append([second, reason, copies])

    def since(self, window_s: float) -> tuple[list[Compared], list[tuple[int, str, int]]]:
        """The comparisons and drop events of the last ``window_s`` seconds, oldest first."""
        start = self._clock() - window_s
        compared = [Compared(*c) for c in self._compared if c[0] >= start]
        dropped = [(second, reason, copies) for second, reason, copies in self._dropped if second >= start]
        return compared, dropped

    def worst(self, compared: list[Compared], count: int) -> list[Compared]:
        """The ``count`` comparisons where A and B disagreed most: lowest overlap@k, then lowest
        rank correlation, newest first among equals; one per distinct (text, k)."""
        ordered = sorted(
            reversed(compared),
            key=lambda c: (c.overlap, c.kendall_tau if c.kendall_tau is not None else -2.0),
        )
        seen, out = set(), []
        for c in ordered:
            if (c.text, c.k) not in seen:
                seen.add((c.text, c.k))
                out.append(c)
                if len(out) == count:
                    break
        return out
