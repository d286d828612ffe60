"""A raw HTTP/1.1 client for protocol tests: bytes sent exactly as given (pipelined, split,
malformed), answers read back one by one, every read bounded by a socket timeout."""

from __future__ import annotations

import socket
from dataclasses import dataclass

TIMEOUT_S = 10.0


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]  # names in lower case; a repeated name keeps its last value
    body: bytes

    @property
    def closes(self) -> bool:
        return self.headers.get(b"connection", b"").lower() == b"close"


class Connection:
    """One connection to 127.0.0.1 (or the host given)."""

    def __init__(self, port: int, host: str = "127.0.0.1", sock: socket.socket | None = None):
        self.sock = sock or socket.create_connection((host, port), timeout=TIMEOUT_S)
        self.buffer = b""

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed by the server; unread: {self.buffer[:200]!r}")
        self.buffer += chunk

    def _take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        taken, self.buffer = self.buffer[:size], self.buffer[size:]
        return taken

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._fill()
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def answer(self) -> Answer:
        """The next answer, interim ones (``100 Continue``) included."""
        status = int(self._line().split()[1])
        headers = {}
        while line := self._line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            return Answer(status, headers, b"")
        if b"content-length" in headers:
            body = self._take(int(headers[b"content-length"]))
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = b""
            while size := int(self._line().split(b";")[0], 16):
                body += self._take(size)
                self._take(2)
            while self._line():  # trailers, then the empty line
                pass
        else:
            body = self.rest()
        return Answer(status, headers, body)

    def answers(self, count: int) -> list[Answer]:
        return [self.answer() for _ in range(count)]

    def rest(self) -> bytes:
        """Everything until the server closes the connection (a reset counts as closed)."""
        try:
            while chunk := self.sock.recv(65536):
                self.buffer += chunk
        except ConnectionResetError:
            pass
        rest, self.buffer = self.buffer, b""
        return rest

    def is_closed(self) -> bool:
        """Whether the server closes the connection with nothing more sent (within the timeout)."""
        return self.rest() == b""


def request(method: str, path: str, body: bytes | None = None, headers: tuple[str, ...] = ()) -> bytes:
    """A well-formed request; ``body`` is sent with its Content-Length."""
    lines = [f"{method} {path} HTTP/1.1", "host: test", *headers]
    if body is not None:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


# Header fields of a request whose Content-Length is not one usable number: each must be refused
# with a 4xx before the app, by the HTTP parser or by the front door.
BAD_CONTENT_LENGTHS = {
    "5000-digits": [b"content-length: " + b"0" * 4998 + b"10"],  # a number, but int() refuses 5000 digits
    "5000-digits-no-leading-zeros": [b"content-length: " + b"1" * 5000],
    "over-64-bits": [b"content-length: 99999999999999999999999"],
    "negative": [b"content-length: -5"],
    "plus-sign": [b"content-length: +5"],
    "hex": [b"content-length: 0x5"],
    "empty": [b"content-length: "],
    "two-in-a-list": [b"content-length: 5, 6"],
    "two-different": [b"content-length: 5", b"content-length: 6"],
    "two-same": [b"content-length: 5", b"content-length: 5"],
    "with-chunked": [b"content-length: 5", b"transfer-encoding: chunked"],
}

# Chunked bodies whose framing is malformed: a 400 from the HTTP parser.
BAD_CHUNKS = {
    "overflow": b"ffffffffffffffffff\r\nabc",  # a size over 64 bits
    "negative": b"-5\r\nabcde\r\n0\r\n\r\n",
    "not-hex": b"zz\r\nabcde\r\n0\r\n\r\n",
    "longer-than-said": b"5\r\nabcdefgh\r\n0\r\n\r\n",
}


def with_fields(method: str, path: str, fields: list[bytes], body: bytes = b"") -> bytes:
    """A request with the header fields given as raw lines."""
    head = f"{method} {path} HTTP/1.1\r\nhost: test\r\n".encode() + b"".join(field + b"\r\n" for field in fields)
    return head + b"\r\n" + body
