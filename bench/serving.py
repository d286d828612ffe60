"""Serving benchmark: xmcserve beside a naive server and beside the hardware bound, in one run.

    python -m bench.serving [--bundle bundles/default] [--seconds 12] [--out bench/results/serving.json]

1. FLOP bound: sustained float32 GFLOP/s of one large ONNX Runtime MatMul on this machine,
   divided by the encoder's FLOPs per query at the dev split's mean token count.
2. ANN recall@10 of the served search path against exact search, at the bundle's default ef.
3. For the naive server (per-request transformers + torch, same index) and xmcserve: real
   uvicorn processes on 127.0.0.1, closed-loop load at each concurrency, QPS and p50/p95/p99.
4. xmcserve at 70 % of its peak QPS, open loop (latency from the scheduled send time): p50,
   p99 and the refused fraction.
5. The encoder alone (tokenize + ONNX, no search, no HTTP) in this process at batch 1, 8 and 32,
   in the server's thread layout (its batch workers, each calling with its intra-op threads): the
   bound the server's peak is held to; beside it, one call at a time on all cores (the
   latency-first layout). The targets, as ratios: peak ≥ 0.9 × the encoder alone, p99 at 70 % of
   peak ≤ 2 full-batch times, idle p50 ≤ 1.5 × one batch-1 encoder call.
6. With ``--null-encoder``: the CPU per request of everything but the encoder, this tree against
   ``--baseline-tree`` (:mod:`studies.non_encoder_cost`), under ``non_encoder`` in the result.

Writes the JSON result and a PNG of latency against throughput.

``--observability-cost`` measures instead what the logs and traces cost at peak: three servers of
the bundle side by side (access lines off; JSON access lines on; JSON access lines and tracing
to an OTLP/HTTP receiver on 127.0.0.1), loaded in turn, closed loop at the peak concurrency, the
order rotated each round; the result is each configuration's throughput against the first's in
the same round.

``--peer infinity`` measures instead xmcserve's ``/predict`` beside a peer server on the same
model, machine and cores (:mod:`bench.lib.infinity_peer`: infinity-emb's ``/embeddings``, its
optimum engine serving all-MiniLM-L6-v2 exported to int8 ONNX by this project's recipe, from its
own virtualenv, ``make infinity-venv``). Both servers run side by side, pinned to the same cores
(``--cpus``, default the first two this process may use); at each closed-loop concurrency of
``--levels`` (1 gives the idle p50), one server then the other, the order reversed every other
round, so each round's pair shares the machine's state of the moment. The result is, per round
and as medians, each one's peak and idle p50, their ratios, each one's peak resident memory, and
the CPU each spent while the other was loaded (what an idle neighbour cost). Without the peer's
virtualenv it prints why it skipped and writes nothing; --out defaults to
bench/results/serving-infinity-peer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bench.lib import infinity_peer, non_encoder
from bench.lib.encoder_alone import encoder_alone
from bench.lib.profiling import server_cpu_s, tree_cpu_s, tree_peak_rss_mib
from engine import EncoderOptions
from engine.offline import ann_recall, load_bundle
from loadtest.loadgen import closed_loop, open_loop
from loadtest.localserver import free_port, parse_cpus, start_server, stop_server
from service.http.settings import Settings
from xmc.checkpoint import default_encoder_dir
from xmc.data import load_jsonl_split
from xmc.results import write_result

CONCURRENCY = (1, 4, 16, 64, 128)


def matmul_gflops(n: int = 1536, seconds: float = 4.0) -> float:
    """Sustained GFLOP/s of an n x n x n float32 MatMul in ONNX Runtime (all cores)."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["C"])],
        "matmul",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, [n, n])],
        [weight],
    )
    # ir_version pinned: the onnx package may write a newer IR than this onnxruntime reads.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a = rng.standard_normal((n, n)).astype(np.float32)
    for _ in range(3):
        session.run(None, {"A": a})
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        session.run(None, {"A": a})
        runs += 1
    return 2 * n**3 * runs / (time.perf_counter() - start) / 1e9


