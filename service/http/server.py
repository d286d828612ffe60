"""``python -m service.http``: uvicorn on uvloop with the httptools parser, and the connection
limits a public server needs.

The parser and the loop are the compiled ones (``httptools``, ``uvloop``) rather than uvicorn's
pure-Python ``h11`` protocol on the default asyncio loop, whose CPU per request was a large part
of everything the server does besides the encoder (``bench.serving --null-encoder``).

Uvicorn bounds connections (``limit_concurrency``: a 503 beyond it), but with httptools it bounds
neither the size of a request's headers nor the time they take: a client that opens connections
and sends nothing, or a header a byte a minute, would hold descriptors until the cap refuses
everyone else, and one endless header would grow the parser's buffer. :class:`GuardedProtocol`
answers ``431`` to headers over ``XMCSERVE_MAX_HEADER_BYTES`` and closes a connection whose next
request's headers have not arrived within ``XMCSERVE_HEADER_TIMEOUT_S`` (the body has its own
deadline, :mod:`service.api.body_guards`).

Requests pipelined on one connection (sent before the previous answer) are answered in order,
refusals included: a request the parser refuses (malformed, headers too large) is answered after
the requests before it, which were handed to the app and may have changed something (an append),
instead of cutting their answers off. Only the current request's header bytes count against the
header cap, never a body, whichever chunks they arrive in.

Each request's scope carries its connection's :class:`~service.http.disconnect.ClientGone`
(``scope["extensions"]["xmcserve.client_gone"]``), which the protocol fires when the connection is
lost: a handler waiting for its batch learns that its client left without a task per request
waiting on ``receive()``.

Nor does uvicorn bound a response's sending: a client that asks for a large answer and never
reads it keeps the answer in the transport's buffer for as long as it keeps the connection open
(closing a transport waits until its buffer is sent), so such clients, up to the connection cap,
hold that much memory each. The protocol also aborts a connection whose send buffer stays full
(the transport paused writing, the client reading nothing) for ``XMCSERVE_WRITE_TIMEOUT_S``,
like nginx's ``send_timeout``: the buffer is dropped and the application's next send returns.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.http.disconnect import EXTENSION, ClientGone
from service.http.group import RUN_DIR_ENV, WORKERS_ENV, WorkerGroup
from service.http.settings import LogSettings, ServerSettings
from service.observability.logs import configure_logging

log = logging.getLogger("xmcserve")

_TOO_LARGE_BODY = b"request headers over the size limit (XMCSERVE_MAX_HEADER_BYTES)"
HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: " + str(len(_TOO_LARGE_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + _TOO_LARGE_BODY
)


# How early a loop timer may fire (uvloop's clock counts milliseconds).
TIMER_RESOLUTION_S = 0.001


def cancelled(timer) -> None:
    """Cancel a pending ``call_later`` handle (None: nothing pending); returns None to store."""
    if timer is not None:
        timer.cancel()


class HeadersTooLarge(Exception):
    """Raised from a parser callback: the parser stops there, and the protocol answers 431."""


class GuardedProtocol(HttpToolsProtocol):
    """httptools with a size cap and a deadline for each request's headers (from connection or
    last response on), pipelined requests answered in order (refusals included), and a deadline
    for the client to make room in a full send buffer."""

    header_timeout_s = 10.0
    write_timeout_s = 15.0
    max_header_bytes = 16384
    # At shutdown, how long a connection with no request in progress may still deliver one.
    drain_grace_s = 1.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._client_gone = ClientGone()
        self._header_deadline = None  # the connection's one header timer (see _await_headers)
        self._header_timer_at = 0.0  # when it fires
        self._headers_due: float | None = None  # when the awaited headers are late; None: none awaited
        self._write_deadline = None
        # header accounting: see data_received
        self._header_bytes: int | None = None  # the incomplete headers' bytes in earlier chunks; None: none
        self._began_here = False  # the incomplete headers began in the chunk being fed
        self._known = 0  # bytes of the chunk being fed known to precede the incomplete headers
        self._chunk_body = 0  # body bytes of the current chunk of a chunked body
        self._in_body = False  # after the last request's headers, before its end
        # answers in order
        self._unanswered = 0  # requests handed to the app (running or queued) and not answered yet
        self._refusal = None  # a refusal waiting for the answers owed before it
        self._headers_refused = False
        self._draining = False
        self._await_headers()

    # Header size. httptools holds a header line until it ends, without a callback, so a single
    # endless header is only seen as the bytes fed while a request's headers are incomplete. The
    # chunk a request's headers began in also holds what preceded them: the end of the previous
    # request (its headers, body, chunked framing), which the parser reported and is subtracted.
    # Later chunks fed while the headers are still incomplete are all header bytes. Once complete,
    # the headers are measured exactly (on_headers_complete). Never reset by a response: a
    # pipelined request's headers or body may arrive before or after the previous answer.

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # the parser stopped at the refused request; nothing after it is read
        self._known, self._began_here = 0, False
        super().data_received(data)
        if self._header_bytes is None or self._refusal is not None or self.transport.is_closing():
            return
        if self._began_here:
            self._header_bytes = max(0, len(data) - self._known)
        else:
            self._header_bytes += len(data)
        if self._header_bytes > self.max_header_bytes:
            self._refuse_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {EXTENSION: self._client_gone}
        self._header_bytes, self._began_here = 0, True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_body:  # a trailer after a chunked body: it precedes the next request
            self._known += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_header_bytes:
            self._headers_refused = True
            raise HeadersTooLarge  # the parser turns it into an error: send_400_response below
        self._known += max(0, self._sent_header_size() - (self._header_bytes or 0))
        self._header_bytes, self._in_body = None, True
        self._stop_waiting()  # a request's headers arrived
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:
            self._unanswered += 1
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False  # answered, then closed: the server is stopping

    def _sent_header_size(self) -> int:
        """The header section as the client sent it, rebuilt from what the parser reported: the
        request line and one "name: value" line per field (the spacing most clients send; other
        spacing only moves a few bytes to or from the count of a request that follows in the
        same chunk)."""
        request_line = len(self.parser.get_method()) + len(self.url) + len(b"  HTTP/1.1\r\n")
        return request_line + sum(len(name) + len(value) + 4 for name, value in self.headers) + 2

    def on_body(self, body: bytes) -> None:
        self._known += len(body)
        self._chunk_body += len(body)
        super().on_body(body)

    def on_chunk_header(self) -> None:
        self._chunk_body = 0

    def on_chunk_complete(self) -> None:
        self._known += len(b"%x" % self._chunk_body) + 4  # size line and the data's closing CRLF

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    # refusals, in order

    def send_400_response(self, msg: str) -> None:
        if self._headers_refused:
            self._refuse(self._send_431_response)
        else:
            self._refuse(functools.partial(super().send_400_response, msg))

    def _refuse_headers(self) -> None:
        self._headers_refused = True
        self._refuse(self._send_431_response)

    def _send_431_response(self) -> None:
        self.transport.write(HEADERS_TOO_LARGE)
        self.transport.close()

    def _refuse(self, answer) -> None:
        """``answer`` (which writes the refusal and closes) now, or after the answers owed to the
        requests before the refused one. A request whose body the parser refused is itself
        answered by the refusal: dropped unstarted if it waits behind another (the app never sees
        it), else its app reads a disconnect."""
        self._stop_waiting()
        owed, cycle = self._unanswered, self.cycle
        if self._in_body and cycle is not None and not cycle.response_complete:
            owed -= 1  # the refused request is the last one handed to the app: the refusal answers it
            if self.pipeline and self.pipeline[0][0] is cycle:  # queued behind another (newest first)
                self.pipeline.popleft()
                self._unanswered -= 1
        if owed > 0:
            self._refusal = answer
        else:
            answer()

    # header deadline: one timer per connection, not one made and cancelled per request. Awaiting
    # the next request's headers moves the time they are due; the timer moves only to an earlier
    # time, and when it fires before the headers are due it is set again for then.

    def _await_headers(self, within_s: float | None = None) -> None:
        due = self.loop.time() + (self.header_timeout_s if within_s is None else within_s)
        self._headers_due = due
        if self._header_deadline is None or due < self._header_timer_at:
            self._set_header_timer(due)

    def _set_header_timer(self, when: float) -> None:
        cancelled(self._header_deadline)
        self._header_timer_at = when
        self._header_deadline = self.loop.call_at(when, self._headers_late)

    def _stop_waiting(self) -> None:
        """No headers awaited (the timer, if set, finds nothing to do when it fires)."""
        self._headers_due = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        due = self._headers_due
        if due is None:
            return
        if due > self.loop.time() + TIMER_RESOLUTION_S:  # awaited again since the timer was set
            self._set_header_timer(due)
            return
        self._headers_due = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def on_response_complete(self) -> None:
        self._unanswered -= 1
        super().on_response_complete()  # starts the next pipelined request, if any
        if self.transport.is_closing():
            return
        if self._refusal is None:
            self._await_headers()
        elif not self._unanswered:
            answer, self._refusal = self._refusal, None
            answer()

    # shutdown

    def shutdown(self) -> None:
        """Uvicorn closes a connection with no request in progress at once. A client that has
        just sent one (still on the wire, or unread in the socket) would then read a reset and
        lose it. Such a connection is given :attr:`drain_grace_s` for its request, which is
        answered with ``connection: close``; without one it closes then. The server's graceful
        shutdown waits for it like for a request in progress."""
        if self.cycle is None or self.cycle.response_complete:
            self._draining = True
            self._stop_waiting()
            self._await_headers(self.drain_grace_s)
            return
        super().shutdown()

    # write deadline

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.write_timeout_s, self._write_late)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_deadline()

    def _stop_write_deadline(self) -> None:
        self._write_deadline = cancelled(getattr(self, "_write_deadline", None))

    def _write_late(self) -> None:
        self._write_deadline = None
        self.transport.abort()  # not close(): close() would wait to send what the client does not read

    def connection_lost(self, exc) -> None:
        self._stop_waiting()
        self._header_deadline = cancelled(getattr(self, "_header_deadline", None))
        self._stop_write_deadline()
        super().connection_lost(exc)
        self._client_gone.lost()  # the requests still waiting for their answers stop waiting


def protocol_for(settings: ServerSettings) -> type[GuardedProtocol]:
    guards = {
        "header_timeout_s": settings.header_timeout_s,
        "write_timeout_s": settings.write_timeout_s,
        "max_header_bytes": settings.max_header_bytes,
    }
    return type("ConfiguredGuardedProtocol", (GuardedProtocol,), guards)


def uvicorn_options(settings: ServerSettings) -> dict:
    """Everything uvicorn is told besides the app, host and port."""
    return {
        "factory": True,
        "http": protocol_for(settings),
        "loop": "uvloop",
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_s,
        "timeout_graceful_shutdown": settings.graceful_shutdown_s,
        "access_log": False,  # the app writes its own access line (request id, variant, timings)
        "log_config": None,  # uvicorn's loggers go through the app's logging configuration
    }


def __getattr__(name: str):
    # A worker process of a group (spawned, so given its options by import path, not as a class
    # built in the supervisor) takes its protocol's limits from the environment as the supervisor did.
    if name == "EnvironmentGuardedProtocol":
        return protocol_for(ServerSettings())
    raise AttributeError(name)


def create_worker_app():
    """The app of one worker process of a group (``XMCSERVE_WORKERS`` > 1), started by uvicorn's
    supervisor: logging as the supervisor's, appends written in turns with the other workers, and
    the group's shared state (:mod:`service.http.group`)."""
    from service.engine import share_writes
    from service.http.app import create_app

    logs = LogSettings()
    configure_logging(logs.format, logs.level)
    group = WorkerGroup.from_environment()
    if group is None:
        raise RuntimeError(f"a worker app needs {RUN_DIR_ENV} and {WORKERS_ENV} (set by python -m service.http)")
    share_writes()
    return create_app(group=group)


