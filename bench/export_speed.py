"""Export speed: texts/s of the memory encoding on each device present, and HNSW build seconds.

    python -m bench.export_speed [--texts 4000] [--out bench/results/export-speed.json]

The pretrained MiniLM encodes the first ``--texts`` training titles and label texts of the
sample: through the fused ONNX graph on every CPU core (what export uses without a GPU), through
torch on the CPU (for comparison), and through torch on CUDA with fp16 autocast when a GPU is
present. Then the HNSW index over their 64-d PCA vectors is built with one thread (reproducible
bundle ids, the default) and with every core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import hnswlib
import numpy as np
import torch

from export.export_params import ExportParams
from export.pooled_vectors import encode_pooled, torch_pooled
from export.serving_graph import load_encoder, load_fast_tokenizer
from xmc.checkpoint import default_encoder_dir, fit_pca_head
from xmc.data import load_jsonl_split
from xmc.results import write_result


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def hnsw_build_seconds(keys: np.ndarray, threads: int) -> float:
    index = hnswlib.Index(space="ip", dim=keys.shape[1])
    index.init_index(max_elements=len(keys), ef_construction=200, M=32, random_seed=0)
    _, seconds = timed(lambda: index.add_items(keys, np.arange(len(keys)), num_threads=threads))
    return round(seconds, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/debian-sample"), help="XMC data directory")
    parser.add_argument("--texts", type=int, default=4000, help="texts to encode per device")
    parser.add_argument("--out", type=Path, default=Path("bench/results/export-speed.json"), help="JSON result")
    args = parser.parse_args()
    train = load_jsonl_split(args.data, "trn")
    texts = (train.texts + train.labels.texts)[: args.texts]
    encoder_dir = default_encoder_dir()
    encoder, tokenizer = load_encoder(encoder_dir), load_fast_tokenizer(encoder_dir, 128)
    rows = {}
    pooled, report = encode_pooled(encoder, tokenizer, texts, ExportParams(encode_device="cpu"))
    rows["onnx_cpu"] = report.as_dict()["encode_texts_per_s"]
    _, seconds = timed(lambda: torch_pooled(encoder, tokenizer, texts, "cpu", 128))
    rows["torch_cpu"] = round(len(texts) / seconds, 1)
    if torch.cuda.is_available():
        _, cuda_report = encode_pooled(encoder, tokenizer, texts, ExportParams(encode_device="cuda"))
        rows["torch_cuda_fp16"] = cuda_report.as_dict()["encode_texts_per_s"]
        rows["cuda_parity_max_abs_diff"] = cuda_report.parity_max_abs_diff
    keys = fit_pca_head(pooled, 64, True).query_vectors(pooled).astype(np.float32)
    result = {
        "texts": len(texts),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "encode_texts_per_s": rows,
        "hnsw_build_seconds": {"threads_1": hnsw_build_seconds(keys, 1), "threads_all": hnsw_build_seconds(keys, -1)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
