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
header cap, never a body, chunk framing or spacing of the request before, whichever chunks they
arrive in. Nor is a connection parsed further ahead of its answers than
``XMCSERVE_PIPELINE_MAX_REQUESTS`` requests and ``XMCSERVE_PIPELINE_MAX_BYTES`` bytes, or past the
request in progress while its client reads no answers: the rest stays in the socket, reading
paused, so a client pipelining requests it never reads the answers to holds a bounded amount.

Each request's scope carries its connection's :class:`~service.http.disconnect.ClientGone`
(``scope["extensions"]["xmcserve.client_gone"]``), which the protocol fires when the connection is
lost: a handler waiting for its batch learns that its client left without a task per request
waiting on ``receive()``.

Nor does uvicorn bound a response's sending: a client that asks for a large answer and never
reads it keeps the answer in the transport's buffer for as long as it keeps the connection open
(closing a transport waits until its buffer is sent), so such clients, up to the connection cap,
hold that much memory each. The protocol also aborts a connection whose send buffer stays full
(the transport paused writing, the client reading nothing) for ``XMCSERVE_WRITE_TIMEOUT_S``,
like nginx's ``send_timeout``: the connection is reset, the buffer dropped (the kernel's too) and
the application's next send returns.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.http.disconnect import EXTENSION, ClientGone
from service.http.group import RUN_DIR_ENV, WORKERS_ENV, WorkerGroup
from service.http.settings import LogSettings, ServerSettings
from service.observability.logs import configure_logging
from xmc.command import program

log = logging.getLogger("xmcserve")

_TOO_LARGE_BODY = b"request headers over the size limit (XMCSERVE_MAX_HEADER_BYTES)"
HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: " + str(len(_TOO_LARGE_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + _TOO_LARGE_BODY
)


# How early a loop timer may fire (uvloop's clock counts milliseconds).
TIMER_RESOLUTION_S = 0.001

# The fewest bytes a request takes: a 3-letter method, a 1-byte target, "HTTP/1.1" and its CRLFs
# are 18 (the parser refuses a LF without its CR); 16 leaves room for a laxer parser.
MIN_REQUEST_BYTES = 16
# Less room than this behind queued requests is not fed: a slice that small costs a parser call
# for a few bytes of headers that are not counted until they are complete.
HOLD_BELOW_BYTES = 1024
UNKNOWN_OPEN = 1 << 62  # a unit in progress that began before the bytes kept of the last slice

# SO_LINGER on, 0 seconds: closing the socket resets the connection and drops its unsent bytes
RESET_ON_CLOSE = struct.pack("ii", 1, 0)


def _length(value: bytes) -> int:
    """A Content-Length value as the parser read it (it refuses any that is not one number)."""
    try:
        return int(value)
    except ValueError:
        return 0


def cancelled(timer) -> None:
    """Cancel a pending ``call_later`` handle (None: nothing pending); returns None to store."""
    if timer is not None:
        timer.cancel()


class HeadersTooLarge(Exception):
    """Raised from a parser callback: the parser stops there, and the protocol answers 431."""


class HeldFlow(FlowControl):
    """uvicorn's flow control, whose reading stays paused while ``holding()``: uvicorn resumes
    reading after every answer and at every ``receive()``, whatever was read ahead."""

    def __init__(self, transport, holding):
        super().__init__(transport)
        self._holding = holding

    def resume_reading(self) -> None:
        if not self._holding():
            super().resume_reading()


