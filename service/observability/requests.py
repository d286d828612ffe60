"""Request ids and the access line, which :class:`~service.api.front_door.FrontDoorMiddleware`
gives every request of both front ends.

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
import uuid

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


class AccessLog:
    """One access line per request (logger ``xmcserve.access``). ``readable``: the text log format,
    where the message spells out the fields."""

    def __init__(self, readable: bool = False):
        self.readable = readable

    def write(
        self, scope, state: dict, headers: dict, status: int, error_body: bytes, seconds: float, tracing=None
    ) -> None:
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
        if tracing is not None and (trace_id := tracing.trace_id()) is not None:
            fields["trace_id"] = trace_id
        message = f"{scope['method']} {route} {status}"
        if self.readable:
            message += " " + " ".join(
                f"{k}={v}" for k, v in fields.items() if k not in ("request_id", "method", "route", "status")
            )
        access_log.log(level, message, extra=fields)
