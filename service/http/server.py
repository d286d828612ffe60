"""``python -m service.http``: uvicorn with the connection limits a public server needs.

Uvicorn bounds connections (``limit_concurrency``: a 503 beyond it) and header size
(``h11_max_incomplete_event_size``), but it waits for a connection's request headers forever:
a client that opens connections and sends nothing, or a header a byte a minute, would hold
descriptors until the cap refuses everyone else. :class:`HeaderTimeoutProtocol` closes a
connection whose next request's headers have not arrived within ``XMCSERVE_HEADER_TIMEOUT_S``
(the body has its own deadline, :mod:`service.api.guards`).
"""

from __future__ import annotations

import argparse

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.http.settings import ServerSettings


class HeaderTimeoutProtocol(H11Protocol):
    """h11 with a deadline for each request's headers, from connection or last response on."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline = None
        self._await_headers()

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
        super().connection_lost(exc)


def protocol_for(settings: ServerSettings) -> type[HeaderTimeoutProtocol]:
    timeout = {"header_timeout_s": settings.header_timeout_s}
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
        "access_log": False,
    }


def main(argv: list[str] | None = None) -> None:
    settings = ServerSettings()
    parser = argparse.ArgumentParser(prog="python -m service.http", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=settings.host, help="address to listen on (XMCSERVE_HOST)")
    parser.add_argument("--port", type=int, default=settings.port, help="port to listen on (XMCSERVE_PORT)")
    args = parser.parse_args(argv)
    uvicorn.run("service.http.app:create_app", host=args.host, port=args.port, **uvicorn_options(settings))
