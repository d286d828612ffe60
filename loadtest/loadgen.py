"""A light HTTP/1.1 load generator on asyncio streams (keep-alive, no HTTP library per request).

It shares the 2 cores with the server under test, so it does as little as possible per
request: pre-encoded request bytes, one ``readuntil`` for the headers and one ``readexactly``
for the body. ``closed_loop`` keeps C requests outstanding (throughput); ``open_loop`` sends at a
fixed rate and measures latency from each request's *scheduled* time, so a stalled server is
not hidden by a stalled client (no coordinated omission). Both are bounded in time and count.
``spread`` deals several such loads (one per server, say) over load-generator processes sharing
one window, for more requests a second than one Python process sends.

The benchmarks' measuring instrument, beside the load test's locust scenarios (``locustfile.py``:
users with think time, ramps and spikes, an SLO gate) and the local server both start
(``localserver.py``); only numpy and the standard library, nothing of the project.
"""

from __future__ import annotations

import asyncio
import itertools
import os
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


def _requests(url: str, bodies: list[bytes], path: str = "/predict") -> tuple[str, int, itertools.cycle]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"load tests target loopback only, not {host}")
    return host, port, itertools.cycle([encode_request(host, path, b) for b in bodies])


async def closed_loop(
    url: str, bodies: list[bytes], concurrency: int, seconds: float, max_requests: int = 10**6, path: str = "/predict"
):
    """``concurrency`` connections, each sending its next request (a POST to ``path``) as soon as
    the last returns."""
    host, port, requests = _requests(url, bodies, path)
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


async def open_loop(
    url: str, bodies: list[bytes], rps: float, seconds: float, max_connections: int = 256, path: str = "/predict"
):
    """Requests (POSTs to ``path``) at a fixed rate; latency counts from the scheduled send time."""
    host, port, requests = _requests(url, bodies, path)
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


@dataclass(frozen=True)
class Job:
    """One load of :func:`spread`: ``concurrency`` closed-loop connections to ``url``, or (with
    ``rps``) an open loop at that rate."""

    url: str
    concurrency: int = 0
    rps: float = 0.0


def merge(results: list[LoadResult], client_cpu_s: float) -> LoadResult:
    """Loads that ran over the same window as one: latencies and statuses pooled, the window the
    longest of theirs (so the rate is what the server answered together), ``client_cpu_s`` the
    load generators' CPU (loads of one process overlap, so theirs is counted once)."""
    first = results[0]
    concurrencies = [r.concurrency for r in results if r.concurrency is not None]
    rates = [r.target_rps for r in results if r.target_rps is not None]
    merged = LoadResult(
        first.mode,
        sum(concurrencies) if concurrencies else None,
        round(sum(rates), 2) if rates else None,
        max(r.seconds for r in results),
        client_cpu_s=client_cpu_s,
    )
    for result in results:
        merged.latencies_ms.extend(result.latencies_ms)
        merged.errors += result.errors
        for status, count in result.statuses.items():
            merged.statuses[status] = merged.statuses.get(status, 0) + count
        for source, target in (
            (result.latencies_by_status, merged.latencies_by_status),
            (result.service_ms_by_status, merged.service_ms_by_status),
        ):
            for status, values in source.items():
                target.setdefault(status, []).extend(values)
    return merged


