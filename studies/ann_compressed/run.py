"""Compressed key indexes against hnswlib at the serving dimension, on the same vectors, in one
run: bytes per label, build seconds, recall@10 against exact search, and the search p50/p99 of
one query and of a batch of 32.

    python -m studies.ann_compressed [--synthetic 1000000] [--real-bundle /work/main/bundles/minilm-rae-64d-fp32]
        [--methods hnswlib,ivfpq-fp16,...] [--out bench/results/ann-compressed.json]

Recall@10 counts ties: a returned key is correct when its exact similarity reaches the 10th
exact similarity (the real memory holds instances whose text is a label's: identical keys, either
of which exact search returns); the plain overlap with exact search's ids is reported beside it.

Vector sets: the clustered synthetic set of ``bench.ann_scale`` (same generator and seed, so its
10^6 set is the one ann-scale.json measured hnswlib on) with queries drawn from the same mixture;
and the keys of a real bundle (read from its HNSW file: instance and label keys), queried with
its dev split's texts encoded by its own encoder. Exact top-10: faiss brute force (IndexFlatIP).

Methods (each a build and a list of search settings, swept from cheap to costly; the chosen one
is the first whose recall@10 reaches ``--target``):

* ``hnswlib``: the service's default, M 32, ef_construction 200; settings: ef.
* ``ivfpq-fp16``: the service's ``--index ivfpq`` (engine/index/ivfpq.py): faiss IVF, 4-bit PQ
  fast-scan codes (pq_m 32: 16 bytes a key), the best ``depth`` candidates by code re-ranked
  exactly from float16 vectors; settings: (nprobe, depth).
* ``ivfpq64-fp16``: the same with pq_m 64 (one 4-bit sub-quantizer a dimension, 32 bytes a key),
  ``export.build``'s default since the 10^7 run: finer codes order the candidates better.
* ``ivfpq-sq8``: the same index, re-ranked from 8-bit scalar codes (faiss SQ8, decoded per query).
* ``hnsw-sq8-fp16`` / ``hnsw-pq-fp16``: faiss HNSW (M 16) over 8-bit scalar codes / 8-bit PQ
  codes (pq_m 32), the candidates re-ranked from float16 vectors; settings: (efSearch, depth).
* ``usearch-int8`` and ``usearch-int8-fp16``: usearch's HNSW over int8 vectors (connectivity 16),
  alone and re-ranked from float16 vectors; settings: expansion_search (and depth). The HNSW
  methods' settings start at depth 10 (the codes' own top 10), so ``usearch-int8-fp16`` reports
  what int8 alone recalls too, and the default run leaves ``usearch-int8`` and ``hnsw-pq-fp16`` out.

Latency is the search alone (no encoder, no HTTP), on one thread each, every method in this one
process: one query at a time over the first ``--single`` queries, and batches of 32 over all of them.
Builds use ``--build-threads`` threads. Bytes per label: the files the method would ship (index,
codes, re-rank vectors) over the number of keys.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import hnswlib
import numpy as np

from bench.lib.synthetic import clustered_vectors, draw
from bundle import IvfPqParams
from engine.offline import HnswIndex, IvfPqIndex, auto_nlist, exact_rerank, faiss_threads, recall_with_ties
from export.export_params import ExportParams

K = 10
BATCH = 32
PQ_M = 32


@dataclass
class Built:
    """A built method: its files' bytes, build seconds, and ``search(queries, setting) -> ids``."""

    bytes: int
    build_s: float
    search: Callable[[np.ndarray, tuple], np.ndarray]
    settings: list[tuple]
    notes: dict = field(default_factory=dict)


def file_bytes(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths)


def save_fp16(keys: np.ndarray, path: Path) -> np.ndarray:
    np.save(path, keys.astype(np.float16))
    return np.load(path, mmap_mode="r")


def reranked(candidates_of: Callable, stored_of: Callable) -> Callable:
    """``search`` from a candidate search: its candidates re-ranked exactly (engine/index/ivfpq.py)."""

    def search(queries: np.ndarray, setting: tuple) -> np.ndarray:
        *knobs, depth = setting
        candidates = candidates_of(queries, tuple(knobs), depth)
        return exact_rerank(stored_of, queries, candidates, K)[0]

    return search


