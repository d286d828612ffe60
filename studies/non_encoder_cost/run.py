"""What a request costs besides the encoder: the real server with a null encoder
(:mod:`bench.lib.null_encoder`), this tree's code against another checkout's in the same run, and
both against the floor of the stack they run on.

    python -m studies.non_encoder_cost [--bundle bundles/default] [--baseline-tree DIR]
        [--rps 150] [--null-seconds 10] [--rounds 3] [--cpu-only] [--no-floors]
        [--out bench/results/serving-null-encoder.json]

Each tree's server serves the bundle with the ONNX call replaced by a lookup of the vectors the
real encoder gives the dev texts, so tokenizing, HTTP, validation, batching, search, RAE, fusion
and serialisation do their real work. In alternating rounds, each server is held at a fixed
open-loop rate: **µs CPU per request** (the process's CPU from ``/proc`` over the requests
answered), its event loop thread's, and each of its threads' (named by the Python thread:
loop, encode, search, native pools; :mod:`bench.lib.thread_cpu`); then it is loaded closed loop
(**peak q/s**). In the same rounds the **floors** (:mod:`bench.lib.floors`: a bare ASGI app and
one bare FastAPI route, under the uvicorn settings of our server) are held at the same rate: a
tree's CPU per request minus a floor's, round by round, is its own machinery
(``machinery_cpu_us_per_request``). A py-spy profile of each tree at the fixed rate (no idle
samples) splits each thread's CPU by stage (``profiles.<tree>.cpu_split``: µs per request by
thread, by stage, and the largest leaves of what no stage claims).

``--cpu-only``: the CPU at the fixed rate alone (no peak, no profile), for A/B rounds on a
machine busy with other work. ``--baseline-tree``: a checkout of the code to compare with
(``git worktree add --detach DIR REF``); without it, this tree alone. ``--no-floors``: no floors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.lib.non_encoder import add_arguments, run
from xmc.results import machine, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("bundles/default"), help="bundle both servers serve")
    parser.add_argument(
        "--data", type=Path, default=Path("data/debian-sample"), help="dataset whose dev texts are sent"
    )
    parser.add_argument("--env", action="append", default=[], help="extra XMCSERVE_* settings, NAME=VALUE")
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/serving-null-encoder.json"), help="result JSON file"
    )
    add_arguments(parser)
    args = parser.parse_args()
    result = {
        "machine": machine(),
        "bundle": str(args.bundle),
        **run(args, args.bundle, args.data),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(summary(result), indent=2))


def summary(result: dict) -> dict:
    """What the run prints: the medians, the ratios, each tree's machinery over the floors, the
    thread rows and each tree's CPU by stage."""
    keys = (
        "median_cpu_us_per_request",
        "median_loop_cpu_us_per_request",
        "median_peak_qps",
        "cpu_per_request_this_over_baseline",
        "loop_cpu_per_request_this_over_baseline",
    )
    machinery = {
        tree: {floor: figures["median"] for floor, figures in floors.items()}
        for tree, floors in (result.get("machinery_cpu_us_per_request") or {}).items()
    }
    threads = {
        name: {row: values["cpu_us_per_request"] for row, values in rows.items()}
        for name, rows in result["median_thread_cpu_us_per_request"].items()
    }
    stages = {name: profile["cpu_split"]["by_stage"] for name, profile in result["profiles"].items()}
    return {
        **{k: result.get(k) for k in keys},
        "median_machinery_cpu_us_per_request": machinery,
        "median_thread_cpu_us_per_request": threads,
        "stage_cpu_us_per_request": stages,
    }


if __name__ == "__main__":
    main()
