"""Shared fixtures: the sample data, one real bundle built from it, a running uvicorn server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DIR = ROOT / "data" / "debian-sample"


@pytest.fixture(scope="session")
def sample_dir() -> Path:
    return SAMPLE_DIR


@pytest.fixture(scope="session")
def sample_bundle(tmp_path_factory) -> Path:
    """The default bundle (pretrained MiniLM, RAE memory, 64-d) built from the shipped sample."""
    from export.build import ExportParams, build_bundle
    from training.data import load_jsonl_split

    out = tmp_path_factory.mktemp("bundles") / "sample-rae"
    train = load_jsonl_split(SAMPLE_DIR, "trn")
    build_bundle(out, train.labels, train, params=ExportParams(), data_name=str(SAMPLE_DIR))
    return out


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


def start_server(bundle_dir: Path, log_path: Path, extra_env: dict | None = None, timeout_s: float = 90) -> Server:
    """Start ``uvicorn service.app:create_app --factory`` on a free loopback port; wait for /readyz."""
    port = free_port()
    env = {**os.environ, "XMCSERVE_BUNDLE_DIR": str(bundle_dir), **(extra_env or {})}
    with open(log_path, "w") as log_fh:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "service.app:create_app",
                "--factory",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-access-log",
            ],
            cwd=ROOT,
            env=env,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return Server(process, url, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"server not ready after {timeout_s}s:\n{log_path.read_text()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=5)


@pytest.fixture(scope="session")
def live_server(sample_bundle, tmp_path_factory) -> Iterator[Server]:
    server = start_server(sample_bundle, tmp_path_factory.mktemp("logs") / "uvicorn.log")
    yield server
    stop_server(server)
