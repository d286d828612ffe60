"""Refusals every front end makes before any work: bodies too large or too slow, invalid input.

The body cap and read deadline are enforced by :class:`~service.api.front_door.FrontDoorMiddleware`
on every route (admin included, before its token is checked): a ``Content-Length`` over the cap is
answered ``413`` without reading a byte, a chunked body is counted while it is read and refused at
the first byte over the cap (:class:`BodyRefused`), and a body that does not arrive within the
read deadline is answered ``408`` — so a 300 MB upload costs the server at most the cap in memory,
and a stalled upload cannot hold a request (or its metrics) forever. This module holds the
refusal itself, the JSON error answer, and the one-pass body decoding of ``/predict``.
"""

from __future__ import annotations

import json
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
