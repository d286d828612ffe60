"""Start and stop a real uvicorn process serving a bundle on a free loopback port (tests and benchmarks)."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def parse_cpus(spec: str | None) -> set[int] | None:
    """A Linux CPU list (``0-1,4``) as a set of cores; None for an empty or missing list."""
    if not spec:
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        start, end = int(first), int(last or first)
        if end < start:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(start, end + 1))
    return cpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, url: str, log_path: Path):
        self.process = process
        self.url = url
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    bundle_dir: Path,
    log_path: Path,
    extra_env: dict | None = None,
    timeout_s: float = 90,
    app: str | None = None,
    nice: int = 0,
    cpus: set[int] | None = None,
    file_size_limit: int | None = None,
    command: list[str] | None = None,
    cwd: Path = ROOT,
    ready_path: str = "/readyz",
) -> Server:
    """Start xmcserve (``python -m service.http``), ``uvicorn <app> --factory`` for another app,
    or ``command`` (a server taking ``--host`` and ``--port``, run in ``cwd``), on a free
    loopback port serving ``bundle_dir``; wait for ``ready_path`` to answer 200 (another server's
    own readiness route for ``command``). ``cpus`` pins the server (and every thread and child
    it starts) to those cores; ``file_size_limit``: the
    largest file the server may write (RLIMIT_FSIZE: a full disk, for fault tests)."""
    port = free_port()
    env = {**os.environ, "XMCSERVE_BUNDLE_DIR": str(bundle_dir), **(extra_env or {})}
    if command is None:
        command = [sys.executable, "-m"] + (
            ["service.http"] if app is None else ["uvicorn", app, "--factory", "--no-access-log"]
        )
    with open(log_path, "w") as log_fh:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            (["nice", "-n", str(nice)] if nice else []) + command + ["--host", "127.0.0.1", "--port", str(port)],
            cwd=cwd,
            env=env,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: limit_process(cpus, file_size_limit)) if cpus or file_size_limit else None,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}{ready_path}", timeout=1).status_code == 200:
                return Server(process, url, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"server not ready after {timeout_s}s:\n{log_path.read_text()}")


def limit_process(cpus: set[int] | None, file_size_limit: int | None) -> None:
    """In the server's process before it starts: its cores and its largest file."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if file_size_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=5)
