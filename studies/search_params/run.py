"""What the RAE search breadth costs and buys: dev metrics, key recall and search time against
HNSW ``ef`` and the number of retrieved keys ``b`` (top_b).

    python -m studies.search_params [--bundle bundles/default] [--efs 50,100,200,300] [--top-bs 50,100,200]

Each ``b`` is a derived bundle (same encoder and index, other RAE parameters); the dev texts are
encoded once. Per (b, ef): the four headline metrics under both filter protocols, recall@10 of
the retrieved keys against exact search over all keys, and the HNSW + aggregation milliseconds
per query of the whole split (one batched call per 64 queries, as the service batches).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from engine import Predictor
from engine.offline import key_recall_at_10, load_bundle
from export.derive import derive_rae_bundle
from export.evaluate import evaluate_bundle
from xmc.data import load_jsonl_split
from xmc.metrics import HEADLINE
from xmc.results import write_result


def search_ms_per_query(predictor: Predictor, vectors: np.ndarray, ef: int) -> float:
    started = time.perf_counter()
    for start in range(0, len(vectors), 64):
        predictor.search(vectors[start : start + 64], 10, ef)
    return 1000 * (time.perf_counter() - started) / len(vectors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("bundles/default"), help="an rae_memory bundle")
    parser.add_argument("--data", type=Path, default=Path("data/debian-sample"), help="XMC data with trn and dev")
    parser.add_argument("--efs", default="50,100,200,300", help="HNSW ef values")
    parser.add_argument("--top-bs", default="50,100,200", help="retrieved keys b")
    parser.add_argument("--out", type=Path, default=Path("bench/results/search-params.json"), help="JSON result")
    args = parser.parse_args()
    dev = load_jsonl_split(args.data, "dev")
    train = load_jsonl_split(args.data, "trn", labels=dev.labels)
    source = load_bundle(args.bundle)
    vectors = np.concatenate([source.encoder.encode(dev.texts[i : i + 256])[0] for i in range(0, len(dev), 256)])
    memory_Y = train.Y[: source.manifest.counts.train_instances]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for top_b in (int(b) for b in args.top_bs.split(",")):
            derived = Path(workdir) / f"b{top_b}"
            derive_rae_bundle(args.bundle, derived, memory_Y, top_b=top_b)
            bundle = load_bundle(derived)
            predictor = Predictor(bundle)
            for ef in (int(e) for e in args.efs.split(",")):
                result = evaluate_bundle(bundle, dev, train, k=100, ef=ef, vectors=vectors)
                rows.append(
                    {
                        "top_b": top_b,
                        "ef": ef,
                        **{m: result["metrics"][m] for m in HEADLINE},
                        "exclude_before": {m: result["metrics_exclude_before"][m] for m in HEADLINE},
                        "key_recall_at_10": round(key_recall_at_10(predictor, vectors, ef), 4),
                        "search_ms_per_query": round(search_ms_per_query(predictor, vectors, ef), 3),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    result = {"bundle": source.bundle_id, "data": str(args.data), "instances": len(dev), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
