"""A/B-shadow benchmark: the primary's latency with and without 100 % shadow traffic at the same
offered load, and a reload loop under load.

    python -m bench.ab_shadow [--bundle bundles/default] [--alt-bundle bundles/default-fp32]

1. Shadow cost: open-loop load at ``--rps`` against xmcserve with no shadow, then with every
   request mirrored (a) to a remote shadow xmcserve and (b) to the in-process candidate. On this
   2-core machine any shadow computes on the primary's cores; the remote shadow runs at
   ``nice 19`` to stand in for the separate machine or container it has in production (the
   compose stack), while the in-process row shows what sharing the CPU costs.
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

from bench.loadgen import open_loop
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
    base = result["no_shadow"]["p99_ms"]
    result["p99_ratio_remote_shadow"] = round(result["remote_shadow_100pct"]["p99_ms"] / base, 3)
    result["p99_ratio_in_process_shadow"] = round(result["in_process_shadow_100pct"]["p99_ms"] / base, 3)
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