def run_jobs(
    jobs: list[Job],
    bodies: list[bytes],
    seconds: float,
    start_at: float = 0.0,
    cpus: set[int] | None = None,
    timeout_s: float | None = None,
) -> tuple[list[LoadResult], float]:
    """``jobs`` on one event loop in this process, from wall-clock time ``start_at`` (so loads in
    several processes share their window), on ``cpus`` when given; the results and the CPU
    seconds this process spent on them. Raises ``TimeoutError`` when they have not returned
    within ``timeout_s``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if (delay := start_at - time.time()) > 0:
        time.sleep(delay)

    async def everything():
        return await asyncio.gather(
            *[
                open_loop(job.url, bodies, job.rps, seconds)
                if job.rps
                else closed_loop(job.url, bodies, job.concurrency, seconds)
                for job in jobs
            ]
        )

    cpu0 = time.process_time()
    try:
        results = asyncio.run(asyncio.wait_for(everything(), timeout_s))
    except asyncio.TimeoutError:  # not the built-in TimeoutError before Python 3.11
        raise TimeoutError(f"loads still running after {timeout_s:.0f} s") from None
    return list(results), time.process_time() - cpu0


def spread(
    jobs: list[Job],
    bodies: list[bytes],
    seconds: float,
    processes: int = 1,
    cpus: set[int] | None = None,
    timeout_s: float | None = None,
) -> tuple[LoadResult, list[LoadResult]]:
    """``jobs`` dealt over ``processes`` load-generator processes, all over one window (one
    Python process tops out at a few thousand requests a second: a GPU server, or several servers,
    answer more); each process on ``cpus`` when given. Returns the merged load and each job's
    own, in ``jobs``' order. In this process when one process on any core does.

    Raises ``TimeoutError`` when the loads have not returned within ``timeout_s``, and
    ``RuntimeError`` as soon as a generator process fails or dies; the others are then killed."""
    processes = max(1, min(processes, len(jobs)))
    if processes == 1 and not cpus:
        results, cpu_s = run_jobs(jobs, bodies, seconds, timeout_s=timeout_s)
        return merge(results, cpu_s), results
    import multiprocessing
    from multiprocessing.connection import wait

    # spawn, not fork: the parent may hold ONNX Runtime's and the event loop's threads. Processes
    # and pipes rather than a Pool: a Pool replaces a worker that dies and waits for its task forever.
    context = multiprocessing.get_context("spawn")
    dealt = [list(range(i, len(jobs), processes)) for i in range(processes)]
    start_at = time.time() + 2.0  # a spawned process takes about a second to import numpy and asyncio
    children = []
    for share in dealt:
        receiver, sender = context.Pipe(duplex=False)
        args = (sender, [jobs[i] for i in share], bodies, seconds, start_at, cpus)
        child = context.Process(target=_generator, args=args, daemon=True)
        child.start()
        sender.close()  # the child's end: its death then reads as end of file here
        children.append((child, receiver))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    answers: dict[int, tuple[list[LoadResult], float]] = {}
    try:
        while len(answers) < len(children):
            waiting = [receiver for n, (_, receiver) in enumerate(children) if n not in answers]
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not wait(waiting, left):
                raise TimeoutError(f"load generators still running after {timeout_s:.0f} s")
            for n, (child, receiver) in enumerate(children):
                if n in answers or not receiver.poll():
                    continue
                try:
                    kind, answer = receiver.recv()
                except EOFError:
                    child.join(5)
                    raise RuntimeError(f"a load generator died (exit code {child.exitcode})") from None
                if kind == "error":
                    raise RuntimeError(f"a load generator failed: {answer}")
                answers[n] = answer
    finally:
        for child, receiver in children:
            if child.is_alive():
                child.kill()
            child.join(5)
            receiver.close()
    by_job: list[LoadResult | None] = [None] * len(jobs)
    for n, share in enumerate(dealt):
        for i, result in zip(share, answers[n][0], strict=True):
            by_job[i] = result
    return merge(by_job, sum(cpu_s for _, cpu_s in answers.values())), by_job


def _generator(sender, jobs: list[Job], bodies: list[bytes], seconds: float, start_at: float, cpus) -> None:
    """A load-generator process of :func:`spread`: :func:`run_jobs`, its answer or its error sent back."""
    try:
        sender.send(("ok", run_jobs(jobs, bodies, seconds, start_at, cpus)))
    except BaseException as exc:  # the parent raises it; a traceback here would be noise in its output
        sender.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        sender.close()
