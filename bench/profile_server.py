"""Where a loaded xmcserve process spends its time: py-spy samples a real uvicorn process while
the open-loop generator holds it at a fixed rate, and the samples are folded into shares.

    python -m bench.profile_server [--bundle bundles/default] [--rps 100] [--seconds 12]
        [--out bench/results/profile.json]

Writes the collapsed stacks (``.txt``, loadable in speedscope or flamegraph.pl) and a JSON of
the leaf-function shares and of the shares per service stage (tokenize, ONNX run, HNSW, RAE,
HTTP/asyncio), which bench/results/README.md quotes. Needs ``py-spy`` (bench extra) and ptrace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench.loadgen import closed_loop, open_loop
from loadtest.localserver import start_server, stop_server
from xmc.data import load_jsonl_split

# A sample is charged to the first stage whose marker appears in its stack (innermost first).
STAGES = (
    ("onnx_run", ("Session.run (",)),
    ("hnsw_search", ("knn_query", "Predictor.knn (")),
    ("rae_aggregate", ("rank (service/engine/search.py", "rae.py")),
    ("tokenize", ("encode_batch", "tokenize (service/engine/encoder.py")),
    ("response_json", ("to_response", "json/encoder.py", "predict_response")),
    ("request_parse", ("pydantic", "fastapi/routing.py", "fastapi/dependencies")),
    ("metrics", ("prometheus_client",)),
    ("batcher", ("service/engine/batcher.py",)),
    ("http_protocol", ("httptools_impl.py", "h11_impl.py", "/h11/", "protocols/http/")),
    ("middleware", ("service/observability/", "front_door.py", "guards.py", "RequestObserver", "starlette/")),
    ("endpoint", ("service/http/app.py",)),
)


def stage_of(stack: str) -> str:
    frames = stack.split(";")[::-1]
    for frame in frames:
        for stage, markers in STAGES:
            if any(m in frame for m in markers):
                return stage
    return "http_asyncio_other"


def fold(collapsed: Path) -> dict:
    leaves, stages, threads, total = Counter(), Counter(), Counter(), 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        leaves[stack.split(";")[-1]] += n
        stages[stage_of(stack)] += n
        threads[stack.split(";")[0]] += n

    def shares(counter: Counter, top: int) -> dict:
        return {k: round(v / max(total, 1), 4) for k, v in counter.most_common(top)}

    return {
        "samples": total,
        "stages": shares(stages, 20),
        "threads": shares(threads, 10),
        "leaves": shares(leaves, 25),
    }


def record(
    server, bodies: list[bytes], rps: float, seconds: float, rate: int, collapsed: Path, subprocesses: bool = False
) -> dict:
    """py-spy's collapsed stacks of ``server`` into ``collapsed`` while an open loop holds it at
    ``rps`` for ``seconds`` (whole seconds for py-spy); returns the load's summary. Raises
    ``RuntimeError`` when py-spy fails. ``subprocesses``: its child processes too (a server whose
    app runs in a worker process)."""
    py_spy = Path(sys.executable).parent / "py-spy"
    command = [str(py_spy), "record", "--pid", str(server.process.pid), "--duration", str(int(seconds))]
    command += ["--rate", str(rate), "--format", "raw", "--threads", "--nonblocking"]
    command += ["--subprocesses"] if subprocesses else []
    spy = subprocess.Popen([*command, "--output", str(collapsed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    load = asyncio.run(open_loop(server.url, bodies, rps, seconds)).summary()
    _, err = spy.communicate(timeout=seconds + 60)
    if spy.returncode != 0:
        raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
    return load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--bundle", type=Path, default=Path("bundles/default"), help="bundle the profiled server serves"
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("data/debian-sample"),
        help="dataset directory whose dev texts are sent as requests",
    )
    parser.add_argument("--rps", type=float, default=100.0, help="offered open-loop load, in requests per second")
    parser.add_argument(
        "--seconds", type=float, default=12.0, help="load and profiling time in seconds (py-spy takes whole seconds)"
    )
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--env", action="append", default=[], help="extra XMCSERVE_* settings, NAME=VALUE")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench/results/profile.json"),
        help="result JSON file; the collapsed stacks are written beside it as .txt",
    )
    args = parser.parse_args()
    texts = load_jsonl_split(args.data, "dev").texts
    bodies = [json.dumps({"text": t, "k": 10}).encode() for t in texts]
    collapsed = args.out.with_suffix(".txt")
    server = start_server(
        args.bundle, Path("/tmp/xmcserve-profile.log"), extra_env=dict(e.split("=", 1) for e in args.env)
    )
    try:
        asyncio.run(closed_loop(server.url, bodies, 4, 3.0))  # warm-up
        load = record(server, bodies, args.rps, args.seconds, args.rate, collapsed)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        stop_server(server)
    result = {"rps": args.rps, "load": load, "settings": args.env, **fold(collapsed)}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("load", "stages", "threads")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
