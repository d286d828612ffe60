"""What would a label index add to an RAE memory's candidates? An analysis on dev queries.

    python -m studies.label_keys --bundle <rae memory bundle> [--data ../shared/data/debian-related]
                               [--queries 2000] [--depths 50 100 200] [--out bench/results/label-keys.json]

The memory's candidates are the labels its top-b keys carry: instance keys their labels, label
keys their own. A label index as a source of its own would add each query's top-d label keys,
however many instance keys came first. Per query, on the first ``--queries`` dev texts:

* how many of the top-b keys are label keys, and the share of relevant labels among the
  memory's candidates;
* the share among the label keys of wider fetches of the same index (``b + extra`` nearest keys,
  what a source could take from one deeper search, and the search time each costs);
* the share among the exact top-d label keys (every label key scored), and among the memory's
  candidates joined by them: the most a label index of depth d could add.

Dev is read here for an analysis, never to choose a bundle's parameters.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from engine import load_predictor
from xmc.data import load_jsonl_split
from xmc.results import write_result

FETCH_EXTRA = (0, 100, 200, 400)


def relevant_share(found: list[set[int]], targets: list[set[int]]) -> float:
    hit = sum(len(t & f) for t, f in zip(targets, found, strict=True))
    return round(100 * hit / max(1, sum(len(t) for t in targets)), 2)


def analyse(bundle: Path, data: Path, queries: int, depths: list[int]) -> dict:
    predictor = load_predictor(bundle)
    manifest = predictor.bundle.manifest
    if manifest.index_kind != "rae_memory":
        raise ValueError(f"{bundle} is not an RAE memory")
    dev = load_jsonl_split(data, "dev")
    n = min(queries, len(dev))
    targets = [set(dev.Y.indices[dev.Y.indptr[i] : dev.Y.indptr[i + 1]].tolist()) for i in range(n)]
    vectors = np.concatenate([predictor.encode(dev.texts[i : min(i + 64, n)])[0] for i in range(0, n, 64)])
    view = predictor.view
    b = manifest.rae.top_b
    out: dict = {"queries": n, "top_b": b}

    keys, _, _ = predictor.knn(vectors, b, None, view)
    labels_of_keys = view.labels_of_keys(keys)
    carried, counts = view.values.row_labels(np.where(keys >= 0, keys, 0).reshape(-1))
    per_query = counts.reshape(keys.shape).sum(axis=1)
    memory_candidates, start = [], 0
    for count in per_query:
        memory_candidates.append(set(carried[start : start + count].tolist()))
        start += count
    label_keys = (labels_of_keys >= 0).sum(axis=1)
    out["label_keys_in_top_b"] = {
        "mean": round(float(label_keys.mean()), 1),
        "p10": int(np.percentile(label_keys, 10)),
        "min": int(label_keys.min()),
    }
    out["memory_candidates"] = {
        "relevant_share": relevant_share(memory_candidates, targets),
        "mean_count": round(float(np.mean([len(c) for c in memory_candidates])), 1),
    }

    fetched = {}
    for extra in FETCH_EXTRA:
        t0 = time.perf_counter()
        wide, _, ran_at = predictor.knn(vectors, b + extra, None, view)
        ms = (time.perf_counter() - t0) / n * 1000
        wide_labels = view.labels_of_keys(wide)
        row = {"ef": ran_at, "search_ms_per_query": round(ms, 3)}
        for depth in depths:
            found = [set(r[r >= 0][:depth].tolist()) for r in wide_labels]
            row[f"label_keys_top{depth}_relevant_share"] = relevant_share(found, targets)
        fetched[f"b+{extra}"] = row
    out["label_keys_of_a_wider_fetch"] = fetched

    num_train = view.num_keys - view.num_labels
    label_vectors = predictor.memory.index.vectors(np.arange(num_train, view.num_keys))
    similarities = vectors @ label_vectors.T
    exact = {}
    for depth in depths:
        top = np.argpartition(-similarities, depth - 1, axis=1)[:, :depth]
        found = [set(row.tolist()) for row in top]
        exact[f"top{depth}"] = {
            "relevant_share": relevant_share(found, targets),
            "memory_candidates_joined_relevant_share": relevant_share(
                [c | f for c, f in zip(memory_candidates, found, strict=True)], targets
            ),
        }
    out["exact_label_keys"] = exact
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="an RAE memory bundle")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/debian-related"), help="dataset dir")
    parser.add_argument("--queries", type=int, default=2000, help="dev texts analysed (the first ones)")
    parser.add_argument("--depths", type=int, nargs="+", default=[50, 100, 200], help="label index depths")
    parser.add_argument("--out", type=Path, default=Path("bench/results/label-keys.json"), help="result JSON")
    args = parser.parse_args(argv)
    started = time.time()
    result = {
        "benchmark": "studies.label_keys",
        "bundle": str(args.bundle),
        "data": str(args.data),
        "machine": platform.processor() or platform.machine(),
        **analyse(args.bundle, args.data, args.queries, args.depths),
        "seconds": round(time.time() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
