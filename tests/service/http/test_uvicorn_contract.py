"""What ``service.http.server.GuardedProtocol`` takes from uvicorn's private httptools protocol
(``uvicorn.protocols.http.httptools_impl``, no public API): the methods it overrides, with the
arguments it passes on, and the state it reads (``cycle``, ``pipeline``, ``parser``, ``flow``,
``headers``, ``url``, ``scope``) behaving as the protocol assumes. pyproject.toml pins uvicorn to
the minor release this was checked against; each failure here names what changed."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections import deque
from pathlib import Path

import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from service.http.server import GuardedProtocol, HeldFlow, protocol_for
from service.http.settings import ServerSettings

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"

# each method GuardedProtocol overrides (or uvicorn's code calls on it) -> its parameters
OVERRIDDEN = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "on_message_begin": ["self"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
    "send_400_response": ["self", "msg"],
    "shutdown": ["self"],
    "pause_writing": ["self"],
    "resume_writing": ["self"],
}
# uvicorn's methods GuardedProtocol calls
CALLED = {"_unset_keepalive_if_required": ["self"], "_should_upgrade": ["self"]}
FLOW_METHODS = ("pause_reading", "resume_reading", "pause_writing", "resume_writing", "drain")


def pin() -> Requirement:
    # a pattern, not tomllib: the project supports Python 3.10
    found = re.search(r'^\s*"(uvicorn[^"]*)",', PYPROJECT.read_text(), re.MULTILINE)
    assert found, "pyproject.toml lists no uvicorn dependency"
    return Requirement(found.group(1))


def broken(what: str) -> str:
    return (
        f"uvicorn {uvicorn.__version__}: {what}. GuardedProtocol (service/http/server.py) relies on it; "
        f"adapt the protocol to this uvicorn, then move the pin {pin()} in pyproject.toml"
    )


def test_the_installed_uvicorn_is_the_pinned_minor_release():
    requirement = pin()
    assert requirement.specifier, "pyproject.toml: uvicorn must be pinned to the minor release tested"
    assert requirement.specifier.contains(uvicorn.__version__), broken(f"outside the pin {requirement}")
    release = Version(uvicorn.__version__).release
    following = f"{release[0]}.{release[1] + 1}.0"  # the next minor release may change the private state
    assert not requirement.specifier.contains(following), f"pyproject.toml: {requirement} lets in uvicorn {following}"


def test_the_overridden_methods_keep_their_signatures():
    for name, parameters in (OVERRIDDEN | CALLED).items():
        method = getattr(HttpToolsProtocol, name, None)
        assert callable(method), broken(f"HttpToolsProtocol.{name} is gone")
        found = list(inspect.signature(method).parameters)
        assert found == parameters, broken(f"HttpToolsProtocol.{name}{tuple(found)}, not {tuple(parameters)}")
    overridden = {name for name in vars(GuardedProtocol) if hasattr(HttpToolsProtocol, name) and name != "__doc__"}
    assert overridden - {"__module__"} == set(OVERRIDDEN), "OVERRIDDEN here must list what GuardedProtocol overrides"
    for name in FLOW_METHODS:
        assert callable(getattr(FlowControl, name, None)), broken(f"FlowControl.{name} is gone")
    cycle_parameters = inspect.signature(RequestResponseCycle).parameters
    assert "flow" in cycle_parameters and "on_response" in cycle_parameters, broken(
        f"RequestResponseCycle{tuple(cycle_parameters)} takes no flow or on_response"
    )


class Transport:
    """As much of a uvloop transport as the protocol uses, keeping what is written."""

    def __init__(self):
        self.written = bytearray()
        self.reading = True
        self.closing = False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def is_closing(self):
        return self.closing

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True

    def write(self, data):
        self.written += data

    def close(self):
        self.closing = True

    abort = close


async def answer_path(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def pipelined_through_the_protocol():
    config = uvicorn.Config(answer_path, lifespan="off", log_level="warning", proxy_headers=False)
    config.load()
    protocol = protocol_for(ServerSettings())(config, ServerState(), {}, _loop=asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    assert isinstance(protocol.flow, HeldFlow), broken("connection_made no longer sets self.flow")
    assert isinstance(protocol.pipeline, deque) and protocol.cycle is None, broken("no pipeline deque or cycle")
    protocol.data_received(
        b"GET /a HTTP/1.1\r\nHost: t\r\n\r\nPOST /b HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\nab"
    )
    first = protocol.pipeline and protocol.pipeline[-1][0]
    assert isinstance(protocol.cycle, RequestResponseCycle), broken("self.cycle is not the last parsed request")
    assert len(protocol.pipeline) == 1 and first is protocol.cycle, broken(
        "a pipelined request is not queued in self.pipeline as (cycle, app), newest on the left"
    )
    assert protocol.headers == [(b"host", b"t"), (b"content-length", b"3")] and protocol.url == b"/b", broken(
        "self.headers (lower-case names) or self.url of the request being parsed changed"
    )
    assert protocol.cycle.body == b"ab" and protocol.cycle.more_body, broken("the cycle's body no longer accumulates")
    assert protocol.parser is not None and protocol.scope["path"] == "/b", broken("self.parser or self.scope changed")
    protocol.data_received(b"c")
    for _ in range(100):  # bounded: the two answers are a few loop turns away
        if not protocol.pipeline and protocol.cycle.response_complete:
            break
        await asyncio.sleep(0)
    assert not protocol.pipeline and protocol.cycle.response_complete, broken(
        "on_response_complete no longer starts the queued request (self.pipeline.pop())"
    )
    protocol.connection_lost(None)
    assert protocol.parser is None, broken("connection_lost no longer drops self.parser")
    return bytes(transport.written)


def test_the_private_state_behaves_as_the_protocol_assumes():
    written = asyncio.run(pipelined_through_the_protocol())
    assert written.count(b"HTTP/1.1 200 OK") == 2 and written.index(b"\r\n\r\n/a") < written.index(b"\r\n\r\n/b")
