"""Refusals the single server makes before any work: load shed before parsing, and the
bounded method label of its request metrics (the body limit and validation errors every front
end shares are in :mod:`service.api.guards`).
"""

from __future__ import annotations

from service.api.guards import send_json

# Every label value that comes from a client maps into a fixed set (bounded series in /metrics).
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
OTHER = "OTHER"


def method_label(method: str) -> str:
    return method if method in KNOWN_METHODS else OTHER


class ShedBeforeParsingMiddleware:
    """Refuses a ``POST /predict`` with ``503`` before its body is read or parsed when every
    variant that could answer it already has more queued work than the server's deadline allows
    (``expected_wait`` in seconds; a body's own ``timeout_ms`` is checked after parsing). Under
    overload most requests are refused, and parsing and validating each one first took the CPU
    the accepted ones needed."""

    def __init__(self, app, expected_wait, deadline_s: float, on_shed=lambda: None):
        self.app = app
        self.expected_wait = expected_wait  # () -> float | None (None: not serving yet)
        self.deadline_s = deadline_s
        self.on_shed = on_shed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/predict" and scope["method"] == "POST":
            wait = self.expected_wait()
            if wait is not None and wait > self.deadline_s:
                self.on_shed()
                detail = f"request could not start within its deadline (about {wait * 1000:.0f} ms of work queued)"
                await send_json(send, 503, {"detail": detail}, [(b"retry-after", b"1")])
                return
        await self.app(scope, receive, send)
