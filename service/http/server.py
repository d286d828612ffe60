"""``python -m service.http``: uvicorn with the connection limits a public server needs.

Uvicorn bounds connections (``limit_concurrency``: a 503 beyond it) and header size
(``h11_max_incomplete_event_size``), but it waits for a connection's request headers forever:
a client that opens connections and sends nothing, or a header a byte a minute, would hold
descriptors until the cap refuses everyone else. :class:`HeaderTimeoutProtocol` closes a
connection whose next request's headers have not arrived within ``XMCSERVE_HEADER_TIMEOUT_S``
(the body has its own deadline, :mod:`service.api.guards`).

Nor does uvicorn bound a response's sending: a client that asks for a large answer and never
reads it keeps the answer in the transport's buffer for as long as it keeps the connection open
(closing a transport waits until its buffer is sent), so such clients, up to the connection cap,
hold that much memory each. The protocol also aborts a connection whose send buffer stays full
(the transport paused writing, the client reading nothing) for ``XMCSERVE_WRITE_TIMEOUT_S``,
like nginx's ``send_timeout``: the buffer is dropped and the application's next send returns.
"""

from __future__ import annotations

import argparse

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.http.settings import LogSettings, ServerSettings
from service.observability.logs import configure_logging


class HeaderTimeoutProtocol(H11Protocol):
    """h11 with a deadline for each request's headers, from connection or last response on, and
    one for the client to make room in a full send buffer."""

    header_timeout_s = 10.0
    write_timeout_s = 15.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline = None
        self._write_deadline = None
        self._await_headers()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.write_timeout_s, self._write_late)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_deadline()

    def _stop_write_deadline(self) -> None:
        if getattr(self, "_write_deadline", None) is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_late(self) -> None:
        self._write_deadline = None
        self.transport.abort()  # not close(): close() would wait to send what the client does not read

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_waiting(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()

    def connection_lost(self, exc) -> None:
        self._stop_waiting()
        self._stop_write_deadline()
        super().connection_lost(exc)


def protocol_for(settings: ServerSettings) -> type[HeaderTimeoutProtocol]:
    timeout = {"header_timeout_s": settings.header_timeout_s, "write_timeout_s": settings.write_timeout_s}
    return type("ConfiguredHeaderTimeoutProtocol", (HeaderTimeoutProtocol,), timeout)


def uvicorn_options(settings: ServerSettings) -> dict:
    """Everything uvicorn is told besides the app, host and port."""
    return {
        "factory": True,
        "http": protocol_for(settings),
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_s,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "timeout_graceful_shutdown": settings.graceful_shutdown_s,
        "access_log": False,  # the app writes its own access line (request id, variant, timings)
        "log_config": None,  # uvicorn's loggers go through the app's logging configuration
    }


def main(argv: list[str] | None = None) -> None:
    settings = ServerSettings()
    parser = argparse.ArgumentParser(prog="python -m service.http", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=settings.host, help="address to listen on (XMCSERVE_HOST)")
    parser.add_argument("--port", type=int, default=settings.port, help="port to listen on (XMCSERVE_PORT)")
    args = parser.parse_args(argv)
    logs = LogSettings()
    configure_logging(logs.format, logs.level)
    uvicorn.run("service.http.app:create_app", host=args.host, port=args.port, **uvicorn_options(settings))
