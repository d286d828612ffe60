"""A label index past one process: the single server against Ray Serve with 1, 2 and 4 shards,
in one run, at a synthetic label count (default 1M).

    python -m bench.ray_scale build   [--labels 1000000] [--shards 1,2,4] [--workdir /tmp/xmcserve-ray-scale]
    python -m bench.ray_scale measure [--labels 1000000] [--shards 1,2,4] [--out bench/results/ray-scale.json]

``build`` writes one labels-index bundle per shard count: clustered 64-d label vectors
(bench.ann_scale's mixture), the default bundle's encoder and tokenizer, HNSW M 32,
ef_construction 200 (the export defaults), shards built one after another and timed each.
Bundles already built are kept (a build of 1M labels takes minutes on 2 cores).

``measure``, in one run, for each bundle: recall@10 of the sharded search (every shard searched,
merged by :func:`engine.merge_answers`) against exact search, on queries drawn from
the same mixture; bytes per label per shard; then over HTTP on 127.0.0.1 with the dev texts, k 10:
the single uvicorn server on the unsharded bundle, and Ray Serve (a local cluster, ``build_app``)
on each sharded one — p50/p99 at one request at a time, and QPS and p99 at ``--concurrency``.
The ratio Ray / single at one request at a time is the cost of the ingress, the hops and the merge.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from bench.lib.args import bench_parser
from bench.lib.profiling import memory
from bench.lib.synthetic import clustered_vectors, draw, exact_top10
from bundle import ENCODER_FILE, LABELS_FILE, TOKENIZER_FILE, Counts, HnswParams, Shard, shard_list
from engine.offline import fetch_and_ef, recall_at_k
from loadtest.loadgen import closed_loop
from loadtest.localserver import free_port, start_server, stop_server
from xmc.data import LabelSpace, load_jsonl_split
from xmc.results import write_result

M, EF_CONSTRUCTION, EF_SEARCH = 32, 200, 300
DIM = 64


def bundle_path(workdir: Path, labels: int, shards: int) -> Path:
    return workdir / f"labels-{labels}-{shards}shards"


def build(labels: int, shards: int, workdir: Path, encoder_bundle: Path, seed: int) -> Path:
    """One labels-index bundle over ``labels`` synthetic vectors in ``shards`` shards."""
    from bundle import read_manifest
    from export.build import ExportParams, build_hnsw, write_labels
    from export.writer import write_bundle

    out = bundle_path(workdir, labels, shards)
    if (out / "manifest.json").is_file():
        return out
    vectors, _ = clustered_vectors(labels, np.random.default_rng(seed))
    source = read_manifest(encoder_bundle)
    params = ExportParams(index_kind="labels", hnsw_m=M, ef_construction=EF_CONSTRUCTION, ef_search=EF_SEARCH)

    def populate(stage: Path) -> dict:
        for name in (ENCODER_FILE, TOKENIZER_FILE):
            shutil.copy(encoder_bundle / name, stage / name)
        uids = [f"synthetic-{i}" for i in range(labels)]
        write_labels(LabelSpace(uids, [f"synthetic label {i}" for i in range(labels)]), stage / LABELS_FILE)
        shard_entries, seconds = [], []
        for i, ids in enumerate(np.array_split(np.arange(labels), shards)):
            first, name = int(ids[0]), (f"index-{i}.hnsw" if shards > 1 else "index.hnsw")
            started = time.perf_counter()
            build_hnsw(vectors[first : first + len(ids)], params, stage / name, first_id=first)
            seconds.append(round(time.perf_counter() - started, 1))
            shard_entries.append(Shard(index=name, first_key=first, keys=len(ids)))
            print(f"{labels} labels, shard {i + 1}/{shards}: {seconds[-1]} s", flush=True)
        return {
            "created_at": source.created_at,
            "source": source.source.model_copy(update={"data": f"synthetic clustered, seed {seed}"}),
            "tokenizer": source.tokenizer,
            "dim": DIM,
            "index_kind": "labels",
            "hnsw": HnswParams(space="ip", M=M, ef_construction=EF_CONSTRUCTION, ef_search=EF_SEARCH),
            "counts": Counts(labels=labels, memory_rows=labels),
            "shards": shard_entries if shards > 1 else None,
            "params": {"shard_build_seconds": seconds, "build_threads": params.build_threads, "seed": seed},
        }

    write_bundle(out, populate)
    return out


def sharded_recall(bundle: Path, labels: int, queries: int, seed: int) -> dict:
    """Recall@10 of every shard searched at the default ef and merged, against exact search."""
    from bundle import read_manifest
    from engine.offline import load_shard, merge_answers

    rng = np.random.default_rng(seed)
    vectors, (centres, weights, spread) = clustered_vectors(labels, rng)
    query_vectors = draw(centres, weights, queries, rng, spread)
    truth = exact_top10(vectors, query_vectors)
    del vectors
    manifest = read_manifest(bundle)
    fetch, ef = fetch_and_ef(10, EF_SEARCH, labels)
    shards = shard_list(manifest)
    searchers = [load_shard(bundle, i, verify=False, search_threads=1)[1] for i in range(len(shards))]
    answers, seconds = [], []
    for searcher in searchers:
        started = time.perf_counter()
        answers.append(searcher.search(query_vectors, fetch, ef))
        seconds.append(time.perf_counter() - started)
    keys = merge_answers(answers, 10).keys
    recall = recall_at_k([set(row) for row in truth.tolist()], keys.tolist())
    return {
        "recall_at_10": round(recall, 4),
        "ef": ef,
        # one thread, the queries in one batch: what one core of a shard replica sustains
        "shard_queries_per_core_second": [round(queries / s, 1) for s in seconds],
        "bytes_per_label_per_shard": [round((bundle / s.index).stat().st_size / s.keys, 1) for s in shards],
        "labels_per_shard": [s.keys for s in shards],
        "shard_build_seconds": manifest.params.get("shard_build_seconds"),
    }


def load(url: str, bodies: list[bytes], seconds: float, concurrency: int) -> dict:
    asyncio.run(closed_loop(url, bodies, 1, 3.0))  # warm: the first requests allocate
    idle = asyncio.run(closed_loop(url, bodies, 1, seconds)).summary()
    busy = asyncio.run(closed_loop(url, bodies, concurrency, seconds)).summary()
    return {"one_at_a_time": idle, f"concurrency_{concurrency}": busy}


def measure_single(bundle: Path, bodies, seconds, concurrency, logs: Path) -> dict:
    server = start_server(bundle, logs / "single.log", timeout_s=300)
    try:
        return {**load(server.url, bodies, seconds, concurrency), "rss_mib": memory(server.process.pid)["rss_mib"]}
    finally:
        stop_server(server)


def ray_hop_ms(calls: int = 300) -> dict:
    """What one Serve handle call costs on this machine, work aside: p50/p99 of a round trip to a
    deployment that returns its 64-d argument (the ingress makes three such hops per request)."""
    import ray
    from ray import serve

    @serve.deployment
    class Echo:
        async def echo(self, vector):
            return vector

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(Echo.bind(), name="echo", route_prefix=None)

        async def probe() -> list[float]:
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                await handle.echo.remote(np.zeros(DIM, dtype=np.float32))
                times.append((time.perf_counter() - started) * 1000)
            return times

        times = asyncio.run(probe())[calls // 10 :]  # the first calls open connections
        return {f"p{q}_ms": round(float(np.percentile(times, q)), 2) for q in (50, 99)}
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_rss_mib(app: str = "xmcserve") -> dict[str, list[float]]:
    """Resident memory of each Serve replica process of ``app``, by deployment name."""
    prefix = f"ray::ServeReplica:{app}:".encode()
    found: dict[str, list[float]] = {}
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
            if command.startswith(prefix):
                name = command[len(prefix) :].split(b"\0")[0].decode()
                found.setdefault(name, []).append(memory(proc.name)["rss_mib"])
        except OSError:  # gone meanwhile
            pass
    return found


def measure_ray(bundle: Path, bodies, seconds, concurrency, shards: int) -> dict:
    import ray
    from ray import serve

    from service.ray_serve import build_app

    ray.init(num_cpus=4 + shards, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        args = {"bundle_dir": str(bundle), "encoder_cpus": os.cpu_count(), "shard_cpus": 1, "verify": False}
        started = time.perf_counter()
        serve.run(build_app(args), name="xmcserve", route_prefix="/")
        deploy_s = time.perf_counter() - started
        result = load(f"http://127.0.0.1:{port}", bodies, seconds, concurrency)
        return {"deploy_seconds": round(deploy_s, 1), "replica_rss_mib": replica_rss_mib(), **result}
    finally:
        serve.shutdown()
        ray.shutdown()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("single", result["single"])] + [(f"ray {s} shard(s)", result["ray"][s]) for s in result["ray"]]
    busy = next(k for k in result["single"] if k.startswith("concurrency_"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [name for name, _ in runs]
    for field, marker in (("p50_ms", "o"), ("p99_ms", "s")):
        left.plot(names, [run["one_at_a_time"][field] for _, run in runs], marker=marker, label=field)
    left.set_ylabel("ms, one request at a time")
    left.legend()
    right.bar(names, [run[busy]["qps"] for _, run in runs])
    right.set_ylabel(f"QPS at {busy.replace('_', ' ')}")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"{result['labels']:,} labels, POST /predict k=10, {os.cpu_count()} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, "bench/results/ray-scale.json", bundle=None, seed=0)
    parser.add_argument("phase", choices=["build", "measure"], help="build the bundles, or measure them")
    parser.add_argument("--labels", type=int, default=1_000_000, help="synthetic labels in each bundle")
    parser.add_argument("--shards", default="1,2,4", help="shard counts, comma-separated (1: the unsharded bundle)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/xmcserve-ray-scale"), help="where bundles go")
    parser.add_argument("--encoder-bundle", type=Path, default=Path("bundles/default"), help="encoder + tokenizer from")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per load level")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop connections of the busy level")
    parser.add_argument("--queries", type=int, default=1000, help="synthetic queries for recall@10")
    args = parser.parse_args(argv)
    shard_counts = [int(s) for s in args.shards.split(",")]
    if 1 not in shard_counts:
        parser.error("--shards must include 1: the single server serves the unsharded bundle")
    if args.phase == "build":
        for shards in shard_counts:
            build(args.labels, shards, args.workdir, args.encoder_bundle, args.seed)
        return
    bodies = [json.dumps({"text": t, "k": 10}).encode() for t in load_jsonl_split(args.data, "dev").texts]
    logs = args.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from export.export_params import ExportParams

    result = {
        "labels": args.labels,
        "cpus": os.cpu_count(),
        "M": M,
        "ef_construction": EF_CONSTRUCTION,
        "build_threads": ExportParams().build_threads,  # shards built one after another, one thread each
    }
    bundles = {shards: bundle_path(args.workdir, args.labels, shards) for shards in shard_counts}
    result["index"] = {s: sharded_recall(b, args.labels, args.queries, args.seed) for s, b in bundles.items()}
    print(json.dumps(result["index"]), flush=True)
    result["ray_hop_ms"] = ray_hop_ms()
    print(json.dumps({"ray_hop_ms": result["ray_hop_ms"]}), flush=True)
    result["single"] = measure_single(bundles[1], bodies, args.seconds, args.concurrency, logs)
    print(json.dumps(result["single"]), flush=True)
    result["ray"] = {}
    for shards, bundle in bundles.items():
        result["ray"][shards] = measure_ray(bundle, bodies, args.seconds, args.concurrency, shards)
        print(json.dumps({shards: result["ray"][shards]}), flush=True)
    single_p50 = result["single"]["one_at_a_time"]["p50_ms"]
    result["ray_over_single_p50"] = {
        s: round(r["one_at_a_time"]["p50_ms"] / single_p50, 3) for s, r in result["ray"].items()
    }
    write_result(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({"ray_over_single_p50": result["ray_over_single_p50"]}), flush=True)


if __name__ == "__main__":
    main()
