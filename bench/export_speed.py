"""Export speed: texts/s of the memory encoding on each device present, and HNSW build seconds.

    python -m bench.export_speed [--texts 4000] [--out bench/results/export-speed.json]

The pretrained MiniLM encodes the first ``--texts`` training titles and label texts of the
sample: through the fused ONNX graph on every CPU core (what export uses without a GPU), through
torch on the CPU (for comparison), and through torch on CUDA with fp16 autocast when a GPU is
present. Then the HNSW index over their 64-d PCA vectors is built with one thread (reproducible
bundle ids, the default) and with every core.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from bench.lib.args import bench_parser
from engine.offline import HnswIndex
from export.export_params import ExportParams
from export.pooled_vectors import encode_pooled, torch_pooled
from export.serving_graph import load_encoder, load_fast_tokenizer
from xmc.checkpoint import default_encoder_dir, fit_pca_head
from xmc.data import load_jsonl_split
from xmc.results import machine, write_result


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def hnsw_build_seconds(keys: np.ndarray, threads: int) -> float:
    """Seconds export.build's HNSW graph (its default parameters) takes over ``keys``."""
    _, seconds = timed(lambda: HnswIndex.build(keys, ExportParams().hnsw(), seed=0, threads=threads))
    return round(seconds, 2)


def main() -> None:
    parser = bench_parser(__doc__, "bench/results/export-speed.json", bundle=None)
    parser.add_argument("--texts", type=int, default=4000, help="texts to encode per device")
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
        "machine": machine(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "encode_texts_per_s": rows,
        "hnsw_build_seconds": {"threads_1": hnsw_build_seconds(keys, 1), "threads_all": hnsw_build_seconds(keys, -1)},
    }
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
