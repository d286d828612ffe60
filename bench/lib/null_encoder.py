"""The real server with its encoder's ONNX call replaced by a lookup: what everything but the
encoder costs (HTTP, validation, batching, tokenizing, search, RAE, fusion, serialisation).

    python -m bench.lib.null_encoder --vectors VECTORS.npz [--host 127.0.0.1] [--port 8000]

``VECTORS.npz`` holds the query vectors the bundle's own encoder gives the texts a benchmark will
send (:func:`write_vectors`), keyed by their token ids, so the search, aggregation and fusion do
exactly the work they do behind the real encoder; a text not in the file gets the first vector.
Everything else is ``python -m service.http`` as deployed: the same settings, guards and threads.

This file imports only the service (not ``bench``), so it can also run as a script over another
checkout's service package (``PYTHONPATH=<that tree> python <this file>``): the way
``bench.serving --null-encoder`` measures the code before a change in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

VECTORS_ENV = "XMCSERVE_BENCH_NULL_VECTORS"


def token_key(ids) -> int:
    """A text's key in the vector file: a hash of its token ids (ints hash the same in every process)."""
    return hash(tuple(ids))


def write_vectors(bundle_dir: Path, texts: list[str], path: Path) -> None:
    """The bundle encoder's vectors of ``texts``, keyed by their token ids, to ``path``."""
    from engine.offline import load_bundle

    encoder = load_bundle(bundle_dir).encoder
    vectors, _ = encoder.encode(texts)
    keys = np.array([token_key(ids) for ids in encoder.tokenize(texts)], dtype=np.int64)
    np.savez(path, keys=keys, vectors=vectors)


def install(path: Path) -> None:
    """Replace every ``OnnxEncoder``'s session call in this process by a lookup in ``path``."""
    from engine.offline import OnnxEncoder

    data = np.load(path)
    rows = {int(key): row for row, key in enumerate(data["keys"])}
    vectors = np.ascontiguousarray(data["vectors"], dtype=np.float32)

    def run(self, token_ids: list[list[int]]) -> np.ndarray:
        return vectors[[rows.get(token_key(ids), 0) for ids in token_ids]]

    OnnxEncoder.run = run


@contextmanager
def installed(path: Path):
    """:func:`install` for the block, then every ``OnnxEncoder`` as it was (a measurement run in
    another program's process, a test's, leaves its encoders real)."""
    from engine.offline import OnnxEncoder

    real = OnnxEncoder.run
    install(path)
    try:
        yield
    finally:
        OnnxEncoder.run = real


def create_app():
    """The app with the null encoder, for another ASGI server (``granian --factory
    bench.lib.null_encoder:create_app``): the vector file from ``$XMCSERVE_BENCH_NULL_VECTORS`` and
    the logging ``python -m service.http`` configures, so both servers write the same lines."""
    from service.http.app import create_app as create
    from service.http.settings import LogSettings
    from service.observability.logs import configure_logging

    install(Path(os.environ[VECTORS_ENV]))
    logs = LogSettings()
    configure_logging(logs.format, logs.level)
    return create()


def create_worker_app():
    """A worker of a group (``XMCSERVE_WORKERS`` > 1) with the null encoder: each worker process
    is spawned fresh, so it installs the lookup itself (the vector file from the environment)."""
    from service.http.server import create_worker_app as create

    install(Path(os.environ[VECTORS_ENV]))
    return create()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vectors", type=Path, default=None, help=f"vector file (default: ${VECTORS_ENV})")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    args = parser.parse_args(argv)
    vectors = args.vectors or os.environ.get(VECTORS_ENV)
    if not vectors:
        parser.error(f"give --vectors or ${VECTORS_ENV}")
    from service.http.settings import ServerSettings

    settings = ServerSettings()
    if settings.workers > 1:  # XMCSERVE_WORKERS: every worker installs the lookup itself
        from service.http.server import serve_workers
        from service.http.settings import LogSettings
        from service.observability.logs import configure_logging

        logs = LogSettings()
        configure_logging(logs.format, logs.level)

        os.environ[VECTORS_ENV] = str(Path(vectors).resolve())
        serve_workers(args.host, args.port, settings, app="bench.lib.null_encoder:create_worker_app")
        return
    install(Path(vectors))
    from service.http.server import main as serve

    serve(["--host", args.host, "--port", str(args.port)])


if __name__ == "__main__":
    sys.exit(main())