def build_hnswlib(keys: np.ndarray, work: Path, threads_: int) -> Built:
    started = time.perf_counter()
    built = HnswIndex.build(keys, ExportParams().hnsw(), seed=0, threads=threads_)  # the service's graph, M 32
    build_s = time.perf_counter() - started
    built.save(work / "index.hnsw")
    index = built.index  # searched as hnswlib, its ef set per setting

    def search(queries, setting):
        index.set_ef(setting[0])
        return index.knn_query(queries, k=K, num_threads=1)[0].astype(np.int64)

    return Built(file_bytes(work / "index.hnsw"), build_s, search, [(ef,) for ef in (50, 100, 200, 300, 500)])


IVF_SETTINGS = [(16, 100), (32, 300), (64, 300), (128, 300), (128, 1000), (256, 300), (256, 1000), (512, 1000)]


def build_ivfpq_method(keys: np.ndarray, work: Path, threads_: int, rerank: str, pq_m: int = PQ_M) -> Built:
    nlist = auto_nlist(len(keys))
    params = IvfPqParams(nlist=nlist, pq_m=pq_m, nprobe=1, rerank_depth=100)
    started = time.perf_counter()
    built = IvfPqIndex.build(keys, params, 0, 0, threads_)
    built.save(work / "index.faiss", work / "rerank.npy")
    phases = built.build_seconds
    files = [work / "index.faiss", work / "rerank.npy"]
    if rerank == "sq8":
        sq = faiss.ScalarQuantizer(keys.shape[1], faiss.ScalarQuantizer.QT_8bit)
        sq.train(keys)
        codes = sq.compute_codes(keys)
        np.save(work / "rerank-sq8.npy", codes)
        files = [work / "index.faiss", work / "rerank-sq8.npy"]

        def stored_of(local):
            return sq.decode(codes[local.ravel()]).reshape(*local.shape, keys.shape[1])

    build_s = time.perf_counter() - started
    index = IvfPqIndex.load(work / "index.faiss", work / "rerank.npy", keys.shape[1], params, 0, len(keys))

    if rerank == "fp16":

        def search(queries, setting):
            index.nprobe, depth = setting
            return index.search(queries, K, depth, threads=1)[0]
    else:

        def candidates_of(queries, knobs, depth):
            with faiss_threads(1):
                return index.index.search(queries, depth, params=faiss.SearchParametersIVF(nprobe=knobs[0]))[1]

        search = reranked(candidates_of, stored_of)
    return Built(file_bytes(*files), build_s, search, IVF_SETTINGS, {"nlist": nlist, "pq_m": pq_m, **phases})


# depth 10: the codes' own ranking, re-ranked within the top 10 only (what the codes alone recall)
HNSW_SETTINGS = [(64, 10), (256, 10), *((ef, depth) for ef in (64, 128, 256) for depth in (100, 300))]