class GuardedProtocol(HttpToolsProtocol):
    """httptools with a size cap and a deadline for each request's headers (from connection or
    last response on), pipelined requests answered in order (refusals included) and parsed no
    further ahead of their answers than the pipeline caps, and a deadline for the client to make
    room in a full send buffer."""

    header_timeout_s = 10.0
    write_timeout_s = 15.0
    max_header_bytes = 16384
    pipeline_max_requests = 32
    pipeline_max_bytes = 262144
    # At shutdown, how long a connection with no request in progress may still deliver one.
    drain_grace_s = 1.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.flow = HeldFlow(transport, self._holding)  # before any cycle takes it
        self._client_gone = ClientGone()
        self._header_deadline = None  # the connection's one header timer (see _await_headers)
        self._header_timer_at = 0.0  # when it fires
        self._headers_due: float | None = None  # when the awaited headers are late; None: none awaited
        self._write_deadline = None
        # reading ahead: see data_received
        self._held = b""  # bytes read and not fed to the parser yet
        self._queued: dict = {}  # each request parsed ahead (queued behind another) -> its bytes
        self._queued_bytes = 0  # their sum
        self._body_left = 0  # Content-Length bytes still to come of the last parsed request's body
        self._feeding = False
        # header accounting: see _feed_slice
        self._buf = b""  # the slice being fed, after the last bytes of the slice before
        self._base = 0  # where in _buf the slice begins
        self._pos = 0  # where in _buf the parse unit in progress (headers, chunk line, ...) begins
        self._exact = True  # _pos is that unit's first byte (else the unit began before _buf)
        self._open = 0  # bytes of the unit in progress when the last slice ended
        self._header_start: int | None = None  # in _buf: where incomplete headers began in this slice
        self._header_bytes: int | None = None  # the incomplete headers' bytes in earlier slices; None: none
        self._chunk_data = False  # the current chunk of a chunked body had data (not the last chunk)
        self._in_body = False  # after the last request's headers, before its end
        # answers in order
        self._unanswered = 0  # requests handed to the app (running or queued) and not answered yet
        self._refusal = None  # a refusal waiting for the answers owed before it
        self._headers_refused = False
        self._draining = False
        self._await_headers()

    # Reading ahead. httptools parses every request in the bytes it is fed, and uvicorn queues
    # each one behind the request being answered and resumes reading after every answer: a
    # client that pipelines requests and reads no answers had all it sent parsed and queued. The
    # parser is fed in slices no larger than the budget (_budget), and what is over it is held,
    # with reading paused, until answers make room, as h11 and nginx read no further than they
    # answer. A slice gets MIN_REQUEST_BYTES per request still allowed ahead (after what is left
    # of the current Content-Length body): it cannot hold more requests' headers than that.

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # the parser stopped at the refused request; nothing after it is read
        self._unset_keepalive_if_required()  # not idle, whether what came is parsed now or held
        if self._held:  # reading is paused while bytes are held; anything read still goes after them
            self._held += data
            return
        self._feed(data)

    def _budget(self) -> int:
        """How many bytes the parser may be fed now: none while the requests parsed ahead of the
        answer being written reach ``pipeline_max_requests`` or ``pipeline_max_bytes``, nor while
        the client reads no answers (the send buffer over its high-water mark) and the next
        request's headers are due."""
        ahead = len(self.pipeline)
        room = self.pipeline_max_bytes - self._queued_bytes
        if ahead >= self.pipeline_max_requests or room <= 0 or (self.flow.write_paused and not self._in_body):
            return 0
        if ahead and room < HOLD_BELOW_BYTES:
            # nearly full: slices of the few bytes left would feed the parser a call per byte (a
            # 16 KiB header held the loop ~30 ms); wait for an answer to make room
            return 0
        return min(self._body_left + (self.pipeline_max_requests - ahead) * MIN_REQUEST_BYTES, room)

    def _stopped(self) -> bool:
        """Nothing more is parsed: a refusal, a closing transport, or an upgrade (the parser stops
        there, and uvicorn drops the rest of what it read, or hands the connection over)."""
        return (
            self._refusal is not None
            or self.parser is None
            or self.transport.is_closing()
            # uvicorn takes the connection over only for a WebSocket; any other Upgrade (h2c) is
            # answered as plain HTTP/1.1 and the connection goes on
            or (self.parser.should_upgrade() and self._should_upgrade())
        )

    def _holding(self) -> bool:
        return bool(self._held) or not self._budget()

    def _feed(self, data: bytes) -> None:
        self._feeding = True
        try:
            offset = 0
            while offset < len(data) and not self._stopped():
                budget = self._budget()
                if not budget:
                    self._held = data[offset:]
                    self.flow.pause_reading()
                    return
                self._feed_slice(data[offset : offset + budget])
                offset += budget
        finally:
            self._feeding = False

    def _release(self) -> None:
        """Feed what was held as far as the budget now allows; read on once nothing is held."""
        if self._feeding or self._stopped():
            return
        if self._held and self._budget():
            held, self._held = self._held, b""
            self._feed(held)
        if not self._stopped() and not self._holding():
            self.flow.resume_reading()

    def _dequeued(self, cycle) -> None:
        self._queued_bytes -= self._queued.pop(cycle, 0)

    # Header size. httptools holds a header line until it ends, without a callback, so a single
    # endless header is only seen as the bytes fed while a request's headers are incomplete: from
    # the request's first byte in the slice it began in, then every later slice until they are
    # complete (then measured exactly, on_headers_complete). Where a request begins is where the
    # parser left off: the callbacks move _pos past each unit it consumed, found in the bytes
    # themselves (the end of the headers, a chunk's size line, a body's bytes, the trailers), so
    # neither the previous request's spacing nor its chunk framing is counted. The slice is kept
    # after the last bytes of the one before it: a delimiter may straddle them. Never reset by a
    # response: a pipelined request's headers or body may arrive before or after the previous answer.

    def _feed_slice(self, piece: bytes) -> None:
        tail = self._buf[-3:]
        self._buf, self._base = tail + piece, len(tail)
        self._exact = self._open <= len(tail)
        self._pos = len(tail) - self._open if self._exact else 0
        self._header_start = None
        super().data_received(piece)
        self._open = len(self._buf) - self._pos if self._exact else UNKNOWN_OPEN
        if self._header_bytes is None or self._refusal is not None or self.transport.is_closing():
            return
        if self._header_start is not None:
            self._header_bytes = len(self._buf) - max(self._header_start, self._base)
        else:
            self._header_bytes += len(piece)
        if self._header_bytes > self.max_header_bytes:
            self._refuse_headers()

    def _passed(self, end: int) -> None:
        """The unit in progress ended at ``end`` (in _buf): the next one begins there."""
        self._pos, self._exact = end, True

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {EXTENSION: self._client_gone}
        start = self._pos  # the parser skips empty lines before a request: it begins at its method
        while start < len(self._buf) and self._buf[start] in b"\r\n":
            start += 1
        self._passed(start)
        self._header_start, self._header_bytes = start, 0

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_header_bytes:
            self._headers_refused = True
            raise HeadersTooLarge  # the parser turns it into an error: send_400_response below
        end = self._buf.find(b"\r\n\r\n", self._pos)  # the parser takes only CRLF line ends
        self._passed(end + 4 if end >= 0 else len(self._buf))
        self._header_bytes, self._in_body = None, True
        self._body_left = next((_length(value) for name, value in self.headers if name == b"content-length"), 0)
        self._stop_waiting()  # a request's headers arrived
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:
            self._unanswered += 1
            if self.pipeline and self.pipeline[0][0] is self.cycle:  # parsed ahead, queued
                self._queued[self.cycle] = size
                self._queued_bytes += size
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False  # answered, then closed: the server is stopping

    def on_body(self, body: bytes) -> None:
        self._passed(self._pos + len(body))
        self._body_left = max(0, self._body_left - len(body))
        self._chunk_data = True
        if self.cycle in self._queued:
            self._queued[self.cycle] += len(body)
            self._queued_bytes += len(body)
        super().on_body(body)

    def on_chunk_header(self) -> None:
        end = self._buf.find(b"\n", self._pos)  # the size line, extensions and all
        self._passed(end + 1 if end >= 0 else len(self._buf))
        self._chunk_data = False

    def on_chunk_complete(self) -> None:
        if self._chunk_data:  # the CRLF after the chunk's data
            end = self._buf.find(b"\n", self._pos)
            self._passed(end + 1 if end >= 0 else len(self._buf))
        elif self._exact and self._buf.startswith(b"\r\n", self._pos):  # the last chunk, no trailers
            self._passed(self._pos + 2)
        else:  # the last chunk's trailers, up to the empty line
            end = self._buf.find(b"\r\n\r\n", self._pos)
            self._passed(end + 4 if end >= 0 else len(self._buf))

    def on_message_complete(self) -> None:
        self._in_body, self._body_left = False, 0
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
                self._dequeued(cycle)
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
        if self._held:  # its bytes came and are held, for a client reading no answers: see _write_late
            self._await_headers()
            return
        self._headers_due = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def on_response_complete(self) -> None:
        self._unanswered -= 1
        following = self.pipeline[-1][0] if self.pipeline else None
        super().on_response_complete()  # starts the next pipelined request, if any
        if following is not None and not (self.pipeline and self.pipeline[-1][0] is following):
            self._dequeued(following)  # no longer ahead: being answered
        if self.transport.is_closing():
            return
        if self._held:  # the next request came and is held: the connection is not idle
            self._unset_keepalive_if_required()
        if self._refusal is None:
            self._await_headers()
            self._release()
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
        self._release()  # the client reads again: parse on

    def _stop_write_deadline(self) -> None:
        self._write_deadline = cancelled(getattr(self, "_write_deadline", None))

    def _write_late(self) -> None:
        """Reset the connection: abort() drops the transport's buffer, and SO_LINGER 0 the kernel's
        (a plain close sends a FIN behind the unread bytes, which the kernel keeps trying to send
        outside the connection cap)."""
        self._write_deadline = None
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # already gone: nothing of it is kept either
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
        self.transport.abort()  # not close(): close() would wait to send what the client does not read

    def connection_lost(self, exc) -> None:
        self._held = b""
        self._queued.clear()
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
        "pipeline_max_requests": settings.pipeline_max_requests,
        "pipeline_max_bytes": settings.pipeline_max_bytes,
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
    from service.http.app import create_app

    logs = LogSettings()
    configure_logging(logs.format, logs.level)
    group = WorkerGroup.from_environment()
    if group is None:
        raise RuntimeError(f"a worker app needs {RUN_DIR_ENV} and {WORKERS_ENV} (set by python -m service.http)")
    return create_app(group=group)  # its engine appends in turns with the group's (EngineParams.shared_appends)


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
    parser = argparse.ArgumentParser(prog=program("service.http"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=settings.host, help="address to listen on (XMCSERVE_HOST)")
    parser.add_argument("--port", type=int, default=settings.port, help="port to listen on (XMCSERVE_PORT)")
    parser.add_argument(
        "--workers", type=int, default=settings.workers, help="server processes on the port (XMCSERVE_WORKERS)"
    )
    parser.add_argument(
        "--bundle", type=Path, default=None, help="the bundle to serve (XMCSERVE_BUNDLE_DIR; default bundles/default)"
    )
    args = parser.parse_args(argv)
    if args.bundle is not None:  # the setting, so every worker process and a reload see the same
        os.environ["XMCSERVE_BUNDLE_DIR"] = str(args.bundle)
    logs = LogSettings()
    configure_logging(logs.format, logs.level)
    if args.workers > 1:
        serve_workers(args.host, args.port, settings.model_copy(update={"workers": args.workers}))
        return
    uvicorn.run("service.http.app:create_app", host=args.host, port=args.port, **uvicorn_options(settings))
