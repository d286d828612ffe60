"""Refusals the single server makes before any work: load shed before parsing, and the
bounded method label of its request metrics (the body limit and validation errors every front
end shares are in :mod:`service.api.body_guards` and :mod:`service.api.front_door`).
"""

from __future__ import annotations

# Every label value that comes from a client maps into a fixed set (bounded series in /metrics).
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
OTHER = "OTHER"


def method_label(method: str) -> str:
    return method if method in KNOWN_METHODS else OTHER


class LoadShed:
    """Refuses a ``POST /predict`` (``503``, through the front door) before its body is read or
    parsed when every variant that could answer it already has more queued work than the server's
    deadline allows (``expected_wait`` in seconds; a body's own ``timeout_ms`` is checked after
    parsing). Under overload most requests are refused, and parsing and validating each one first
    took the CPU the accepted ones needed."""

    def __init__(self, expected_wait, deadline_s: float, on_shed=lambda: None):
        self.expected_wait = expected_wait  # () -> float | None (None: not serving yet)
        self.deadline_s = deadline_s
        self.on_shed = on_shed

    def refusal(self, scope: dict) -> str | None:
        if scope["path"] != "/predict" or scope["method"] != "POST":
            return None
        wait = self.expected_wait()
        if wait is None or wait <= self.deadline_s:
            return None
        self.on_shed()
        return f"request could not start within its deadline (about {wait * 1000:.0f} ms of work queued)"
