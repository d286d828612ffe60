"""Request ids and the access line: :class:`RequestContextMiddleware`, outermost on both front ends.

``X-Request-Id`` from the client is kept when it is a plausible id (1-128 characters of
``A-Z a-z 0-9 . _ : -``), otherwise one is generated; it is returned on every answer, refusals
and errors included, set as :data:`~service.observability.logs.REQUEST_ID` for every log line of
the request, and passed on by whoever calls further (the shadow copy, the Ray parts).

One access line per request (logger ``xmcserve.access``): route, status, total milliseconds, and
what the handler put in ``scope["state"]`` (variant, bundle id, texts, k, queue wait); for an
answer of 400 and above, the refusal's ``detail`` as ``reason``.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from service.observability.logs import REQUEST_ID

HEADER = b"x-request-id"
VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# What the access line copies from scope["state"], as the handler names it.
STATE_FIELDS = ("variant", "bundle_id", "texts", "k", "queue_ms", "request_texts")
REASON_CHARS = 300
SHADOW_OF_CHARS = 1024

access_log = logging.getLogger("xmcserve.access")


def new_request_id() -> str:
    return uuid.uuid4().hex


def accepted_request_id(value: bytes | None) -> str:
    """The client's id when it is valid, else a new one."""
    if value is not None and len(value) <= 128:
        text = value.decode("latin-1")
        if VALID_ID.fullmatch(text):
            return text
    return new_request_id()


def refusal_reason(body: bytes) -> str | None:
    """The ``detail`` of a JSON error body, in one short line."""
    try:
        detail = json.loads(body).get("detail")
    except (ValueError, AttributeError):
        return None
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):  # a validation error
        first = detail[0]
        detail = f"{first.get('msg')} at {'.'.join(map(str, first.get('loc', [])))}" + (
            f" (+{len(detail) - 1} more)" if len(detail) > 1 else ""
        )
    return None if detail is None else str(detail)[:REASON_CHARS]


class RequestContextMiddleware:
    """Request id in and out, and the access line (``access_log=False``: ids only).
    ``readable``: the text log format, where the access message spells out the fields."""

    def __init__(self, app, access_log: bool = True, readable: bool = False, tracing=None):
        self.app = app
        self.access_log = access_log
        self.readable = readable
        self.tracing = tracing  # a service.observability.tracing.Tracing, or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = accepted_request_id(headers.get(HEADER))
        token = REQUEST_ID.set(request_id)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        if self.tracing is not None:
            self.tracing.tag_request(request_id)
        status, error_body, responded = 500, b"", False
        id_header = (HEADER, request_id.encode())

        async def send_with_id(message):
            nonlocal status, error_body, responded
            if message["type"] == "http.response.start":
                status, responded = message["status"], True
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            elif message["type"] == "http.response.body" and status >= 400 and len(error_body) < 4096:
                error_body += message.get("body", b"")
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # Starlette's outermost error middleware would answer 500 without the id: answer here
            # (it sees the response started and only re-raises, for the server to log the trace).
            if not responded:
                body = json.dumps({"detail": "internal server error"}).encode()
                await send_with_id(
                    {"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json")]}
                )
                await send_with_id({"type": "http.response.body", "body": body})
            raise
        finally:
            if self.access_log:
                self.log(scope, state, headers, status, error_body, time.perf_counter() - started)
            REQUEST_ID.reset(token)

    def log(self, scope, state: dict, headers: dict, status: int, error_body: bytes, seconds: float) -> None:
        level = logging.WARNING if status >= 500 else logging.INFO
        if not access_log.isEnabledFor(level):  # e.g. XMCSERVE_LOG_LEVEL=WARNING: build nothing per request
            return
        route = getattr(scope.get("route"), "path", None) or scope["path"][:200]
        fields = {
            "request_id": state["request_id"],
            "method": scope["method"],
            "route": route,
            "status": status,
            "total_ms": round(seconds * 1000, 3),
        }
        for name in STATE_FIELDS:
            if name in state:
                fields[name] = state[name]
        if status >= 400:
            reason = refusal_reason(error_body) if error_body else ("client gone" if status == 499 else None)
            if reason:
                fields["reason"] = reason
        if (shadow_of := headers.get(b"x-shadow")) is not None:
            fields["shadow_of"] = shadow_of.decode("latin-1")[:SHADOW_OF_CHARS]
        if self.tracing is not None and (trace_id := self.tracing.trace_id()) is not None:
            fields["trace_id"] = trace_id
        message = f"{scope['method']} {route} {status}"
        if self.readable:
            message += " " + " ".join(
                f"{k}={v}" for k, v in fields.items() if k not in ("request_id", "method", "route", "status")
            )
        access_log.log(level, message, extra=fields)
