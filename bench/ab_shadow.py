"""A/B-shadow benchmark: the primary's latency and CPU with and without 100 % mirroring to a
remote shadow at the same offered load, and a reload loop under load.

    python -m bench.ab_shadow [--bundle bundles/default] [--alt-bundle bundles/default-fp32]

The offered load is ``--load-share`` (0.5) of the primary's closed-loop peak, measured first.

1. Shadow cost: a shadow xmcserve serving ``--alt-bundle`` on this machine; one primary server
   takes open-loop load while ``/admin/config`` switches ``shadow_fraction`` between 0 and 1
   every ``--segment-seconds`` (off-on, on-off, …, ``--rounds`` pairs; before each segment a
   pause lets the last phase's copies settle); latencies are pooled per phase. Both phases share
   the process and the drift of this shared VM; separate runs do not. Reported: the pooled p99
   ratio on/off with a 90 % interval from resampling whole rounds, the per-round ratios, the
   primary's CPU per request (its server process, and with its shadow worker child), the CPU
   steal, and what the shadow compared and dropped (by reason).
2. Reload loop: under open-loop load, the primary is reloaded with a different bundle every
   ``--reload-every`` seconds for ``--reload-seconds``; every request must succeed.

``--primary-cpus``, ``--shadow-cpus`` and ``--loadgen-cpus`` (e.g. ``0-1``) pin the primary server,
the shadow server and this process (the load generator) to cores, as a shadow on hardware of
its own runs; by default nothing is pinned and everything shares the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import numpy as np

from bench.lib.args import bench_parser
from bench.lib.profiling import process_cpu_s, tree_cpu_s
from loadtest.loadgen import closed_loop, open_loop
from loadtest.localserver import parse_cpus, start_server, stop_server
from xmc.data import load_jsonl_split
from xmc.results import write_result

TOKEN = "bench-admin-token"
SHADOW_COUNTERS = ("xmcserve_shadow_compared_texts_total", "xmcserve_shadow_dropped_total")


def cpu_steal_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot, from /proc/stat (0, 0 where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def shadow_counters(url: str) -> dict[str, float]:
    """The shadow's compared and dropped totals, and dropped per reason (``dropped:<reason>``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    counters = {name: metric_total(text, name) for name in SHADOW_COUNTERS}
    for line in text.splitlines():
        if line.startswith("xmcserve_shadow_dropped_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            key = f"dropped:{reason}"
            counters[key] = counters.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


def p99(latencies: np.ndarray) -> float:
    return float(np.percentile(latencies, 99))


def round_interval(rounds: list[dict[str, np.ndarray]], draws: int = 2000, seed: int = 0) -> list[float]:
    """5th and 95th percentile of the pooled p99 ratio over rounds drawn with replacement: whole
    rounds, because a VM stall lands on consecutive requests of one segment."""
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(draws):
        pick = rng.integers(0, len(rounds), len(rounds))
        on = np.concatenate([rounds[i]["on"] for i in pick])
        off = np.concatenate([rounds[i]["off"] for i in pick])
        ratios.append(p99(on) / p99(off))
    return [round(float(x), 3) for x in np.percentile(ratios, [5, 95])]


def set_shadow_fraction(url: str, fraction: float) -> None:
    httpx.post(
        f"{url}/admin/config", json={"shadow_fraction": fraction}, headers={"X-Admin-Token": TOKEN}, timeout=10
    ).raise_for_status()


def interleaved_run(
    bundle: Path,
    bodies,
    rps: float,
    segment_s: float,
    rounds: int,
    env: dict,
    logs: Path,
    name: str,
    cpus: set[int] | None = None,
):
    """One primary server; ``shadow_fraction`` switched between 0 and 1 every ``segment_s``
    (off-on, on-off, …), the open-loop latencies pooled per phase (see the module docstring)."""
    env = {**env, "XMCSERVE_ADMIN_TOKEN": TOKEN, "XMCSERVE_SHADOW_FRACTION": "0.0"}
    settle_s = float(env.get("XMCSERVE_SHADOW_TIMEOUT_MS", 2000)) / 1000 + 0.5
    server = start_server(bundle, logs / f"{name}.log", extra_env=env, cpus=cpus)
    per_round: list[dict[str, np.ndarray]] = []
    steal = {"off": [0, 0], "on": [0, 0]}
    counters: dict[str, dict[str, float]] = {"off": {}, "on": {}}
    primary_cpu = {"off": 0.0, "on": 0.0}
    with_worker_cpu = {"off": 0.0, "on": 0.0}
    statuses: dict[str, dict[str, int]] = {"off": {}, "on": {}}
    errors = {"off": 0, "on": 0}
    try:
        asyncio.run(open_loop(server.url, bodies, rps / 2, 3.0))  # warm-up
        for i in range(rounds):
            latencies = {}
            for phase in ("off", "on") if i % 2 == 0 else ("on", "off"):
                set_shadow_fraction(server.url, 1.0 if phase == "on" else 0.0)
                # copies of the last on-phase settle (answer or time out) before this one starts
                time.sleep(settle_s)
                before, steal_before = shadow_counters(server.url), cpu_steal_jiffies()
                cpu_before = process_cpu_s(server.process.pid)
                all_cpu_before = tree_cpu_s(server.process.pid)  # with its shadow worker
                part = asyncio.run(open_loop(server.url, bodies, rps, segment_s))
                # copies still in flight when the phase ends are counted in the next phase
                primary_cpu[phase] += process_cpu_s(server.process.pid) - cpu_before
                with_worker_cpu[phase] += tree_cpu_s(server.process.pid) - all_cpu_before
                after, steal_after = shadow_counters(server.url), cpu_steal_jiffies()
                latencies[phase] = np.asarray(part.latencies_ms)
                for name_, value in after.items():
                    counters[phase][name_] = counters[phase].get(name_, 0.0) + value - before.get(name_, 0.0)
                steal[phase][0] += steal_after[0] - steal_before[0]
                steal[phase][1] += steal_after[1] - steal_before[1]
                errors[phase] += part.errors + len(part.latencies_ms) - part.statuses.get(200, 0)
                for status, count in part.statuses.items():
                    statuses[phase][str(status)] = statuses[phase].get(str(status), 0) + count
            per_round.append(latencies)
        set_shadow_fraction(server.url, 0.0)
    finally:
        stop_server(server)
    row = {}
    for phase in ("off", "on"):
        pooled = np.concatenate([r[phase] for r in per_round])
        row[phase] = {
            "requests": int(pooled.size),
            "failed": errors[phase],
            "statuses": statuses[phase],
            "p50_ms": round(float(np.percentile(pooled, 50)), 2),
            "p95_ms": round(float(np.percentile(pooled, 95)), 2),
            "p99_ms": round(p99(pooled), 2),
            "cpu_steal_share": round(steal[phase][0] / max(steal[phase][1], 1), 4),
            # the primary server process's own CPU per request, and with its shadow worker child
            "primary_cpu_ms_per_request": round(1000 * primary_cpu[phase] / max(pooled.size, 1), 3),
            "primary_with_worker_cpu_ms_per_request": round(1000 * with_worker_cpu[phase] / max(pooled.size, 1), 3),
            "shadow_compared_texts": counters[phase].get("xmcserve_shadow_compared_texts_total", 0.0),
            "shadow_dropped": counters[phase].get("xmcserve_shadow_dropped_total", 0.0),
            "shadow_dropped_by_reason": {
                k.split(":", 1)[1]: v for k, v in sorted(counters[phase].items()) if k.startswith("dropped:") and v
            },
        }
    row["p99_ratio"] = round(row["on"]["p99_ms"] / row["off"]["p99_ms"], 3)
    row["p99_ratio_90pct_interval"] = round_interval(per_round)
    off_cpu = row["off"]["primary_cpu_ms_per_request"]
    row["primary_cpu_per_request_ratio"] = (
        round(row["on"]["primary_cpu_ms_per_request"] / off_cpu, 3) if off_cpu else None
    )
    off_all = row["off"]["primary_with_worker_cpu_ms_per_request"]
    row["primary_with_worker_cpu_per_request_ratio"] = (
        round(row["on"]["primary_with_worker_cpu_ms_per_request"] / off_all, 3) if off_all else None
    )
    row["p99_ratio_per_round"] = [round(p99(r["on"]) / p99(r["off"]), 3) for r in per_round]
    row["within_10pct"] = row["p99_ratio"] <= 1.10
    print(name, json.dumps({k: row[k] for k in ("p99_ratio", "p99_ratio_90pct_interval", "within_10pct")}), flush=True)
    print(name, "on:", json.dumps(row["on"]), flush=True)
    return row


def measure_peak(bundle: Path, bodies, logs: Path, seconds: float = 10.0, cpus: set[int] | None = None) -> float:
    """Closed-loop q/s of the primary alone (32 connections): the offered load is a share of it,
    so the benchmark asks the same of a fast and a slow moment of this VM."""
    server = start_server(bundle, logs / "peak.log", cpus=cpus)
    try:
        asyncio.run(closed_loop(server.url, bodies, 8, 3.0))  # warm-up
        return asyncio.run(closed_loop(server.url, bodies, 32, seconds)).summary()["qps"]
    finally:
        stop_server(server)


def metric_total(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def reload_loop(url: str, relative: list[str], every_s: float, seconds: float) -> list[dict]:
    events = []
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={"X-Admin-Token": TOKEN}) as client:
        i = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            r = await client.post("/admin/reload", json={"variant": "A", "bundle": relative[i % len(relative)]})
            events.append(
                {
                    "status": r.status_code,
                    "seconds": round(time.perf_counter() - started, 2),
                    "bundle_id": r.json().get("bundle_id"),
                }
            )
            i += 1
            await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - started)))
    return events