def encoder_flops_per_token(config: dict, mean_tokens: float, head_dim: int) -> float:
    """Multiply-adds x 2 per token: Q, K, V, O projections and the FFN per layer, attention scores
    and the weighted sum (grow with sequence length), and the serving head."""
    hidden = config.get("hidden_size") or config["dim"]
    ffn = config.get("intermediate_size") or config["hidden_dim"]
    layers = config.get("num_hidden_layers") or config["n_layers"]
    dense = 2 * (4 * hidden * hidden + 2 * hidden * ffn)
    attention = 2 * 2 * mean_tokens * hidden
    return layers * (dense + attention) + 2 * hidden * head_dim / mean_tokens


ENCODER_BATCHES = (1, 8, 32)


def served_layout(extra_env: dict) -> tuple[int, int]:
    """The (batch workers, intra-op threads) the server will run with under ``extra_env``."""
    saved = dict(os.environ)
    os.environ.update(extra_env)
    try:
        return Settings().thread_layout()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def encoder_rates(bundle_dir: Path, texts: list[str], workers: int, threads: int, seconds: float) -> dict:
    encoder = load_bundle(bundle_dir, EncoderOptions(intra_op_threads=threads)).encoder
    return {str(b): round(encoder_alone(encoder, texts, b, seconds, workers), 1) for b in ENCODER_BATCHES}


def refused_fraction(row: dict) -> float:
    """Requests not answered 200 (429 / 503 / errors) over all sent."""
    sent = row["requests"] + row["errors"]
    return round((sent - row["ok"]) / sent, 4) if sent else 0.0


def targets(result: dict, max_batch: int) -> dict:
    """The serving targets as measured ratios (so they carry across machines): peak ≥ 0.9 × the
    encoder alone at batch 32 in the served thread layout; at 70 % of peak p99 ≤ 2 full-batch
    times (one worker encoding ``max_batch`` texts) with ≤ 1 % refused; idle p50 ≤ 1.5 × one
    batch-1 encoder call."""
    encoder = result["encoder_alone_texts_per_s"]
    workers = result["thread_layout"]["batch_workers"]
    # each of the workers completes one batch-1 call per this many ms, one full batch per the other
    call_ms = workers * 1000 / encoder["1"]
    full_batch_ms = workers * 1000 * max_batch / encoder["32"]
    paced = result["paced_70pct"]
    return {
        "peak_over_encoder_b32": round(result["peak_qps"] / encoder["32"], 3),
        "full_batch_ms": round(full_batch_ms, 2),
        "p99_at_70pct_over_full_batch": round(paced["p99_ms"] / full_batch_ms, 2),
        "p99_at_70pct_over_idle_p50": round(paced["p99_ms"] / result["idle_p50_ms"], 2),
        "refused_fraction_at_70pct": refused_fraction(paced),
        "idle_p50_over_encoder_b1_ms": round(result["idle_p50_ms"] / call_ms, 2),
    }


def run_levels(url: str, bodies: list[bytes], seconds: float, levels=CONCURRENCY) -> list[dict]:
    rows = []
    asyncio.run(closed_loop(url, bodies, 4, 2.0))  # warm-up
    for concurrency in levels:
        row = asyncio.run(closed_loop(url, bodies, concurrency, seconds)).summary()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


OBSERVABILITY = {
    "access_log_off": {"XMCSERVE_LOG_FORMAT": "json", "XMCSERVE_LOG_ACCESS": "false"},
    "json_logs": {"XMCSERVE_LOG_FORMAT": "json"},
    "json_logs_and_tracing": {"XMCSERVE_LOG_FORMAT": "json", "OTEL_EXPORTER_OTLP_ENDPOINT": None},  # the receiver
}


