"""Everything a request meets before a route, in one ASGI layer: :class:`FrontDoorMiddleware`.

Both front ends put it outermost (under the tracing instrumentation, when on). In order:

1. the request id (:func:`~service.observability.requests.accepted_request_id`), returned on every
   answer, refusals and errors included, and set for every log line of the request;
2. a ``Content-Length`` over the body cap is answered ``413`` without reading a byte;
3. optionally, a load shed (:class:`~service.http.guards.LoadShed`): a ``POST /predict`` refused
   ``503`` before its body is read when the queues already hold more work than its deadline;
4. the route, its body read through one receive wrapper that counts the bytes (``413`` at the
   first byte over the cap of a chunked body) and holds the read deadline (``408``);
5. the request's access line and, optionally, its request metrics.

One layer instead of one middleware per concern: each layer wrapped ``send`` and ``receive`` again
and ran its own coroutine per request, and the body deadline started a task per read
(``asyncio.wait_for``); here the deadline is a timer on the loop (``asyncio.timeout_at``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Protocol

from service.api.body_guards import BodyRefused, send_json
from service.observability.logs import REQUEST_ID
from service.observability.requests import HEADER, AccessLog, accepted_request_id


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
            declared = headers.get(b"content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
                await send_json(send_with_id, 413, {"detail": self.too_large()})
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

    def capped(self, receive):
        """``receive`` that refuses a body over the cap or late (:class:`BodyRefused`, which the
        route's body parsing passes on). After the last body chunk, a receive waits for the
        client's disconnect: no deadline then."""
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
            return message

        return capped_receive

    def too_large(self) -> str:
        return f"request body over the {self.max_body_bytes} byte limit (XMCSERVE_MAX_BODY_BYTES)"
