"""hnswlib at the serving dimension (64) as the label count grows: build time, bytes per label,
single-query latency and recall@10 against exact search, for a few ef values.

    python -m bench.ann_scale [--sizes 42242,250000,1000000] [--out bench/results/ann-scale.json]

Label vectors are clustered, not uniform: cluster sizes are heavy-tailed (log-normal), centres
random on the sphere, members spread around their centre so that a label's nearest neighbours
have cosines of about 0.7–0.9, as the real 64-d Debian label vectors do. Queries are fresh draws
from the same mixture (near their relevant labels, never identical to one). The chosen ef is the
smallest tried whose recall@10 reaches the target.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.lib.args import bench_parser
from bench.lib.synthetic import DIM, clustered_vectors, draw, exact_top10
from bundle import HnswParams
from engine.offline import HnswIndex
from xmc.results import write_result


def measure(n: int, efs: list[int], queries_n: int, m: int, ef_construction: int, target: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    labels, (centres, weights, spread) = clustered_vectors(n, rng)
    queries = draw(centres, weights, queries_n, rng, spread)
    params = HnswParams(space="ip", M=m, ef_construction=ef_construction, ef_search=max(efs))
    start = time.perf_counter()
    built = HnswIndex.build(labels, params, seed=seed, threads=os.cpu_count())  # as export.build builds it
    build_s = time.perf_counter() - start
    index = built.index  # searched as hnswlib, ef set per row below
    with tempfile.TemporaryDirectory() as tmp:
        built.save(Path(tmp) / "index.hnsw")
        index_bytes = (Path(tmp) / "index.hnsw").stat().st_size
    truth = exact_top10(labels, queries)
    neighbour_cos = float(np.median(np.partition(queries[:200] @ labels.T, -10, axis=1)[:, -10:]))
    rows = {}
    for ef in efs:
        index.set_ef(ef)
        found, _ = index.knn_query(queries, k=10, num_threads=os.cpu_count())
        recall = float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)]))
        latencies = []
        for q in queries[:500]:
            t0 = time.perf_counter()
            index.knn_query(q[None, :], k=10, num_threads=1)
            latencies.append((time.perf_counter() - t0) * 1e3)
        rows[str(ef)] = {
            "recall_at_10": round(recall, 4),
            "p50_ms": round(float(np.median(latencies)), 4),
            "p99_ms": round(float(np.percentile(latencies, 99)), 4),
        }
    chosen = next((ef for ef in efs if rows[str(ef)]["recall_at_10"] >= target), efs[-1])
    return {
        "labels": n,
        "build_seconds": round(build_s, 1),
        "build_threads": os.cpu_count(),
        "index_bytes": index_bytes,
        "bytes_per_label": round(index_bytes / n, 1),
        "median_top10_neighbour_cosine": round(neighbour_cos, 3),
        "M": m,
        "ef_construction": ef_construction,
        "by_ef": rows,
        "chosen_ef": chosen,
        "recall_at_10": rows[str(chosen)]["recall_at_10"],
        "p50_ms": rows[str(chosen)]["p50_ms"],
    }


def main() -> None:
    parser = bench_parser(__doc__, "bench/results/ann-scale.json", bundle=None, data=None, seed=0)
    parser.add_argument("--sizes", default="42242,250000,1000000", help="comma list of label counts to index")
    parser.add_argument("--efs", default="50,100,200,300,500", help="comma list of ef_search values to try")
    parser.add_argument(
        "--queries", type=int, default=1000, help="queries per size (latency is timed on the first 500)"
    )
    parser.add_argument("--m", type=int, default=32, help="HNSW M (links per node)")
    parser.add_argument("--ef-construction", type=int, default=200, help="HNSW ef_construction")
    parser.add_argument("--target", type=float, default=0.99, help="recall@10 the chosen ef must reach")
    args = parser.parse_args()
    efs = [int(x) for x in args.efs.split(",")]
    result = {"dim": DIM, "space": "ip", "target_recall": args.target}
    for n in (int(x) for x in args.sizes.split(",")):
        result[str(n)] = measure(n, efs, args.queries, args.m, args.ef_construction, args.target, args.seed)
        print(json.dumps(result[str(n)]), flush=True)
        write_result(args.out, result)


if __name__ == "__main__":
    main()
