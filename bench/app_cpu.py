"""Where the CPU of a request goes without the network: ``POST /predict`` driven straight through
the ASGI app in this process (no socket, no HTTP parser), with the null encoder
(``XMCSERVE_ENCODER=null``: the bundle's tokenizer, the texts' vectors looked up).

    python -m bench.app_cpu [--bundle bundles/default] [--data data/debian-sample] \
        [--requests 2000] [--concurrency 1 4 16] [--out bench/results/app-cpu.json]

CPU seconds of the whole process (event loop, batcher, search and encode threads) per answered
request, at each number of requests in flight. A request alone forms a batch of one and pays
every per-batch cost (the thread hand-offs, one HNSW call, the RAE and fusion steps) by itself;
with more in flight the batches grow and those costs are shared. Compared with the server's own
CPU per request at the same load (``studies.non_encoder_cost``), the difference is what uvicorn, the
parser and the sockets cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

from bench.lib.null_encoder import selected, write_vectors
from xmc.data import load_jsonl_split
from xmc.results import write_result


async def post(app, body: bytes) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/predict",
        "raw_path": b"/predict",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    answered = asyncio.Event()
    statuses, sent_body = [], False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # the client stays until its answer is written
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        elif not message.get("more_body"):
            answered.set()

    await app(scope, receive, send)
    return statuses[0]


class NotAllAnswered(RuntimeError):
    """Some measured request was answered with a status other than 200: the figures would not be the app's."""


async def cpu_per_request(app, bodies: list[bytes], requests: int, concurrency: int) -> dict:
    async def client(first: int) -> list[int]:
        return [await post(app, bodies[i % len(bodies)]) for i in range(first, requests, concurrency)]

    await asyncio.gather(*(client(c) for c in range(concurrency)))  # warm-up: same work, not counted
    cpu, wall = time.process_time(), time.perf_counter()
    statuses = [s for done in await asyncio.gather(*(client(c) for c in range(concurrency))) for s in done]
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if set(statuses) != {200}:
        raise NotAllAnswered(f"answers other than 200 at concurrency {concurrency}: {sorted(set(statuses))}")
    return {"cpu_us_per_request": round(cpu / requests * 1e6, 1), "requests_per_s": round(requests / wall, 1)}


async def measure(bundle: Path, bodies: list[bytes], requests: int, levels: list[int]) -> dict:
    os.environ["XMCSERVE_BUNDLE_DIR"] = str(bundle)
    from service.http.app import create_app

    app = create_app()
    async with app.router.lifespan_context(app):
        return {str(level): await cpu_per_request(app, bodies, requests, level) for level in levels}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/default"), help="bundle served")
    parser.add_argument("--data", type=Path, default=Path("data/debian-sample"), help="data set of the sent texts")
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="requests in flight")
    parser.add_argument("--out", type=Path, default=Path("bench/results/app-cpu.json"), help="result JSON")
    args = parser.parse_args(argv)
    texts = load_jsonl_split(args.data, "dev").texts[:500]
    vectors = Path(tempfile.mkdtemp(prefix="app-cpu-")) / "vectors.npz"
    write_vectors(args.bundle, texts, vectors)
    bodies = [json.dumps({"text": text, "k": 10}).encode() for text in texts]
    logging.disable(logging.CRITICAL)  # the access lines' cost is measured by --observability-cost of bench.serving
    try:
        with selected(vectors):
            levels = asyncio.run(measure(args.bundle, bodies, args.requests, args.concurrency))
    except NotAllAnswered as exc:
        raise SystemExit(str(exc)) from None
    finally:  # the tests call main in their own process: its logging as it was
        logging.disable(logging.NOTSET)
    result = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "bundle": str(args.bundle),
        "what": "POST /predict through the ASGI app in process, null encoder (XMCSERVE_ENCODER=null), logging off",
        "requests": args.requests,
        "by_concurrency": levels,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
