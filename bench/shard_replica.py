"""One shard of a 10^8-label deployment on this machine: 6.25 M labels (10^8 / 16) with the
compressed index, built, loaded as a Ray shard replica loads it (``load_shard``), and searched.

    python -m bench.shard_replica [--labels 6250000] [--encoder-bundle bundles/default]
        [--settings 128:300,256:300,...] [--work /tmp/xmcserve-shard-replica]
        [--out bench/results/shard-replica.json]

The label vectors are bench.ann_scale's clustered 64-d mixture (no encoding: a shard replica
never runs the encoder, and 6.25 M texts would take the encoder hours here); the bundle borrows
the encoder and tokenizer of ``--encoder-bundle`` so that it is a complete, verifiable bundle.
Measured: build seconds (IVF-PQ training and filling, label arrays), bytes a label, load seconds
with checksums and body checks, the loading process's resident memory, and the shard search
(``ShardSearcher.search``, one thread, the neighbours a label index fetches for k 10 at the
bundle's ef) one query at a time and in batches of 32, with recall@10 against brute force, at
each (cells scanned, candidates re-ranked) of ``--settings``; the first reaching recall@10 0.99 is
the one a deployment would set (``export.reindex.retune_bundle``) and is reported as the replica's.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import numpy as np

from bench.lib.args import bench_parser, breadth_settings, first_reaching
from bench.lib.latency import p50_p99_ms
from bench.lib.profiling import memory
from bench.lib.synthetic import draw
from bench.lib.synthetic_bundle import build_synthetic_bundle
from engine.offline import recall_with_ties
from xmc.results import machine, write_result

BATCH = 32
TARGET_RECALL = 0.99


def main() -> None:
    parser = bench_parser(__doc__, "bench/results/shard-replica.json", bundle=None, data=None, seed=0)
    parser.add_argument("--labels", type=int, default=6_250_000, help="labels of the shard (10^8 / 16)")
    parser.add_argument("--encoder-bundle", type=Path, default=Path("bundles/default"), help="encoder and tokenizer")
    parser.add_argument("--queries", type=int, default=2000, help="queries (recall, batches of 32)")
    parser.add_argument("--single", type=int, default=1000, help="queries timed one at a time")
    parser.add_argument("--build-threads", type=int, default=0, help="index build threads (0: every core)")
    parser.add_argument(
        "--settings",
        default="128:300,256:300,256:1000,512:1000",
        help="nprobe:ef pairs (cells scanned, candidates re-ranked) searched, cheap to costly; the first whose "
        "recall@10 reaches 0.99 is reported as the replica's",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/xmcserve-shard-replica"), help="scratch directory")
    args = parser.parse_args()
    import faiss

    from engine.offline import fetch_and_ef, load_shard

    settings = breadth_settings(args.settings)
    bundle = args.work / "shard"
    build_report, vectors, (centres, weights, spread) = build_synthetic_bundle(
        args.labels, bundle, args.encoder_bundle, args.seed, args.build_threads
    )
    queries = draw(centres, weights, args.queries, np.random.default_rng(args.seed + 1), spread)
    del vectors
    # what the replica process holds: measured in a fresh child, so the build's arrays do not count
    read, write = os.pipe()
    if (pid := os.fork()) == 0:
        os.close(read)
        started = time.perf_counter()
        manifest, searcher = load_shard(bundle, 0, verify=True, search_threads=1)
        loaded = {"load_s": round(time.perf_counter() - started, 1), **memory("self", "gib", 3)}
        sweep = {}
        for nprobe, setting_ef in settings:
            fetch, ef = fetch_and_ef(10, setting_ef, manifest.counts.memory_rows)
            searcher.index.nprobe = nprobe
            found, batch_s = [], []
            for start in range(0, len(queries), BATCH):
                t0 = time.perf_counter()
                found.append(searcher.search(queries[start : start + BATCH], fetch, ef).keys[:, :10])
                batch_s.append(time.perf_counter() - t0)
            single_s = []
            for q in queries[: args.single]:
                t0 = time.perf_counter()
                searcher.search(q[None, :], fetch, ef)
                single_s.append(time.perf_counter() - t0)
            sweep[f"{nprobe},{setting_ef}"] = {
                "found": np.concatenate(found).tolist(),
                "nprobe": nprobe,
                "fetch": fetch,
                "ef": ef,
                "single": p50_p99_ms(single_s, 3),
                "batch32": p50_p99_ms(batch_s, 3),
            }
        report = {**loaded, "after_search": memory("self", "gib", 3), "sweep": sweep}
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        replica = json.loads(fh.read())
    os.waitpid(pid, 0)
    # exact search over the stored keys the replica re-ranks by (engine.offline.recall_with_ties: ties count)
    stored = np.load(bundle / "rerank.npy", mmap_mode="r")
    flat = faiss.IndexFlatIP(stored.shape[1])
    for start in range(0, len(stored), 1 << 20):
        flat.add(np.asarray(stored[start : start + (1 << 20)], dtype=np.float32))
    sims, _ = flat.search(queries, 10)
    del flat
    for row in replica["sweep"].values():
        found = np.array(row.pop("found"), dtype=np.int64)
        row["recall_at_10"] = round(recall_with_ties(found, queries, stored, sims[:, -1]), 4)
    chosen = first_reaching({name: row["recall_at_10"] for name, row in replica["sweep"].items()}, TARGET_RECALL)
    replica |= {"chosen": chosen, **replica["sweep"][chosen]}
    manifest = json.loads((bundle / "manifest.json").read_text())
    index_bytes = sum((bundle / name).stat().st_size for name in ("index.faiss", "rerank.npy"))
    result = {
        "machine": machine(),
        "labels": args.labels,
        "ivfpq": manifest["ivfpq"],
        "ef_search": manifest["ivfpq"]["rerank_depth"],
        "build": build_report,
        "build_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "index_bytes_per_label": round(index_bytes / args.labels, 1),
        "bundle_bytes": sum(f.stat().st_size for f in bundle.iterdir()),
        "replica": replica,
    }
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