def serve_workers(
    host: str, port: int, settings: ServerSettings, app: str = "service.http.server:create_worker_app"
) -> None:
    """``settings.workers`` processes on one socket under uvicorn's supervisor (which restarts a
    worker that dies), sharing a run directory emptied first (:meth:`WorkerGroup.prepare`).
    ``app``: the import path of each worker's app factory (a benchmark's wraps
    :func:`create_worker_app`)."""
    run_dir = settings.run_dir or Path(tempfile.mkdtemp(prefix="xmcserve-run-"))
    WorkerGroup.prepare(run_dir)
    # read by the workers, which the supervisor spawns (a fresh interpreter each): prometheus-client
    # takes its multiprocess directory from the environment when it is first imported
    os.environ[RUN_DIR_ENV] = str(run_dir.resolve())
    os.environ[WORKERS_ENV] = str(settings.workers)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str((run_dir / "metrics").resolve())
    options = {**uvicorn_options(settings), "http": "service.http.server:EnvironmentGuardedProtocol"}
    log.info(
        "starting %d workers on %s:%d, run directory %s",
        settings.workers,
        host,
        port,
        run_dir,
        extra={"event": "workers_starting", "workers": settings.workers, "run_dir": str(run_dir)},
    )
    try:
        uvicorn.run(app, host=host, port=port, workers=settings.workers, **options)
    finally:
        if settings.run_dir is None:  # a directory of this run's own: nothing in it outlives the server
            shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    settings = ServerSettings()
    parser = argparse.ArgumentParser(prog="python -m service.http", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=settings.host, help="address to listen on (XMCSERVE_HOST)")
    parser.add_argument("--port", type=int, default=settings.port, help="port to listen on (XMCSERVE_PORT)")
    parser.add_argument(
        "--workers", type=int, default=settings.workers, help="server processes on the port (XMCSERVE_WORKERS)"
    )
    args = parser.parse_args(argv)
    logs = LogSettings()
    configure_logging(logs.format, logs.level)
    if args.workers > 1:
        serve_workers(args.host, args.port, settings.model_copy(update={"workers": args.workers}))
        return
    uvicorn.run("service.http.app:create_app", host=args.host, port=args.port, **uvicorn_options(settings))
