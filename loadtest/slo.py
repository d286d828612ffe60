"""SLO check of a locust run: read its ``*_stats.csv``, print a table, exit 1 on a miss.

python -m loadtest.slo loadtest/results/steady_stats.csv --p99-ms 250 --max-failure-ratio 0.01 --min-rps 20
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Slo:
    p99_ms: float = 250.0
    max_failure_ratio: float = 0.01
    min_rps: float = 20.0


def read_stats(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def row_figures(row: dict) -> dict:
    requests = int(row["Request Count"])
    failures = int(row["Failure Count"])
    return {
        "name": row["Name"] or row["Type"],
        "requests": requests,
        "rps": float(row["Requests/s"]),
        "p50_ms": float(row["50%"] or 0),
        "p95_ms": float(row["95%"] or 0),
        "p99_ms": float(row["99%"] or 0),
        "failure_ratio": failures / requests if requests else 1.0,
    }


def check(rows: list[dict], slo: Slo) -> tuple[list[str], list[dict]]:
    """Misses (empty = all SLOs met) judged on the Aggregated row, and every row's figures."""
    figures = [row_figures(r) for r in rows]
    total = next((f for f in figures if f["name"] == "Aggregated"), None)
    if total is None or total["requests"] == 0:
        return ["no requests were made"], figures
    misses = []
    if total["p99_ms"] > slo.p99_ms:
        misses.append(f"p99 {total['p99_ms']:.0f} ms > {slo.p99_ms:.0f} ms")
    if total["failure_ratio"] > slo.max_failure_ratio:
        misses.append(f"failure ratio {total['failure_ratio']:.4f} > {slo.max_failure_ratio}")
    if total["rps"] < slo.min_rps:
        misses.append(f"throughput {total['rps']:.1f} req/s < {slo.min_rps}")
    return misses, figures


def format_table(figures: list[dict], slo: Slo, misses: list[str]) -> str:
    header = f"{'request':<22}{'count':>8}{'req/s':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'fail %':>9}"
    lines = [header, "-" * len(header)]
    for f in figures:
        lines.append(
            f"{f['name']:<22}{f['requests']:>8}{f['rps']:>9.1f}{f['p50_ms']:>9.0f}{f['p95_ms']:>9.0f}"
            f"{f['p99_ms']:>9.0f}{100 * f['failure_ratio']:>9.2f}"
        )
    lines.append(
        f"SLO: p99 <= {slo.p99_ms:.0f} ms, failures <= {100 * slo.max_failure_ratio:.2f} %, "
        f"throughput >= {slo.min_rps} req/s"
    )
    lines.append("SLO MET" if not misses else "SLO MISSED: " + "; ".join(misses))
    return "\n".join(lines)


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Slo()
    parser.add_argument(
        "--p99-ms",
        type=float,
        default=defaults.p99_ms,
        help="SLO: highest allowed p99 latency over all requests, in ms",
    )
    parser.add_argument(
        "--max-failure-ratio",
        type=float,
        default=defaults.max_failure_ratio,
        help="SLO: highest allowed fraction of failed requests, 0 to 1",
    )
    parser.add_argument(
        "--min-rps", type=float, default=defaults.min_rps, help="SLO: lowest allowed throughput, in requests per second"
    )


def slo_from(args: argparse.Namespace) -> Slo:
    return Slo(p99_ms=args.p99_ms, max_failure_ratio=args.max_failure_ratio, min_rps=args.min_rps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stats_csv", type=Path, help="locust's *_stats.csv of the run to judge")
    add_slo_arguments(parser)
    args = parser.parse_args(argv)
    slo = slo_from(args)
    misses, figures = check(read_stats(args.stats_csv), slo)
    print(format_table(figures, slo, misses))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