def reload_run(
    bundle: Path,
    alt: Path,
    bodies,
    rps: float,
    every_s: float,
    seconds: float,
    logs: Path,
    cpus: set[int] | None = None,
) -> dict:
    root = bundle.resolve().parent
    env = {"XMCSERVE_BUNDLE_ROOT": str(root), "XMCSERVE_ADMIN_TOKEN": TOKEN}
    server = start_server(bundle, logs / "reload.log", extra_env=env, cpus=cpus)
    names = [alt.resolve().relative_to(root).as_posix(), bundle.resolve().relative_to(root).as_posix()]

    async def both():
        return await asyncio.gather(
            open_loop(server.url, bodies, rps, seconds), reload_loop(server.url, names, every_s, seconds)
        )

    try:
        load, events = asyncio.run(both())
    finally:
        stop_server(server)
    row = load.summary()
    failed = row["requests"] - row["ok"] + row["errors"]
    result = {
        "load": row,
        "reloads": len(events),
        "reload_statuses": sorted({e["status"] for e in events}),
        "reload_seconds_max": max(e["seconds"] for e in events),
        "distinct_bundles": len({e["bundle_id"] for e in events}),
        "failed_requests": failed,
    }
    print("reload", json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = bench_parser(__doc__, "bench/results/ab-shadow.json")
    parser.add_argument(
        "--alt-bundle",
        type=Path,
        default=Path("bundles/default-fp32"),
        help="second bundle (same root): what the shadow serves, and the reload loop's other bundle",
    )
    parser.add_argument("--rps", type=float, default=None, help="offered load; default: --load-share of the peak")
    parser.add_argument("--load-share", type=float, default=0.5, help="offered load as a share of the measured peak")
    parser.add_argument("--segment-seconds", type=float, default=8.0, help="shadow on/off phase length")
    parser.add_argument("--rounds", type=int, default=30, help="off/on pairs per shadow kind")
    parser.add_argument("--reload-every", type=float, default=4.0, help="seconds between reloads in the reload loop")
    parser.add_argument("--reload-seconds", type=float, default=60.0, help="length of the reload loop, in seconds")
    parser.add_argument("--primary-cpus", default=None, help="pin the primary server, e.g. 0-1")
    parser.add_argument("--shadow-cpus", default=None, help="pin the shadow server, e.g. 2-3")
    parser.add_argument("--loadgen-cpus", default=None, help="pin this process (the load generator)")
    args = parser.parse_args()
    primary_cpus, shadow_cpus = parse_cpus(args.primary_cpus), parse_cpus(args.shadow_cpus)
    if loadgen_cpus := parse_cpus(args.loadgen_cpus):
        os.sched_setaffinity(0, loadgen_cpus)
    bodies = [json.dumps({"text": t, "k": 10}).encode() for t in load_jsonl_split(args.data, "dev").texts]
    logs = Path("/tmp/xmcserve-bench")
    logs.mkdir(exist_ok=True)

    peak = measure_peak(args.bundle, bodies, logs, cpus=primary_cpus) if args.rps is None else None
    args.rps = args.rps or round(args.load_share * peak, 1)
    result = {
        "peak_qps": peak,
        "offered_rps": args.rps,
        "segment_seconds": args.segment_seconds,
        "rounds": args.rounds,
        "cpus": {"primary": args.primary_cpus, "shadow": args.shadow_cpus, "loadgen": args.loadgen_cpus},
        "machine_cpus": os.cpu_count(),
    }
    print("offered", args.rps, "q/s; peak", peak, flush=True)

    shadow = start_server(args.alt_bundle, logs / "remote-shadow.log", cpus=shadow_cpus)
    try:
        result["remote_shadow"] = interleaved_run(
            args.bundle,
            bodies,
            args.rps,
            args.segment_seconds,
            args.rounds,
            {"XMCSERVE_SHADOW_URL": shadow.url},
            logs,
            "remote",
            primary_cpus,
        )
    finally:
        stop_server(shadow)
    result["reload_loop"] = reload_run(
        args.bundle, args.alt_bundle, bodies, args.rps / 2, args.reload_every, args.reload_seconds, logs, primary_cpus
    )
    write_result(args.out, result)
    rows = {key: row for key, row in result.items() if isinstance(row, dict) and "p99_ratio" in row}
    ratios = {f"p99_ratio_{key}": row["p99_ratio"] for key, row in rows.items()}
    print(json.dumps(ratios | {"reload_failed_requests": result["reload_loop"]["failed_requests"]}, indent=2))


if __name__ == "__main__":
    main()
