"""What a request costs besides the encoder: the real server with a null encoder
(:mod:`bench.lib.null_encoder`), this tree's code against another checkout's in the same run.

    python -m bench.non_encoder_cost [--bundle bundles/default] [--baseline-tree DIR]
        [--rps 150] [--null-seconds 10] [--rounds 3] [--cpu-only]
        [--out bench/results/serving-null-encoder.json]

Each tree's server serves the bundle with the ONNX call replaced by a lookup of the vectors the
real encoder gives the dev texts, so tokenizing, HTTP, validation, batching, search, RAE, fusion
and serialisation do their real work. In alternating rounds, each server is held at a fixed
open-loop rate (the server's CPU seconds, from its own ``process_cpu_seconds_total``, over the
requests answered: **µs CPU per request**; its event loop thread's alone from ``/proc``) and then
loaded closed loop (**peak q/s**). A py-spy profile of each at the fixed rate splits that CPU by
stage. ``--cpu-only``: the CPU at the fixed rate alone (no peak, no profile), for A/B rounds on a
machine busy with other work. ``--baseline-tree``: a checkout of the code to compare with
(``git worktree add --detach DIR REF``); without it, this tree alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from bench.lib.non_encoder import add_arguments, run


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
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "bundle": str(args.bundle),
        **run(args, args.bundle, args.data),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    keys = (
        "median_cpu_us_per_request",
        "median_loop_cpu_us_per_request",
        "median_peak_qps",
        "cpu_per_request_this_over_baseline",
        "loop_cpu_per_request_this_over_baseline",
    )
    print(json.dumps({k: result.get(k) for k in keys}, indent=2))


if __name__ == "__main__":
    main()