def build_faiss_hnsw(keys: np.ndarray, work: Path, threads_: int, codes: str) -> Built:
    factory = {"sq8": "HNSW16_SQ8", "pq": f"HNSW16_PQ{PQ_M}"}[codes]
    index = faiss.index_factory(keys.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    started = time.perf_counter()
    with faiss_threads(threads_):
        index.train(keys[np.random.default_rng(0).choice(len(keys), min(len(keys), 100_000), replace=False)])
        index.add(keys)
    build_s = time.perf_counter() - started
    faiss.write_index(index, str(work / "index.faiss"))
    stored = save_fp16(keys, work / "rerank.npy")

    def candidates_of(queries, knobs, depth):
        with faiss_threads(1):
            return index.search(queries, depth, params=faiss.SearchParametersHNSW(efSearch=max(knobs[0], depth)))[1]

    search = reranked(candidates_of, lambda local: stored[local.ravel()].reshape(*local.shape, keys.shape[1]))
    files = file_bytes(work / "index.faiss", work / "rerank.npy")
    return Built(files, build_s, search, HNSW_SETTINGS, {"factory": factory})


def build_usearch(keys: np.ndarray, work: Path, threads_: int, rerank: bool) -> Built:
    from usearch.index import Index

    index = Index(ndim=keys.shape[1], metric="ip", dtype="i8", connectivity=16)
    started = time.perf_counter()
    index.add(np.arange(len(keys)), keys, threads=threads_)
    build_s = time.perf_counter() - started
    index.save(str(work / "index.usearch"))
    files = [work / "index.usearch"]
    if not rerank:

        def search(queries, setting):
            index.expansion_search = setting[0]
            return np.asarray(index.search(queries, K, threads=1).keys, dtype=np.int64).reshape(len(queries), K)

        return Built(file_bytes(*files), build_s, search, [(ef,) for ef in (64, 128, 256, 512)])
    stored = save_fp16(keys, work / "rerank.npy")

    def candidates_of(queries, knobs, depth):
        index.expansion_search = max(knobs[0], depth)
        return np.asarray(index.search(queries, depth, threads=1).keys, dtype=np.int64).reshape(len(queries), depth)

    search = reranked(candidates_of, lambda local: stored[local.ravel()].reshape(*local.shape, keys.shape[1]))
    return Built(file_bytes(*files, work / "rerank.npy"), build_s, search, HNSW_SETTINGS)


METHODS = {  # hnswlib last: at 10^6 keys its build takes the longest, so the others report first
    "ivfpq-fp16": lambda keys, work, t: build_ivfpq_method(keys, work, t, "fp16"),
    "ivfpq64-fp16": lambda keys, work, t: build_ivfpq_method(keys, work, t, "fp16", pq_m=64),
    "ivfpq-sq8": lambda keys, work, t: build_ivfpq_method(keys, work, t, "sq8"),
    "hnsw-sq8-fp16": lambda keys, work, t: build_faiss_hnsw(keys, work, t, "sq8"),
    "hnsw-pq-fp16": lambda keys, work, t: build_faiss_hnsw(keys, work, t, "pq"),
    "usearch-int8": lambda keys, work, t: build_usearch(keys, work, t, False),
    "usearch-int8-fp16": lambda keys, work, t: build_usearch(keys, work, t, True),
    "hnswlib": build_hnswlib,
}


DEFAULT_METHODS = ["ivfpq-fp16", "ivfpq-sq8", "hnsw-sq8-fp16", "usearch-int8-fp16", "hnswlib"]


@dataclass
class Truth:
    """Exact search's top 10 of each query (faiss brute force) and what recall needs of it."""

    ids: np.ndarray
    kth_sims: np.ndarray
    keys: np.ndarray
    queries: np.ndarray


def exact_top(keys: np.ndarray, queries: np.ndarray) -> Truth:
    flat = faiss.IndexFlatIP(keys.shape[1])
    flat.add(keys)
    sims, ids = flat.search(queries, K)
    return Truth(ids, sims[:, -1], keys, queries)


def recall(found: np.ndarray, truth: Truth) -> dict:
    """Recall@10 counting ties (engine.offline.recall_with_ties: a key whose exact similarity reaches
    the 10th is correct, since exact search returns either of two identical keys) and the plain
    overlap of ids with exact search's own top 10."""
    ids = np.mean([len(set(f.tolist()) & set(t.tolist())) / K for f, t in zip(found, truth.ids, strict=True)])
    return {
        "recall_at_10": round(recall_with_ties(found, truth.queries, truth.keys, truth.kth_sims), 4),
        "recall_at_10_ids": round(float(ids), 4),
    }


def percentiles(seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def measure_setting(built: Built, setting: tuple, queries: np.ndarray, truth: Truth, single: int) -> dict:
    found, batch_s = [], []
    for start in range(0, len(queries), BATCH):
        t0 = time.perf_counter()
        found.append(built.search(queries[start : start + BATCH], setting))
        batch_s.append(time.perf_counter() - t0)
    single_s = []
    for q in queries[:single]:
        t0 = time.perf_counter()
        built.search(q[None, :], setting)
        single_s.append(time.perf_counter() - t0)
    one, batch = percentiles(single_s), percentiles(batch_s)
    return {
        **recall(np.concatenate(found), truth),
        "single_p50_ms": one["p50_ms"],
        "single_p99_ms": one["p99_ms"],
        "batch32_p50_ms": batch["p50_ms"],
        "batch32_p99_ms": batch["p99_ms"],
    }


def measure_method(name: str, keys, queries, truth, threads_: int, single: int, target: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        built = METHODS[name](keys, Path(tmp), threads_)
        rows = {}
        chosen = None
        for setting in built.settings:
            rows[",".join(map(str, setting))] = row = measure_setting(built, setting, queries, truth, single)
            print(name, setting, row, flush=True)
            if row["recall_at_10"] >= target:
                chosen = setting
                break
        chosen = chosen or built.settings[-1]
        return {
            "bytes_per_label": round(built.bytes / len(keys), 1),
            "build_s": round(built.build_s, 1),
            "settings": rows,
            "chosen": ",".join(map(str, chosen)),
            "reaches_target": rows[",".join(map(str, chosen))]["recall_at_10"] >= target,
            **rows[",".join(map(str, chosen))],
            **built.notes,
        }


def synthetic_set(n: int, queries: int) -> tuple[np.ndarray, np.ndarray, dict]:
    rng = np.random.default_rng(0)  # bench.ann_scale's seed: its 10^6 set
    keys, (centres, weights, spread) = clustered_vectors(n, rng)
    return keys, draw(centres, weights, queries, rng, spread), {"kind": "synthetic, bench.ann_scale's generator"}


def real_set(bundle: Path, data: Path, queries: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """A bundle's keys (from its HNSW file) and its data's dev texts encoded by its encoder."""
    from bundle import read_manifest
    from engine.offline import load_encoder

    manifest = read_manifest(bundle)
    index = hnswlib.Index(space="ip", dim=manifest.dim)
    index.load_index(str(bundle / "index.hnsw"))
    keys = np.asarray(index.get_items(np.arange(index.get_current_count())), dtype=np.float32)
    with gzip.open(data / "dev.json.gz", "rt", encoding="utf-8") as fh:
        texts = [json.loads(line)["title"] for _, line in zip(range(queries), fh, strict=False)]
    _, encoder = load_encoder(bundle)
    vectors = np.concatenate([encoder.encode(texts[i : i + 64])[0] for i in range(0, len(texts), 64)])
    return keys, vectors, {"kind": "real", "bundle": str(bundle), "bundle_id": manifest.bundle_id, "data": str(data)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", type=int, default=1_000_000, help="synthetic keys (0: skip the set)")
    parser.add_argument(
        "--real-bundle", type=Path, default=None, help="a bundle whose keys (its index.hnsw) make the real set"
    )
    parser.add_argument("--real-data", type=Path, default=None, help="the real bundle's data dir (its dev split)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--queries", type=int, default=2000, help="queries per set (recall and batches of 32)")
    parser.add_argument("--single", type=int, default=500, help="queries timed one at a time")
    parser.add_argument("--build-threads", type=int, default=2, help="threads every method builds with")
    parser.add_argument("--target", type=float, default=0.99, help="recall@10 a method's chosen setting must reach")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ann-compressed.json"), help="result JSON")
    args = parser.parse_args()
    from xmc.results import machine, write_result

    sets = {}  # the real set first: it is small, every method's row comes in minutes
    if args.real_bundle:
        sets[f"real-{args.real_bundle.name}"] = lambda: real_set(args.real_bundle, args.real_data, args.queries)
    if args.synthetic:
        sets[f"synthetic-{args.synthetic}"] = lambda: synthetic_set(args.synthetic, args.queries)
    result = {
        "machine": machine(),
        "dim": 64,
        "k": K,
        "target_recall": args.target,
        "build_threads": args.build_threads,
        "search_threads": 1,
        "sets": {},
    }
    for set_name, make in sets.items():
        keys, queries, about = make()
        truth = exact_top(keys, queries)
        entry = result["sets"][set_name] = {**about, "keys": len(keys), "queries": len(queries), "methods": {}}
        for name in args.methods.split(","):
            entry["methods"][name] = measure_method(
                name, keys, queries, truth, args.build_threads, args.single, args.target
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