def observability_cost(
    bundle: Path, bodies: list[bytes], concurrency: int, seconds: float, rounds: int, extra_env: dict
) -> dict:
    """Throughput and server CPU per answered request of each configuration in
    :data:`OBSERVABILITY`, loaded in turn (order rotated each round), and their ratios to
    ``access_log_off`` in the same round. On a machine shared with other work the throughput
    swings with their load; the CPU per request (what bounds the peak of a CPU-bound server)
    much less."""
    logs = Path("/tmp/xmcserve-bench")
    logs.mkdir(exist_ok=True)
    port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-m", "bench.lib.otlp_receiver", "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    servers = {}
    try:
        for name, env in OBSERVABILITY.items():
            env = {**extra_env, **{k: v or f"http://127.0.0.1:{port}" for k, v in env.items()}}
            servers[name] = start_server(bundle, logs / f"{name}.log", extra_env=env, timeout_s=180)
        names = list(servers)
        for server in servers.values():
            asyncio.run(closed_loop(server.url, bodies, concurrency, 3.0))  # warm-up
        qps: dict[str, list[float]] = {name: [] for name in names}
        cpu_ms: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                cpu0 = server_cpu_s(servers[name].url)
                row = asyncio.run(closed_loop(servers[name].url, bodies, concurrency, seconds)).summary()
                per_request = (server_cpu_s(servers[name].url) - cpu0) * 1000 / max(row["ok"], 1)
                qps[name].append(row["qps"])
                cpu_ms[name].append(round(per_request, 4))
                print(
                    json.dumps({"round": round_, "config": name, "cpu_ms_per_request": per_request, **row}), flush=True
                )
    finally:
        for server in servers.values():
            stop_server(server)
        receiver.terminate()
        exported = receiver.communicate(timeout=10)[0].strip()
    baseline = qps["access_log_off"]
    ratios = {name: [q / b for q, b in zip(values, baseline, strict=True)] for name, values in qps.items()}
    cpu_base = cpu_ms["access_log_off"]
    cpu_ratios = {name: [c / b for c, b in zip(values, cpu_base, strict=True)] for name, values in cpu_ms.items()}
    return {
        "concurrency": concurrency,
        "seconds_per_load": seconds,
        "rounds": rounds,
        "configurations": {name: {k: v for k, v in env.items() if v} for name, env in OBSERVABILITY.items()},
        "qps": qps,
        "median_qps": {name: round(statistics.median(values), 1) for name, values in qps.items()},
        "ratio_to_access_log_off_per_round": {name: [round(r, 4) for r in values] for name, values in ratios.items()},
        "median_throughput_loss": {name: round(1 - statistics.median(values), 4) for name, values in ratios.items()},
        "server_cpu_ms_per_request": cpu_ms,
        "cpu_per_request_ratio_per_round": {name: [round(r, 4) for r in values] for name, values in cpu_ratios.items()},
        # a CPU-bound server's peak is cores / CPU per request: the loss that CPU ratio implies
        "median_peak_loss_from_cpu": {
            name: round(1 - 1 / statistics.median(values), 4) for name, values in cpu_ratios.items()
        },
        "otlp_receiver": exported,
    }


PEERS = ("infinity",)
PEER_OUT = Path("bench/results/serving-infinity-peer.json")
ANSWER_MIN_COSINE = 0.999  # the peer's vectors against the prepared graph run here, one text a call


def peer_cpus(spec: str | None) -> set[int]:
    """The cores both servers are pinned to: ``spec`` (a CPU list), else the first two this
    process may run on."""
    return parse_cpus(spec) or set(sorted(os.sched_getaffinity(0))[:2])


