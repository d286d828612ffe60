"""Everything a request meets before a route, in one ASGI layer: :class:`FrontDoorMiddleware`.

Both front ends put it outermost (under the tracing instrumentation, when on). In order:

1. the request id (:func:`~service.observability.requests.accepted_request_id`), returned on every
   answer, refusals and errors included, and set for every log line of the request;
2. a ``Content-Length`` that is not one number is answered ``400`` (:func:`declared_length`), one
   over the body cap ``413``, both without reading a byte;
3. optionally, a load shed (:class:`~service.http.guards.LoadShed`): a ``POST /predict`` refused
   ``503`` before its body is read when the queues already hold more work than its deadline;
4. the route, its body read through one receive wrapper that counts the bytes (``413`` at the
   first byte over the cap of a chunked body), holds the read deadline (``408``) and turns a
   connection that ends before the body into a ``400`` refusal;
5. the request's access line and, optionally, its request metrics.

One layer instead of one middleware per concern: each layer wrapped ``send`` and ``receive`` again
and ran its own coroutine per request, and the body deadline started a task per read
(``asyncio.wait_for``); here the deadline is a timer on the loop (``asyncio.timeout_at``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import Protocol

from service.api.body_guards import BodyRefused, send_json
from service.observability.logs import REQUEST_ID
from service.observability.requests import HEADER, AccessLog, accepted_request_id

# Most digits of a Content-Length, leading zeros included: enough for any 64-bit size. A bound on
# the string, not only on the value: int() refuses over 4300 digits (ValueError, a 500), and the
# HTTP parser, which refuses a value over 64 bits, lets any number of leading zeros through.
LENGTH_DIGITS = 20


class BadContentLength(ValueError):
    """A ``Content-Length`` that is not one non-negative decimal number of at most
    :data:`LENGTH_DIGITS` digits."""


def declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The request's ``Content-Length`` from its ``(name, value)`` header pairs (names in lower
    case, as ASGI gives them); None without one. Each value is 1 to :data:`LENGTH_DIGITS` ASCII
    digits between optional spaces or tabs, leading zeros allowed; repeated values, or a
    comma-separated list of them, are accepted when they are all the same number (RFC 9110,
    8.6). Raises :class:`BadContentLength` for anything else: a sign, a non-digit, an empty
    value, too many digits, two different numbers."""
    found = None
    for name, value in headers:
        if name != b"content-length":
            continue
        for item in value.split(b","):
            digits = item.strip(b" \t")
            if not digits.isdigit():  # bytes: ASCII digits only, and not empty
                raise BadContentLength("Content-Length is not a number (ASCII digits only)")
            if len(digits) > LENGTH_DIGITS:
                raise BadContentLength(f"Content-Length has over {LENGTH_DIGITS} digits")
            number = int(digits)
            if found is not None and number != found:
                raise BadContentLength("Content-Length given twice, as two different numbers")
            found = number
    return found


class Shed(Protocol):
    def refusal(self, scope: dict) -> str | None:
        """Why the request is refused before its body is read, or None to serve it."""


class RequestObserver(Protocol):
    def started(self) -> None: ...

    def finished(self, scope: dict, status: int, seconds: float) -> None: ...


class FrontDoorMiddleware:
    """``max_body_bytes`` and ``body_timeout_s``: the body cap and read deadline of every route
    (admin included, before its token is checked). ``access_log``: None writes no access line
    (ids only). ``tracing``: a :class:`~service.observability.tracing.Tracing` or None."""

    def __init__(
        self,
        app,
        *,
        max_body_bytes: int,
        body_timeout_s: float,
        access_log: AccessLog | None = None,
        tracing=None,
        shed: Shed | None = None,
        observer: RequestObserver | None = None,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.access_log = access_log
        self.tracing = tracing
        self.shed = shed
        self.observer = observer

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
        if self.observer is not None:
            self.observer.started()
        try:
            if (refusal := self.refused_length(scope)) is not None:
                await send_json(send_with_id, refusal[0], {"detail": refusal[1]})
            elif self.shed is not None and (reason := self.shed.refusal(scope)) is not None:
                await send_json(send_with_id, 503, {"detail": reason}, [(b"retry-after", b"1")])
            else:
                try:
                    await self.app(scope, self.capped(receive), send_with_id)
                except BodyRefused as refused:
                    if responded:
                        raise
                    await send_json(send_with_id, refused.status_code, {"detail": refused.detail})
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
            seconds = time.perf_counter() - started
            if self.observer is not None:
                self.observer.finished(scope, status, seconds)
            if self.access_log is not None:
                self.access_log.write(scope, state, headers, status, error_body, seconds, self.tracing)
            REQUEST_ID.reset(token)

    def refused_length(self, scope) -> tuple[int, str] | None:
        """``(status, detail)`` for a ``Content-Length`` that is not one number (``400``) or is
        over the body cap (``413``); None to read the body."""
        try:
            declared = declared_length(scope["headers"])
        except BadContentLength as exc:
            return 400, str(exc)
        if declared is not None and declared > self.max_body_bytes:
            return 413, self.too_large()
        return None

    def capped(self, receive):
        """``receive`` that refuses a body over the cap, late or cut off by the end of the
        connection (:class:`BodyRefused`, which the route's body parsing passes on). After the
        last body chunk, a receive waits for the client's disconnect: no deadline then."""
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        received = 0
        body_done = False

        async def capped_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyRefused(408, f"request body not received within {self.body_timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyRefused(413, self.too_large())
                body_done = not message.get("more_body", False)
            elif message["type"] == "http.disconnect":
                # The connection ended before the body did: the client left, or the server refused
                # the rest (a malformed chunk, answered 400 by the HTTP parser). A 400 for the log
                # and metrics; Starlette's ClientDisconnect would end the request as a 500 with a
                # traceback.
                raise BodyRefused(400, "the connection ended before the request body did")
            return message

        return capped_receive

    def too_large(self) -> str:
        return f"request body over the {self.max_body_bytes} byte limit (XMCSERVE_MAX_BODY_BYTES)"
