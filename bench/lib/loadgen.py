"""A light HTTP/1.1 load generator on asyncio streams (keep-alive, no HTTP library per request).

It shares the 2 cores with the server under test, so it does as little as possible per
request: pre-encoded request bytes, one ``readuntil`` for the headers and one ``readexactly``
for the body. ``closed_loop`` keeps C requests outstanding (throughput); ``open_loop`` sends at a
fixed rate and measures latency from each request's *scheduled* time, so a stalled server is
not hidden by a stalled client (no coordinated omission). Both are bounded in time and count.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np


def encode_request(host: str, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Connection:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        conn = cls(host, port)
        conn.reader, conn.writer = await asyncio.open_connection(host, port)
        return conn

    async def send(self, request: bytes) -> int:
        """Send one request; a keep-alive connection the server closed while idle (uvicorn's
        keep-alive timeout) is reopened once, since that request never reached the server."""
        try:
            return await self._send(request)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            if isinstance(exc, asyncio.IncompleteReadError) and exc.partial:
                raise
            self.close()
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            return await self._send(request)

    async def _send(self, request: bytes) -> int:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


@dataclass
class LoadResult:
    mode: str
    concurrency: int | None
    target_rps: float | None
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    # per status: latency from the scheduled send, and the server's part (from the actual send)
    latencies_by_status: dict[int, list[float]] = field(default_factory=dict)
    service_ms_by_status: dict[int, list[float]] = field(default_factory=dict)
    errors: int = 0
    client_cpu_s: float = 0.0

    def summary(self) -> dict:
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        ok = self.statuses.get(200, 0)
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "target_rps": self.target_rps,
            "seconds": round(self.seconds, 2),
            "requests": len(self.latencies_ms),
            "ok": ok,
            "qps": round(ok / self.seconds, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p95_ms": round(float(np.percentile(lat, 95)), 2),
            "p99_ms": round(float(np.percentile(lat, 99)), 2),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "errors": self.errors,
            # share of one core the load generator itself used
            "client_cpu_core_share": round(self.client_cpu_s / self.seconds, 3),
        }


def _requests(url: str, bodies: list[bytes]) -> tuple[str, int, itertools.cycle]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"load tests target loopback only, not {host}")
    return host, port, itertools.cycle([encode_request(host, "/predict", b) for b in bodies])


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, seconds: float, max_requests: int = 10**6):
    """``concurrency`` connections, each sending its next request as soon as the last returns."""
    host, port, requests = _requests(url, bodies)
    result = LoadResult("closed", concurrency, None, seconds)
    connections = [await Connection.open(host, port) for _ in range(concurrency)]
    cpu0, start = time.process_time(), time.perf_counter()
    deadline = start + seconds
    sent = 0

    async def run(conn: Connection) -> None:
        nonlocal sent
        while time.perf_counter() < deadline and sent < max_requests:
            sent += 1
            t0 = time.perf_counter()
            try:
                status = await conn.send(next(requests))
            except (OSError, asyncio.IncompleteReadError):
                result.errors += 1
                return
            result.latencies_ms.append((time.perf_counter() - t0) * 1000)
            result.statuses[status] = result.statuses.get(status, 0) + 1

    await asyncio.gather(*[run(c) for c in connections])
    result.seconds = time.perf_counter() - start
    result.client_cpu_s = time.process_time() - cpu0
    for c in connections:
        c.close()
    return result


async def open_loop(url: str, bodies: list[bytes], rps: float, seconds: float, max_connections: int = 256):
    """Requests at a fixed rate; latency counts from the scheduled send time."""
    host, port, requests = _requests(url, bodies)
    result = LoadResult("open", None, rps, seconds)
    idle: list[Connection] = [await Connection.open(host, port) for _ in range(8)]
    opened = len(idle)
    tasks: list[asyncio.Task] = []
    cpu0, start = time.process_time(), time.perf_counter()
    total = int(rps * seconds)

    async def one(scheduled: float) -> None:
        nonlocal opened
        if idle:
            conn = idle.pop()
        elif opened < max_connections:
            opened += 1
            conn = await Connection.open(host, port)
        else:
            result.errors += 1  # the client ran out of connections: counted, not hidden
            return
        sent = time.perf_counter()
        try:
            status = await conn.send(next(requests))
        except (OSError, asyncio.IncompleteReadError):
            result.errors += 1
            return
        now = time.perf_counter()
        result.latencies_ms.append((now - scheduled) * 1000)
        result.statuses[status] = result.statuses.get(status, 0) + 1
        result.latencies_by_status.setdefault(status, []).append((now - scheduled) * 1000)
        result.service_ms_by_status.setdefault(status, []).append((now - sent) * 1000)
        idle.append(conn)

    for i in range(total):
        scheduled = start + i / rps
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=seconds + 30)
    result.seconds = time.perf_counter() - start
    result.client_cpu_s = time.process_time() - cpu0
    for c in idle:
        c.close()
    return result