def layout_on(cpus: set[int], extra_env: dict) -> tuple[int, int]:
    """The (batch workers, intra-op threads) xmcserve takes when pinned to ``cpus``."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return served_layout(extra_env)
    finally:
        os.sched_setaffinity(0, allowed)


@dataclass
class Turn:
    """One server of a comparison in turns: where it listens, what it is sent, its process."""

    url: str
    path: str
    bodies: list[bytes]
    pid: int


def in_turns(servers: dict[str, Turn], levels: list[int], seconds: float, rounds: int) -> tuple[dict, dict]:
    """At each concurrency of ``levels``, a closed loop of ``seconds`` on each server in turn (in
    ``servers``' order, reversed every other round); each load is given up ``seconds`` + 60 s
    after it starts. Returns each server's rows by round and the CPU seconds each spent while
    another was loaded."""
    rows: dict[str, list[list[dict]]] = {name: [[] for _ in range(rounds)] for name in servers}
    idle_cpu_s = dict.fromkeys(servers, 0.0)
    names = list(servers)
    for turn in servers.values():  # warm-up
        asyncio.run(asyncio.wait_for(closed_loop(turn.url, turn.bodies, 4, 2.0, path=turn.path), 60))
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for level in levels:
            for name in order:
                turn = servers[name]
                others = {other: tree_cpu_s(servers[other].pid) for other in names if other != name}
                load = closed_loop(turn.url, turn.bodies, level, seconds, path=turn.path)
                row = asyncio.run(asyncio.wait_for(load, seconds + 60)).summary()
                for other, cpu0 in others.items():
                    idle_cpu_s[other] += tree_cpu_s(servers[other].pid) - cpu0
                print(json.dumps({"round": round_, "server": name, **row}), flush=True)
                rows[name][round_].append(row)
    return rows, {name: round(cpu, 2) for name, cpu in idle_cpu_s.items()}


def turn_figures(rows_by_round: list[list[dict]]) -> dict:
    """One server's peak (the best closed-loop rate of the round) and idle p50 (its one-connection
    p50) per round, and their medians."""
    peaks = [max(rows, key=lambda r: r["qps"]) for rows in rows_by_round]
    idle = [next(r for r in rows if r["concurrency"] == 1) for rows in rows_by_round]
    return {
        "peak_qps_by_round": [r["qps"] for r in peaks],
        "peak_concurrency_by_round": [r["concurrency"] for r in peaks],
        "idle_p50_ms_by_round": [r["p50_ms"] for r in idle],
        "median_peak_qps": round(statistics.median(r["qps"] for r in peaks), 1),
        "median_idle_p50_ms": round(statistics.median(r["p50_ms"] for r in idle), 2),
    }


def peer_ratios(ours: dict, peer: dict) -> dict:
    """Ours over the peer's, round by round (both measured in the same round) and their medians."""
    peak = [a / b for a, b in zip(ours["peak_qps_by_round"], peer["peak_qps_by_round"], strict=True)]
    idle = [a / b for a, b in zip(ours["idle_p50_ms_by_round"], peer["idle_p50_ms_by_round"], strict=True)]
    return {
        "peak_over_peer_by_round": [round(r, 3) for r in peak],
        "median_peak_over_peer": round(statistics.median(peak), 3),
        "idle_p50_over_peer_by_round": [round(r, 3) for r in idle],
        "median_idle_p50_over_peer": round(statistics.median(idle), 3),
        "peak_rss_over_peer": round(ours["peak_rss_mib"] / peer["peak_rss_mib"], 3),
    }


