"""The real server with the null encoder: the bundle's tokenizer, then each text's vector looked up
instead of computed (``XMCSERVE_ENCODER=null``, :mod:`engine.null_encoder`): what everything but
the encoder's model costs (HTTP, validation, batching, tokenizing, search, RAE, fusion,
serialisation).

    python -m bench.lib.null_encoder --vectors VECTORS.npz [--host 127.0.0.1] [--port 8000]

``VECTORS.npz`` holds the query vectors the bundle's own encoder gives the texts a benchmark will
send (:func:`write_vectors`), keyed by their token ids, so the search, aggregation and fusion do
exactly the work they do behind the real encoder; a text not in the file gets the first vector.
Everything else is ``python -m service.http`` as deployed: the same settings, guards and threads;
this only sets ``XMCSERVE_ENCODER=null`` and ``XMCSERVE_NULL_VECTORS`` for it.

This file imports only the service (not ``bench``), so it can also run as a script over another
checkout's service package (``PYTHONPATH=<that tree> python <this file>``): the way
``bench.serving --null-encoder`` measures the code before a change in the same run. A checkout
from before the null backend has no ``XMCSERVE_ENCODER``: over such an engine this falls back
to replacing ``OnnxEncoder.run`` by the same lookup (:func:`patch_legacy_engine`).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

VECTORS_ENV = "XMCSERVE_BENCH_NULL_VECTORS"
# the settings that choose the null backend (service/http/settings.py)
ENCODER_SETTING, VECTORS_SETTING = "XMCSERVE_ENCODER", "XMCSERVE_NULL_VECTORS"


def write_vectors(bundle_dir: Path, texts: list[str], path: Path) -> None:
    """The bundle encoder's vectors of ``texts``, keyed by their token ids, to ``path`` (the real
    ONNX encoder's, whatever the environment asks the server for)."""
    from engine.offline import load_encoder, write_null_vectors

    write_null_vectors(load_encoder(bundle_dir)[1], texts, path)


def engine_has_null_backend() -> bool:
    """Whether the engine this process imports has the null backend (a checkout from before it
    does not: :func:`patch_legacy_engine`)."""
    import engine.offline as offline

    return hasattr(offline, "NullEncoder")


@contextmanager
def selected(path: Path):
    """The null encoder over ``path`` for every server and app created in the block (in this
    process and the processes it starts): ``XMCSERVE_ENCODER=null`` and ``XMCSERVE_NULL_VECTORS``
    in the environment; the environment (and, over a legacy engine, ``OnnxEncoder``) as it was
    afterwards, so a measurement run in another program's process, a test's, leaves its encoders real."""
    saved = {name: os.environ.get(name) for name in (ENCODER_SETTING, VECTORS_SETTING)}
    undo = select(path)
    try:
        yield
    finally:
        undo()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def select(path: Path):
    """Choose the null encoder over ``path`` for this process and its children; returns what
    undoes the legacy patch (nothing to undo over an engine with the setting)."""
    if not engine_has_null_backend():
        return patch_legacy_engine(path)
    os.environ[ENCODER_SETTING] = "null"
    os.environ[VECTORS_SETTING] = str(Path(path).resolve())
    return lambda: None


# --- legacy fallback ------------------------------------------------------------------------------
# For an engine from before XMCSERVE_ENCODER (a baseline checkout measured in the same run): its
# OnnxEncoder's session call replaced in this process by the lookup engine.null_encoder makes. The
# key must stay engine.null_encoder.token_key's (tests/bench/lib/test_null_encoder.py checks it).


def legacy_token_key(ids) -> int:
    return hash(tuple(ids))


def patch_legacy_engine(path: Path):
    """Replace every ``OnnxEncoder``'s session call in this process by a lookup in ``path``;
    returns what puts it back."""
    from engine.offline import OnnxEncoder

    data = np.load(path)
    rows = {int(key): row for row, key in enumerate(data["keys"])}
    vectors = np.ascontiguousarray(data["vectors"], dtype=np.float32)
    real = OnnxEncoder.run

    def run(self, token_ids: list[list[int]]) -> np.ndarray:
        return vectors[[rows.get(legacy_token_key(ids), 0) for ids in token_ids]]

    OnnxEncoder.run = run

    def undo() -> None:
        OnnxEncoder.run = real

    return undo


def create_worker_app():
    """A legacy engine's worker of a group (``XMCSERVE_WORKERS`` > 1): each worker process is
    spawned fresh, so it patches itself (the vector file from the environment). An engine with
    the setting needs none of this: its workers read ``XMCSERVE_ENCODER`` themselves."""
    from service.http.server import create_worker_app as create

    patch_legacy_engine(Path(os.environ[VECTORS_ENV]))
    return create()


# --- entry points ---------------------------------------------------------------------------------


def create_app():
    """The app with the null encoder, for another ASGI server (``granian --factory
    bench.lib.null_encoder:create_app``): the vector file from ``$XMCSERVE_BENCH_NULL_VECTORS`` and
    the logging ``python -m service.http`` configures, so both servers write the same lines."""
    from service.http.app import create_app as create
    from service.http.settings import LogSettings
    from service.observability.logs import configure_logging

    select(Path(os.environ[VECTORS_ENV]))
    logs = LogSettings()
    configure_logging(logs.format, logs.level)
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
    vectors = Path(vectors).resolve()
    from service.http.server import main as serve

    if engine_has_null_backend():  # the setting: the server and each of its workers read it
        select(vectors)
        serve(["--host", args.host, "--port", str(args.port)])
        return
    from service.http.settings import ServerSettings

    settings = ServerSettings()
    if settings.workers > 1:  # legacy engine, XMCSERVE_WORKERS: every worker patches itself
        from service.http.server import serve_workers
        from service.http.settings import LogSettings
        from service.observability.logs import configure_logging

        logs = LogSettings()
        configure_logging(logs.format, logs.level)
        os.environ[VECTORS_ENV] = str(vectors)
        serve_workers(args.host, args.port, settings, app="bench.lib.null_encoder:create_worker_app")
        return
    patch_legacy_engine(vectors)
    serve(["--host", args.host, "--port", str(args.port)])


if __name__ == "__main__":
    sys.exit(main())
