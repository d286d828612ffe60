"""What the append log's fsyncs cost: appends/s with the durable log against the same log without fsync.

    python -m bench.append_durability --bundle bundles/default [--rounds 8] [--appends 40] \\
        [--workdir /var/lib/xmcserve] [--out bench/results/append-durability.json]

One process, the engine directly (no HTTP). Two predictors of the bundle, each with a log
directory of its own under ``--workdir`` (the filesystem whose fsync is measured): ``durable``
(the served code) and ``no-fsync``, whose rounds run with ``os.fsync`` replaced by a no-op in
this process (the append log's among them) — a measurement-only switch in this script, not a setting: without
the fsync an acknowledged append can be lost to a power failure. Per round each variant makes
``--appends`` appends (a new label and an instance of it), one at a time, as a client waiting for
each acknowledgement does; the variants alternate, their order swapped every round. Reported per
variant: appends/s end to end (encode + log + apply) and the log + apply time alone (the commit,
timed apart from the encoding), medians over the rounds, and the durable/no-fsync ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from bench.lib.args import REQUIRED, bench_parser
from engine import AppendBatch, load_predictor

VARIANTS = ("durable", "no-fsync")


@contextmanager
def without_fsync():
    """``os.fsync`` a no-op in this process for the block (the no-fsync rounds only): the append
    log calls it through ``os``, so no engine module is reached into."""
    real = os.fsync
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        os.fsync = real


def one_round(predictor, variant: str, first: int, appends: int) -> dict:
    """``appends`` appends one at a time: seconds in all, and in the commits (log + apply)."""
    commit_s = 0.0
    started = time.perf_counter()
    with without_fsync() if variant == "no-fsync" else nullcontext():
        for i in range(first, first + appends):
            uid = f"bench-{variant}-{i}"
            batch = AppendBatch(
                labels=[(uid, f"{uid}: a label appended by the durability benchmark")],
                instances=[(f"{uid} tool: an instance of the new label", [uid])],
                append_id=uid,
            )
            vectors = predictor.prepare_append(batch)
            t0 = time.perf_counter()
            predictor.memory.commit(batch, vectors)
            commit_s += time.perf_counter() - t0
    return {"seconds": time.perf_counter() - started, "commit_seconds": commit_s}


def measure(bundle: Path, workdir: Path, rounds: int, appends: int) -> dict:
    predictors = {v: load_predictor(bundle, appends_dir=workdir / v) for v in VARIANTS}
    for variant, predictor in predictors.items():  # warm both (first allocations, page cache)
        one_round(predictor, variant, -appends, appends)
    per_round = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            per_round[variant].append(one_round(predictors[variant], variant, r * appends, appends))
    summary = {}
    for variant, results in per_round.items():
        summary[variant] = {
            "appends_per_s": statistics.median(appends / x["seconds"] for x in results),
            "commit_ms": statistics.median(1000 * x["commit_seconds"] / appends for x in results),
            "rounds_appends_per_s": [round(appends / x["seconds"], 1) for x in results],
            "rounds_commit_ms": [round(1000 * x["commit_seconds"] / appends, 3) for x in results],
            "log_bytes": (workdir / variant / f"{predictors[variant].bundle.bundle_id}.appends.log").stat().st_size,
        }
    durable, loose = summary["durable"], summary["no-fsync"]
    return {
        "variants": summary,
        "durable_over_no_fsync": {
            "appends_per_s": durable["appends_per_s"] / loose["appends_per_s"],
            "commit_ms": durable["commit_ms"] / loose["commit_ms"],
        },
    }


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench/results/append-durability.json", bundle=REQUIRED, data=None)
    parser.prog = "python -m bench.append_durability"
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each variant once per round")
    parser.add_argument("--appends", type=int, default=40, help="appends per variant per round")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the logs go (the filesystem measured; default: a temp dir)"
    )
    parser.add_argument("--note", default="", help="what the bundle and the disk are, for the JSON")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from xmc.results import write_result

    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        result = measure(args.bundle, Path(workdir), args.rounds, args.appends)
        filesystem = os.statvfs(workdir)
    result = {
        "bundle": str(args.bundle),
        "note": args.note,
        "rounds": args.rounds,
        "appends_per_round": args.appends,
        "append": "one label + one instance of it, append_id set, one call at a time (engine, no HTTP)",
        "workdir_filesystem_block_size": filesystem.f_bsize,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        **result,
    }
    write_result(args.out, result)
    print(json.dumps({k: result[k] for k in ("variants", "durable_over_no_fsync")}, indent=2))


if __name__ == "__main__":
    main()