def peer_comparison(
    bundle: Path,
    texts: list[str],
    levels: list[int],
    seconds: float,
    rounds: int,
    extra_env: dict,
    cpus: set[int],
    venv: Path,
    model_dir: Path,
) -> dict:
    """xmcserve's /predict and infinity-emb's /embeddings in turns (see the module's docstring),
    both pinned to ``cpus``; the peer from ``venv`` serving ``model_dir`` (made when missing)."""
    levels = sorted(set(levels) | {1})  # one connection: the idle p50
    model = infinity_peer.prepare_model(model_dir, texts)
    logs = Path("/tmp/xmcserve-bench")
    logs.mkdir(exist_ok=True)
    load_before = os.getloadavg()
    servers, started = {}, {}
    try:
        begun = time.perf_counter()
        servers["xmcserve"] = start_server(bundle, logs / "xmcserve-peer.log", extra_env, timeout_s=180, cpus=cpus)
        started["xmcserve"] = round(time.perf_counter() - begun, 1)
        begun = time.perf_counter()
        servers["infinity"] = infinity_peer.start(venv, model_dir, cpus, logs / "infinity.log")
        started["infinity"] = round(time.perf_counter() - begun, 1)
        check = texts[:3]
        reference = infinity_peer.reference_vectors(model_dir, check)
        cosines = infinity_peer.answer_cosines(servers["infinity"].url, check, reference)
        if min(cosines) < ANSWER_MIN_COSINE:
            raise RuntimeError(f"infinity does not answer the prepared graph's vectors (cosines {cosines})")
        turns = {
            "xmcserve": Turn(
                servers["xmcserve"].url,
                "/predict",
                [json.dumps({"text": t, "k": 10}).encode() for t in texts],
                servers["xmcserve"].process.pid,
            ),
            "infinity": Turn(
                servers["infinity"].url,
                infinity_peer.ENDPOINT,
                infinity_peer.request_bodies(texts),
                servers["infinity"].process.pid,
            ),
        }
        rows, idle_cpu_s = in_turns(turns, levels, seconds, rounds)
        rss = {name: tree_peak_rss_mib(server.process.pid) for name, server in servers.items()}
    finally:
        for server in servers.values():
            stop_server(server)
    workers, threads = layout_on(cpus, extra_env)
    ours = {
        "endpoint": "/predict",
        "answers": "the top 10 labels of one text (encoder, HNSW search, RAE aggregation)",
        "thread_layout": {"batch_workers": workers, "intra_op_threads": threads},
        "start_s": started["xmcserve"],
        **turn_figures(rows["xmcserve"]),
        "peak_rss_mib": rss["xmcserve"],
        "cpu_s_while_peer_loaded": idle_cpu_s["xmcserve"],
        "rows_by_round": rows["xmcserve"],
    }
    peer = {
        "endpoint": infinity_peer.ENDPOINT,
        "answers": "the 384-d mean-pooled, normalised vector of one text",
        "packages": infinity_peer.version(venv),
        "command": infinity_peer.launch_command(venv, len(cpus)) + ["--host", "127.0.0.1", "--port", "N"],
        "env": infinity_peer.launch_env(logs / "infinity-cache", len(cpus)),
        "intra_op_threads": len(cpus),
        "max_batch_size": infinity_peer.BATCH_SIZE,
        "model": model,
        "answer_cosines_vs_graph_here": cosines,
        "start_s": started["infinity"],
        **turn_figures(rows["infinity"]),
        "peak_rss_mib": rss["infinity"],
        "cpu_s_while_xmcserve_loaded": idle_cpu_s["infinity"],
        "rows_by_round": rows["infinity"],
    }
    ratios = peer_ratios(ours, peer)
    return {
        "cpus": sorted(cpus),
        "levels": levels,
        "seconds_per_level": seconds,
        "rounds": rounds,
        "load_average_before_after": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "xmcserve": ours,
        "infinity": peer,
        "ratios": ratios,
        "target": {
            "peak_at_least_peer": ratios["median_peak_over_peer"] >= 1.0,
            "rounds_with_peak_at_least_peer": sum(r >= 1.0 for r in ratios["peak_over_peer_by_round"]),
        },
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in (("naive (torch per request)", result["naive"]), ("xmcserve", result["xmcserve"])):
        qps = [r["qps"] for r in rows]
        ax.plot(qps, [r["p50_ms"] for r in rows], "o-", label=f"{name} p50")
        ax.plot(qps, [r["p99_ms"] for r in rows], "s--", label=f"{name} p99")
        for r in rows:
            ax.annotate(f"c={r['concurrency']}", (r["qps"], r["p99_ms"]), fontsize=7)
    ax.axvline(result["flop_bound_qps"], color="grey", linestyle=":", label="FLOP bound")
    ax.set_xlabel("throughput (queries/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title("POST /predict, closed loop, 2 CPU cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--bundle",
        type=Path,
        default=Path("bundles/default"),
        help="bundle served by xmcserve (and by the naive server)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("data/debian-sample"),
        help="dataset directory whose dev texts are sent as requests",
    )
    parser.add_argument("--seconds", type=float, default=12.0, help="per concurrency level")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench/results/serving.json"),
        help="result JSON file; the latency plot is written beside it as .png",
    )
    parser.add_argument("--skip-naive", action="store_true", help="do not run the naive server (and write no plot)")
    parser.add_argument("--levels", default=",".join(map(str, CONCURRENCY)), help="closed-loop concurrencies")
    parser.add_argument("--env", action="append", default=[], help="extra XMCSERVE_* settings, NAME=VALUE")
    parser.add_argument(
        "--observability-cost",
        action="store_true",
        help="measure only the throughput cost of access logs and tracing (see above); --out defaults to "
        "bench/results/observability-cost.json",
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds over the configurations or trees compared")
    parser.add_argument(
        "--null-encoder",
        action="store_true",
        help="also measure the CPU per request of everything but the encoder (studies.non_encoder_cost)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=64, help="--observability-cost: closed-loop concurrency (the peak's)"
    )
    parser.add_argument(
        "--peer",
        choices=PEERS,
        help="measure only /predict beside this peer server in turns (see above); --out defaults to " + str(PEER_OUT),
    )
    parser.add_argument(
        "--peer-venv", type=Path, default=infinity_peer.DEFAULT_VENV, help="--peer: the peer's virtualenv"
    )
    parser.add_argument(
        "--peer-model",
        type=Path,
        default=infinity_peer.DEFAULT_MODEL_DIR,
        help="--peer: the model folder the peer serves (made there when missing)",
    )
    parser.add_argument(
        "--cpus", help="--peer: the cores both servers are pinned to, e.g. 0-1 (default: the first two allowed)"
    )
    non_encoder.add_arguments(parser, rounds=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    extra_env = dict(item.split("=", 1) for item in args.env)
    levels = [int(x) for x in args.levels.split(",")]

    texts = load_jsonl_split(args.data, "dev").texts
    bodies = [json.dumps({"text": t, "k": 10}).encode() for t in texts]
    if args.peer:
        reason = infinity_peer.unavailable(args.peer_venv, args.peer_model)
        if reason:
            print(json.dumps({"peer": args.peer, "skipped": reason}), flush=True)
            return
        out = args.out if args.out != parser.get_default("out") else PEER_OUT
        result = {
            "machine": {
                "cpus": os.cpu_count(),
                "processor": platform.processor() or platform.machine(),
                "onnxruntime": ort.__version__,
            },
            "note": "measured beside other work on a shared machine: compare the two servers within a round "
            "(their ratios), not absolute figures across runs",
            "bundle": str(args.bundle),
            "settings": extra_env,
            "peer": args.peer,
            **peer_comparison(
                args.bundle,
                texts,
                levels,
                args.seconds,
                args.rounds,
                extra_env,
                peer_cpus(args.cpus),
                args.peer_venv,
                args.peer_model,
            ),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        write_result(out, result)
        summary = {
            name: {k: v for k, v in result[name].items() if k.startswith("median_") or k == "peak_rss_mib"}
            for name in ("xmcserve", "infinity")
        }
        print(json.dumps({**summary, "ratios": result["ratios"], "target": result["target"]}, indent=2))
        return
    if args.observability_cost:
        out = args.out if args.out != parser.get_default("out") else Path("bench/results/observability-cost.json")
        result = {
            "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
            "bundle": str(args.bundle),
            "settings": extra_env,
            **observability_cost(args.bundle, bodies, args.concurrency, args.seconds, args.rounds, extra_env),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        write_result(out, result)
        summary = ("median_qps", "median_throughput_loss", "median_peak_loss_from_cpu")
        print(json.dumps({k: result[k] for k in summary}, indent=2))
        return
    bundle = load_bundle(args.bundle)
    mean_tokens = float(np.mean([len(ids) for ids in bundle.encoder.tokenize(texts)]))
    config = json.loads((default_encoder_dir() / "config.json").read_text())
    gflops = matmul_gflops()
    flops_per_query = encoder_flops_per_token(config, mean_tokens, bundle.manifest.dim) * mean_tokens
    recall = ann_recall(bundle, texts, k=10)
    workers, threads = served_layout(extra_env)
    # the bound: the encoder alone in the layout the server runs; beside it one call on all cores
    served = encoder_rates(args.bundle, texts, workers, threads, args.seconds / 2)
    one_call = encoder_rates(args.bundle, texts, 1, workers * threads, args.seconds / 2)
    print(json.dumps({"layout": [workers, threads], "served": served, "one_call_all_cores": one_call}), flush=True)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "onnxruntime": ort.__version__,
        },
        "bundle_id": bundle.bundle_id,
        "settings": extra_env,
        "matmul_gflops": round(gflops, 1),
        "mean_tokens": round(mean_tokens, 2),
        "encoder_mflops_per_query": round(flops_per_query / 1e6, 1),
        "flop_bound_qps": round(gflops * 1e9 / flops_per_query, 1),
        "recall_at_10": round(recall, 4),
        "recall_ef": bundle.manifest.search_breadth,
        "thread_layout": {"batch_workers": workers, "intra_op_threads": threads},
        "encoder_alone_texts_per_s": served,
        "encoder_alone_one_call_all_cores_texts_per_s": one_call,
    }
    del bundle
    print(json.dumps(result), flush=True)
    logs = Path("/tmp/xmcserve-bench")
    logs.mkdir(exist_ok=True)

    if not args.skip_naive:
        server = start_server(args.bundle, logs / "naive.log", app="bench.lib.naive_server:create_app", timeout_s=180)
        try:
            result["naive"] = run_levels(server.url, bodies, args.seconds, levels)
        finally:
            stop_server(server)
    server = start_server(args.bundle, logs / "xmcserve.log", extra_env=extra_env)
    try:
        result["xmcserve"] = run_levels(server.url, bodies, args.seconds, levels)
        peak = max(r["qps"] for r in result["xmcserve"])
        paced = asyncio.run(open_loop(server.url, bodies, 0.7 * peak, max(args.seconds, 20.0))).summary()
        print(json.dumps(paced), flush=True)
        result["paced_70pct"] = paced
    finally:
        stop_server(server)

    result["peak_qps"] = peak
    result["naive_peak_qps"] = max(r["qps"] for r in result["naive"]) if "naive" in result else None
    result["p99_ms_at_70pct_peak"] = result["paced_70pct"]["p99_ms"]
    result["idle_p50_ms"] = result["xmcserve"][0]["p50_ms"]
    result["ratios"] = {
        "peak_over_naive": round(peak / result["naive_peak_qps"], 2) if result["naive_peak_qps"] else None,
        "peak_over_flop_bound": round(peak / result["flop_bound_qps"], 3),
        **targets(result, Settings().batching.max_batch_size),
    }
    if args.null_encoder:  # what the server costs besides the encoder, against another checkout
        result["non_encoder"] = non_encoder.run(args, args.bundle, args.data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    if "naive" in result:
        plot(result, args.out.with_suffix(".png"))
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "naive_peak_qps",
                    "peak_qps",
                    "flop_bound_qps",
                    "p99_ms_at_70pct_peak",
                    "idle_p50_ms",
                    "recall_at_10",
                    "ratios",
                )
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
