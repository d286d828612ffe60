"""Headless locust run against a local xmcserve, with SLO gates.

    python -m loadtest.run [--scenario steady|ramp|spike] [--seconds 60] [--users 8]
                           [--bundle bundles/default | --host http://127.0.0.1:8000]
                           [--p99-ms 250] [--max-failure-ratio 0.01] [--min-rps 20]
                           [--ab-keys] [--results loadtest/results]

Starts a server on a free loopback port (unless --host names a running one, loopback only),
runs ``locust --headless`` for the bounded scenario, writes CSV + HTML under loadtest/results/,
prints the SLO table and exits 1 when an SLO is missed, 2 when locust itself failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from loadtest.slo import add_slo_arguments, check, format_table, read_stats, slo_from

HERE = Path(__file__).resolve().parent


def run_locust(host: str, scenario: str, seconds: float, users: int, results: Path, ab_keys: bool) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    prefix = results / scenario
    env = {
        **os.environ,
        "XMCSERVE_LOADTEST_SCENARIO": scenario,
        "XMCSERVE_LOADTEST_SECONDS": str(seconds),
        "XMCSERVE_LOADTEST_USERS": str(users),
        "XMCSERVE_LOADTEST_AB_KEYS": "1" if ab_keys else "0",
    }
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(HERE / "locustfile.py"),
        "--headless",
        "--host",
        host,
        "--csv",
        str(prefix),
        "--html",
        f"{prefix}.html",
        "--only-summary",
        "--stop-timeout",
        "5",
    ]
    stats = Path(f"{prefix}_stats.csv")
    stats.unlink(missing_ok=True)  # a stale file from an earlier run must not pass for this one
    # The shape stops the run; the timeout only guards against a hung locust.
    try:
        done = subprocess.run(command, env=env, check=False, timeout=seconds + 60)
    except subprocess.TimeoutExpired:
        raise LocustError(f"locust did not stop within {seconds + 60:.0f} s") from None
    if done.returncode not in (0, 1):  # 1: locust's own "there were failures", judged by the SLOs
        raise LocustError(f"locust exited with status {done.returncode}")
    return stats


class LocustError(RuntimeError):
    """locust itself failed (crash, hang): no verdict on the SLOs, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scenario",
        default="steady",
        choices=["steady", "ramp", "spike"],
        help="load shape: steady, ramp (up in 4 steps) or spike (all users in the middle fifth, a quarter otherwise)",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="total run time in seconds")
    parser.add_argument("--users", type=int, default=8, help="peak number of simulated users")
    parser.add_argument(
        "--bundle",
        type=Path,
        default=Path("bundles/default"),
        help="bundle the started server serves (unused with --host)",
    )
    parser.add_argument("--host", default=None, help="a running server (loopback only); default: start one")
    parser.add_argument("--ab-keys", action="store_true", help="send a sticky X-Request-Key per user")
    parser.add_argument(
        "--results", type=Path, default=HERE / "results", help="directory for locust's CSV and HTML output"
    )
    add_slo_arguments(parser)
    args = parser.parse_args(argv)
    server = None
    host = args.host
    if host is None:
        # imported here: the load generator's image (deploy/Dockerfile.loadtest) holds no server
        from loadtest.localserver import start_server

        server = start_server(args.bundle, Path("/tmp/xmcserve-loadtest-server.log"))
        host = server.url
    elif urlsplit(host).hostname not in ("127.0.0.1", "localhost", "::1"):
        parser.error("load tests target 127.0.0.1 / localhost only")
    try:
        stats = run_locust(host, args.scenario, args.seconds, args.users, args.results, args.ab_keys)
    except LocustError as exc:
        print(f"load test aborted: {exc}", file=sys.stderr)
        return 2
    finally:
        if server:
            from loadtest.localserver import stop_server

            stop_server(server)
    if not stats.exists():
        print(f"locust wrote no {stats}", file=sys.stderr)
        return 2
    slo = slo_from(args)
    misses, figures = check(read_stats(stats), slo)
    print(format_table(figures, slo, misses))
    print(f"results: {stats.parent}/{args.scenario}_*.csv, {args.scenario}.html")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
