"""Refusals every front end makes before any work: bodies too large or too slow, invalid input.

:class:`BodyLimitMiddleware` wraps every route (admin included, before its token is checked): a
``Content-Length`` over the cap is answered ``413`` without reading a byte, a chunked body is
counted while it is read and refused at the first byte over the cap, and a body that does not
arrive within the read deadline is answered ``408`` — so a 300 MB upload costs the server at
most the cap in memory, and a stalled upload cannot hold a request (or its metrics) forever.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

ModelT = TypeVar("ModelT", bound=BaseModel)


class BodyRefused(HTTPException):
    """An HTTPException, so that FastAPI's body parsing passes it on (it turns any other error
    while reading into a 400) and the app's exception handler renders it as JSON."""


async def send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodyLimitMiddleware:
    """Caps every request body at ``max_bytes`` and its arrival at ``read_timeout_s``."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await send_json(send, 413, {"detail": self._too_large()})
            return
        started = body_done = False
        deadline = time.monotonic() + self.read_timeout_s
        received = 0

        async def guarded_receive():
            nonlocal received, body_done
            if body_done:  # later receives wait for a disconnect, not for bytes: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise BodyRefused(408, f"request body not received within {self.read_timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyRefused(413, self._too_large())
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except BodyRefused as refused:
            if started:
                raise
            await send_json(send, refused.status_code, {"detail": refused.detail})

    def _too_large(self) -> str:
        return f"request body over the {self.max_bytes} byte limit (XMCSERVE_MAX_BODY_BYTES)"


def is_json(content_type: str | None) -> bool:
    """Whether a request's ``Content-Type`` announces JSON (none at all is taken as JSON, as
    FastAPI takes it): ``application/json`` or ``application/<anything>+json``."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def decode_body(model: type[ModelT], raw: bytes, content_type: str | None) -> ModelT:
    """The request model from the raw body in one pass: pydantic's JSON parser validates while it
    parses, where FastAPI's body parameter first builds the whole object tree with ``json.loads``
    and then validates it. Refusals are the :class:`RequestValidationError` FastAPI raises,
    worded as it words them (a JSON syntax error is a ``JSON decode error`` at the body)."""
    if not is_json(content_type):
        raise RequestValidationError(
            [{"type": "model_attributes_type", "loc": ("body",), "msg": "the body must be a JSON object"}]
        )
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = []
        for error in exc.errors(include_url=False, include_input=False):
            if error["type"] == "json_invalid":
                errors.append({"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"})
            else:
                errors.append({**error, "loc": ("body", *error["loc"])})
        raise RequestValidationError(errors) from None


def validation_error(request: Request, exc: RequestValidationError) -> Response:
    """422 with what is wrong and where, never the input itself: a 2 MB text would come back
    whole, and input that is not valid Unicode could not be encoded at all (ASCII JSON escapes
    whatever a location or message carries)."""
    detail = [{"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
    return Response(json.dumps({"detail": detail}), status_code=422, media_type="application/json")
