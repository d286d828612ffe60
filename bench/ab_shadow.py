"""A/B-shadow benchmark: the primary's latency with and without 100 % shadow traffic at the same
offered load, and a reload loop under load.

    python -m bench.ab_shadow [--bundle bundles/default] [--alt-bundle bundles/default-fp32]

1. Shadow cost: open-loop load at ``--rps`` against xmcserve with no shadow, then with every
   request mirrored (a) to a remote shadow xmcserve and (b) to the in-process candidate. On this
   2-core machine any shadow computes on the primary's cores; the remote shadow runs at
   ``nice 19`` to stand in for the separate machine or container it has in production (the
   compose stack), while the in-process row shows what sharing the CPU costs.
   The headline ratios come from interleaved runs: one server per shadow kind, the shadow
   switched on and off through ``/admin/config`` every few seconds, latencies pooled per phase.
2. Reload loop: under open-loop load, the primary is reloaded with a different bundle every
   ``--reload-every`` seconds for ``--reload-seconds``; every request must succeed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from bench.loadgen import LoadResult, open_loop
from bench.localserver import start_server, stop_server
from training.data import load_jsonl_split

TOKEN = "bench-admin-token"


def shadow_run(bundle: Path, bodies, rps: float, seconds: float, env: dict, logs: Path, name: str) -> dict:
    server = start_server(bundle, logs / f"{name}.log", extra_env=env)
    try:
        asyncio.run(open_loop(server.url, bodies, rps / 2, 3.0))  # warm-up
        row = asyncio.run(open_loop(server.url, bodies, rps, seconds)).summary()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        stop_server(server)
    row["shadow_compared_texts"] = metric_total(metrics, "xmcserve_shadow_compared_texts_total")
    row["shadow_dropped"] = metric_total(metrics, "xmcserve_shadow_dropped_total")
    print(name, json.dumps(row), flush=True)
    return row


def interleaved_run(bundle: Path, bodies, rps: float, segment_s: float, rounds: int, env: dict, logs: Path, name: str):
    """One primary server; ``shadow_fraction`` switched between 0 and 1 through ``/admin/config``
    every ``segment_s`` (off-on, on-off, …), the open-loop latencies pooled per phase. Both phases
    see the same process and the same drift of this shared machine, which separate runs of
    20 s each do not (their p99 differed by 2x with nothing changed)."""
    env = {**env, "XMCSERVE_ADMIN_TOKEN": TOKEN, "XMCSERVE_SHADOW_FRACTION": "0.0"}
    server = start_server(bundle, logs / f"{name}.log", extra_env=env)
    pooled = {phase: LoadResult("open", None, rps, 0.0) for phase in ("off", "on")}
    try:
        asyncio.run(open_loop(server.url, bodies, rps / 2, 3.0))  # warm-up
        for i in range(rounds):
            for phase in ("off", "on") if i % 2 == 0 else ("on", "off"):
                fraction = 1.0 if phase == "on" else 0.0
                httpx.post(
                    f"{server.url}/admin/config",
                    json={"shadow_fraction": fraction},
                    headers={"X-Admin-Token": TOKEN},
                    timeout=10,
                ).raise_for_status()
                part = asyncio.run(open_loop(server.url, bodies, rps, segment_s))
                into = pooled[phase]
                into.latencies_ms += part.latencies_ms
                into.seconds += part.seconds
                into.errors += part.errors
                into.client_cpu_s += part.client_cpu_s
                for status, count in part.statuses.items():
                    into.statuses[status] = into.statuses.get(status, 0) + count
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        stop_server(server)
    row = {phase: result.summary() for phase, result in pooled.items()}
    row["p99_ratio"] = round(row["on"]["p99_ms"] / row["off"]["p99_ms"], 3)
    row["shadow_compared_texts"] = metric_total(metrics, "xmcserve_shadow_compared_texts_total")
    row["shadow_dropped"] = metric_total(metrics, "xmcserve_shadow_dropped_total")
    print(name, json.dumps({k: row[k] for k in ("p99_ratio", "shadow_compared_texts", "shadow_dropped")}), flush=True)
    return row


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


def reload_run(bundle: Path, alt: Path, bodies, rps: float, every_s: float, seconds: float, logs: Path) -> dict:
    root = bundle.resolve().parent
    env = {"XMCSERVE_BUNDLE_ROOT": str(root), "XMCSERVE_ADMIN_TOKEN": TOKEN}
    server = start_server(bundle, logs / "reload.log", extra_env=env)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("bundles/default"))
    parser.add_argument(
        "--alt-bundle",
        type=Path,
        default=Path("bundles/default-fp32"),
        help="second bundle (same root) for the in-process candidate and the reload loop",
    )
    parser.add_argument("--data", type=Path, default=Path("data/debian-sample"))
    parser.add_argument("--rps", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--segment-seconds", type=float, default=5.0, help="shadow on/off phase length")
    parser.add_argument("--rounds", type=int, default=4, help="off/on pairs per shadow kind")
    parser.add_argument("--reload-every", type=float, default=4.0)
    parser.add_argument("--reload-seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/ab-shadow.json"))
    args = parser.parse_args()
    bodies = [json.dumps({"text": t, "k": 10}).encode() for t in load_jsonl_split(args.data, "dev").texts]
    logs = Path("/tmp/xmcserve-bench")
    logs.mkdir(exist_ok=True)

    result = {"offered_rps": args.rps, "seconds": args.seconds}
    result["no_shadow"] = shadow_run(args.bundle, bodies, args.rps, args.seconds, {}, logs, "no_shadow")
    shadow = start_server(args.alt_bundle, logs / "remote-shadow.log", nice=19)
    try:
        env = {"XMCSERVE_SHADOW_URL": shadow.url, "XMCSERVE_SHADOW_FRACTION": "1.0"}
        result["remote_shadow_100pct"] = shadow_run(args.bundle, bodies, args.rps, args.seconds, env, logs, "remote")
    finally:
        stop_server(shadow)
    env = {"XMCSERVE_CANDIDATE_BUNDLE_DIR": str(args.alt_bundle), "XMCSERVE_SHADOW_FRACTION": "1.0"}
    result["in_process_shadow_100pct"] = shadow_run(args.bundle, bodies, args.rps, args.seconds, env, logs, "inproc")
    # the headline ratios: shadow on and off interleaved in one server (see interleaved_run)
    segment, rounds = args.segment_seconds, args.rounds
    shadow = start_server(args.alt_bundle, logs / "remote-shadow-interleaved.log", nice=19)
    try:
        env = {"XMCSERVE_SHADOW_URL": shadow.url}
        result["remote_shadow_interleaved"] = interleaved_run(
            args.bundle, bodies, args.rps, segment, rounds, env, logs, "remote-interleaved"
        )
    finally:
        stop_server(shadow)
    env = {"XMCSERVE_CANDIDATE_BUNDLE_DIR": str(args.alt_bundle)}
    result["in_process_shadow_interleaved"] = interleaved_run(
        args.bundle, bodies, args.rps, segment, rounds, env, logs, "inproc-interleaved"
    )
    result["p99_ratio_remote_shadow"] = result["remote_shadow_interleaved"]["p99_ratio"]
    result["p99_ratio_in_process_shadow"] = result["in_process_shadow_interleaved"]["p99_ratio"]
    base = result["no_shadow"]["p99_ms"]
    result["p99_ratio_separate_runs"] = {
        "remote": round(result["remote_shadow_100pct"]["p99_ms"] / base, 3),
        "in_process": round(result["in_process_shadow_100pct"]["p99_ms"] / base, 3),
    }
    result["reload_loop"] = reload_run(
        args.bundle, args.alt_bundle, bodies, args.rps / 2, args.reload_every, args.reload_seconds, logs
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("p99_ratio_remote_shadow", "p99_ratio_in_process_shadow")}
            | {"reload_failed_requests": result["reload_loop"]["failed_requests"]},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
