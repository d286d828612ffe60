"""Which int8 encoder keeps a query's vector independent of its batch, at what speed and quality.

    python -m studies.int8_methods --bundle bundles/minilm-rae-64d-fp32 \
        [--data ../shared/data/debian-related] [--out bench/results/int8-methods.json]

``--bundle`` is a float32 bundle (``export.build --quantize none``); its served graph is
quantized here in each way, and each variant is measured on the same bundle, in one run:

- ``fp32``: the float graph;
- ``int8 dynamic``: dynamic int8 (``quantize_dynamic``), the default bundle's encoder before:
  its activation scales are computed per call from the whole batch tensor;
- ``int8 static``: per-channel int8 MatMul weights with activation scales fitted once on
  training texts (``quantize_static``, QDQ, MinMax);

each run **batched** as the server batched before (length-sorted chunks of up to 64 texts per
session call) and **one text per call** (what the CPU server does now). For each: the largest
difference between a text's vector alone and inside random batches of 1 to 64 dev texts of mixed
lengths; encoder texts/s in the server's thread layout (two workers, one intra-op thread each, on
2 cores) at batches of 1, 8 and 32; and, for the one-text-per-call variants and the old default,
the dev metrics of the bundle with that encoder (both filter protocols).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from bench.lib.encoder_alone import encoder_alone
from bundle import ENCODER_FILE, TOKENIZER_FILE
from engine import EncoderOptions, Predictor
from engine.offline import MAX_CHUNK, OnnxEncoder, load_bundle
from export.onnx_export import quantize_int8, quantize_int8_static
from xmc.data import load_jsonl_split
from xmc.evaluate import evaluate_predictor
from xmc.results import machine, write_result

HEADLINE = ("P@1", "P@3", "P@5", "PSP@5", "R@100")


def batch_invariance(encoder: OnnxEncoder, texts: list[str], trials: int, seed: int = 0) -> float:
    """Largest |vector alone − vector in a batch| over ``trials`` random batches of 1–64 texts."""
    rng = np.random.default_rng(seed)
    alone = {}
    worst = 0.0
    for _ in range(trials):
        size = int(rng.integers(1, 65))
        batch = [texts[i] for i in rng.choice(len(texts), size, replace=False)]
        vectors, _ = encoder.encode(batch)
        for text, vector in zip(batch, vectors, strict=True):
            if text not in alone:
                alone[text] = encoder.encode([text])[0][0]
            worst = max(worst, float(np.abs(alone[text] - vector).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="a float32 bundle (export.build --quantize none)")
    parser.add_argument(
        "--data", type=Path, default=Path("../shared/data/debian-related"), help="dataset: dev queries, trn texts"
    )
    parser.add_argument("--calibration-texts", type=int, default=512, help="training texts the static scales fit on")
    parser.add_argument("--trials", type=int, default=60, help="random batches of the invariance check")
    parser.add_argument("--seconds", type=float, default=6.0, help="encoder timing per batch size")
    parser.add_argument("--out", type=Path, default=Path("bench/results/int8-methods.json"), help="result JSON")
    args = parser.parse_args()

    bundle = load_bundle(args.bundle)
    if bundle.manifest.params.get("quantize", "none") != "none":
        parser.error(f"{args.bundle} is not a float32 bundle")
    dev = load_jsonl_split(args.data, "dev")
    train = load_jsonl_split(args.data, "trn")
    calibration = [train.texts[i] for i in np.random.default_rng(1).choice(len(train), args.calibration_texts)]
    max_length = bundle.manifest.tokenizer.max_length
    work = Path(tempfile.mkdtemp(prefix="int8-methods-"))
    float_graph = args.bundle / ENCODER_FILE
    started = time.perf_counter()
    quantize_int8(float_graph, work / "dynamic.onnx")
    dynamic_s = time.perf_counter() - started
    started = time.perf_counter()
    padded = Tokenizer.from_file(str(args.bundle / TOKENIZER_FILE))  # pads and truncates as exported
    quantize_int8_static(float_graph, work / "static.onnx", padded, calibration)
    static_s = time.perf_counter() - started
    variants = {
        "fp32, batched": (float_graph, MAX_CHUNK, False),
        "fp32, one text per call": (float_graph, 1, True),
        "int8 dynamic, batched": (work / "dynamic.onnx", MAX_CHUNK, True),
        "int8 dynamic, one text per call": (work / "dynamic.onnx", 1, True),
        "int8 static, batched": (work / "static.onnx", MAX_CHUNK, False),
        "int8 static, one text per call": (work / "static.onnx", 1, True),
    }
    rows = {}
    for name, (graph, per_call, evaluate) in variants.items():

        def encoder(threads: int = 0, graph=graph, per_call=per_call) -> OnnxEncoder:
            options = EncoderOptions(providers="cpu", intra_op_threads=threads)
            return OnnxEncoder(graph, args.bundle / TOKENIZER_FILE, max_length, options, per_call)

        served = encoder(threads=1)  # the server's layout on 2 cores: 2 workers x 1 thread
        speed = {str(b): round(encoder_alone(served, dev.texts, b, args.seconds, workers=2), 1) for b in (1, 8, 32)}
        invariance = batch_invariance(served, dev.texts[:2000], args.trials)
        rows[name] = {
            "graph_bytes": graph.stat().st_size,
            "texts_per_call": per_call,
            "max_abs_diff_alone_vs_batched": invariance,
            "encoder_texts_per_s_2x1_threads": speed,
        }
        if evaluate:  # a batched graph's quality is its one-text-per-call twin's within float noise
            bundle.encoder = encoder()
            quality = evaluate_predictor(Predictor(bundle), dev, train)
            rows[name]["metrics_filter_after"] = {k: quality["metrics"][k] for k in HEADLINE}
            rows[name]["metrics_exclude_before"] = {k: quality["metrics_exclude_before"][k] for k in HEADLINE}
        print(json.dumps({name: rows[name]}), flush=True)
    fp32 = rows["fp32, one text per call"]["metrics_filter_after"]
    for row in rows.values():
        if "metrics_filter_after" in row:
            row["p5_cost_vs_fp32"] = round(fp32["P@5"] - row["metrics_filter_after"]["P@5"], 2)
    result = {
        "machine": machine(),
        "onnxruntime": ort.__version__,
        "bundle_id": bundle.bundle_id,
        "data": str(args.data),
        "dev_instances": len(dev),
        "calibration_texts": args.calibration_texts,
        "quantize_seconds": {"dynamic": round(dynamic_s, 1), "static": round(static_s, 1)},
        "variants": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
