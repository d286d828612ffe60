"""Where a loaded xmcserve process spends its time: py-spy samples a real uvicorn process while
the open-loop generator holds it at a fixed rate, and the samples are folded into shares.

    python -m studies.profile_server [--bundle bundles/default] [--rps 100] [--seconds 12]
        [--out bench/results/server-stage-profile.json]

Writes the collapsed stacks (``.txt``, loadable in speedscope or flamegraph.pl) and a JSON of
the leaf-function shares and of the shares per service stage (tokenize, ONNX run, HNSW, RAE,
HTTP/asyncio), which bench/results/README.md quotes. Needs ``py-spy`` (bench extra) and ptrace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from bench.lib.profiling import fold, record
from loadtest.loadgen import closed_loop
from loadtest.localserver import start_server, stop_server
from xmc.data import load_jsonl_split
from xmc.results import write_result


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
        default=Path("bench/results/server-stage-profile.json"),
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
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("load", "stages", "threads")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
