"""What the rollout page's ring of recent shadow comparisons costs the primary's process.

The ring is filled where the shadow's results reach the event loop (:meth:`ShadowMirror.record`),
never on /predict's own path. This times ``record`` of a shadow result with the ring against the
same call with the ring's append skipped, the append alone, and the unpickling of a result with and without the
per-text samples the ring needs, alternating the variants in rounds within one run.

    python -m bench.rollout_ring --out bench/results/rollout-ring.json
"""

from __future__ import annotations

import json
import pickle
import platform
import statistics
import time
from pathlib import Path

from bench.lib.args import bench_parser
from service.http.metrics import Metrics
from service.rollout.agreement import AgreementHistory
from service.rollout.shadow import ShadowConfig, ShadowMirror
from xmc.results import write_result


class IdleWorker:
    outstanding = 0

    def start(self) -> None:
        pass


def shadow_result(texts: int) -> tuple:
    samples = [
        (f"python3-module-{i}: a Python module for the benchmark", 10, 0.8, 0.6, 0.01, 0.003) for i in range(texts)
    ]
    columns = [[s[i] for s in samples] for i in (2, 3, 4)]
    return ("compared", texts, *columns, [0.003] * texts, samples)


def per_call_us(call, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__.split("\n\n")[0], bundle=None, data=None)
    parser.add_argument("--texts", type=int, default=32, help="texts in one shadow result (the default batch_texts)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, each timing every variant once")
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant per round")
    parser.add_argument("--out", type=Path, help="write the results JSON here")
    args = parser.parse_args(argv)

    result = shadow_result(args.texts)
    without_samples = result[:-1]
    with_ring = ShadowMirror(ShadowConfig(fraction=1.0), Metrics(), "bench", IdleWorker())
    without_ring = ShadowMirror(ShadowConfig(fraction=1.0), Metrics(), "bench", IdleWorker())
    without_ring.history.add_compared = lambda samples: None
    ring = AgreementHistory()
    pickled, pickled_without = pickle.dumps(result), pickle.dumps(without_samples)
    variants = {
        "record_with_ring": lambda: with_ring.record(result),
        "record_without_ring": lambda: without_ring.record(result),
        "ring_append_alone": lambda: ring.add_compared(result[-1]),
        "unpickle_with_samples": lambda: pickle.loads(pickled),
        "unpickle_without_samples": lambda: pickle.loads(pickled_without),
    }
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, call in variants.items():
            timings[name].append(per_call_us(call, args.calls))
    medians = {name: statistics.median(values) for name, values in timings.items()}
    out = {
        "texts_per_result": args.texts,
        "rounds": args.rounds,
        "calls_per_round": args.calls,
        "median_us_per_result": {name: round(value, 2) for name, value in medians.items()},
        "record_delta_us_per_text": round(
            (medians["record_with_ring"] - medians["record_without_ring"]) / args.texts, 3
        ),
        "ring_append_us_per_text": round(medians["ring_append_alone"] / args.texts, 3),
        "samples_unpickle_us_per_text": round(
            (medians["unpickle_with_samples"] - medians["unpickle_without_samples"]) / args.texts, 3
        ),
        "result_bytes": {"with_samples": len(pickled), "without_samples": len(pickled_without)},
        "machine": f"{platform.processor() or platform.machine()}, shared with other jobs",
    }
    if args.out:
        write_result(args.out, out)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
