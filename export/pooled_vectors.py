"""Mean-pooled Φ of the memory and label texts on the fastest device present.

* **CPU**: the encoder exported to a fused ONNX graph and run by ONNX Runtime on every core
  (about twice torch's speed on a CPU), parity-checked against torch first.
* **CUDA** (``encode_device`` ``auto`` with a GPU, or ``cuda``): torch on the GPU under fp16
  autocast, texts sorted by token count into batches of ``gpu_batch_size`` (little padding), and
  a sample of the vectors checked against the same ONNX graph on the CPU: the largest absolute
  difference is reported and must stay within ``encode_parity_tolerance``.

The keys, and so the bundle id, depend on the device: fp16 on a GPU and fp32 on a CPU differ in
the last digits.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from bundle import TOKENIZER_FILE
from engine import EncoderOptions
from engine.offline import MAX_CHUNK, OnnxEncoder
from export.export_params import ExportParams
from export.onnx_export import ParityError, export_checked_graph
from export.serving_graph import PooledEncoder, tokenize_batch

log = logging.getLogger("xmcserve.export")

POOLED_PARITY_TEXTS = 32  # torch vs the exported ONNX graph, before encoding with it
DEVICE_PARITY_TEXTS = 256  # GPU vectors vs the ONNX graph on the CPU
ENCODE_BLOCK = 2048  # texts per ONNX Runtime call batch (each length-sorted and chunked)


@dataclass
class EncodeReport:
    device: str
    texts: int
    seconds: float
    parity_max_abs_diff: float | None = None

    def as_dict(self) -> dict:
        return {
            "encode_device": self.device,
            "encode_texts_per_s": round(self.texts / max(self.seconds, 1e-9), 1),
            "encode_parity_max_abs_diff": self.parity_max_abs_diff,
        }


def resolve_device(requested: str) -> str:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("encode_device cuda asked for, but torch sees no CUDA device")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def torch_pooled(
    encoder: torch.nn.Module, tokenizer: Tokenizer, texts: list[str], device: str, batch_size: int
) -> np.ndarray:
    """Φ of ``texts`` with torch on ``device`` (fp16 autocast on CUDA), in length-sorted batches."""
    model = PooledEncoder(encoder).eval().to(device)
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    order = np.argsort(lengths, kind="stable")
    out = np.empty((len(texts), encoder.config.hidden_size), dtype=np.float32)
    autocast = torch.autocast("cuda", dtype=torch.float16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    with torch.inference_mode(), autocast:
        for start in tqdm(range(0, len(texts), batch_size), desc=f"encode on {device}", unit="batch", leave=False):
            rows = order[start : start + batch_size]
            batch = {k: v.to(device) for k, v in tokenize_batch(tokenizer, [texts[i] for i in rows]).items()}
            out[rows] = model(**batch).float().cpu().numpy()
    return out


def onnx_pooled(onnx_encoder: OnnxEncoder, texts: list[str], block: int) -> np.ndarray:
    parts = [
        onnx_encoder.encode(texts[start : start + block])[0]
        for start in tqdm(range(0, len(texts), block), desc="encode on cpu", unit="block", leave=False)
    ]
    return np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)


def encode_pooled(
    encoder: torch.nn.Module, tokenizer: Tokenizer, texts: list[str], params: ExportParams
) -> tuple[np.ndarray, EncodeReport]:
    """Φ of ``texts`` (see the module docstring) and how it was computed."""
    device = resolve_device(params.encode_device)
    with tempfile.TemporaryDirectory() as workdir:
        graph, tokenizer_file = Path(workdir) / "pooled.onnx", Path(workdir) / TOKENIZER_FILE
        # Always fused, whatever ``optimize`` says: that option is about the served graph.
        export_checked_graph(
            PooledEncoder(encoder).eval(),
            tokenizer,
            encoder.config,
            graph,
            texts[:POOLED_PARITY_TEXTS],
            params.parity_tolerance,
        )
        tokenizer_file.write_text(tokenizer.to_str())
        # batched: a build encodes many texts on every core, and keys need no batch invariance
        options = EncoderOptions(providers="cpu")
        onnx_encoder = OnnxEncoder(graph, tokenizer_file, params.max_length, options, texts_per_call=MAX_CHUNK)
        started = time.perf_counter()
        if device == "cpu":
            pooled = onnx_pooled(onnx_encoder, texts, max(params.batch_size, ENCODE_BLOCK))
            return pooled, EncodeReport("cpu", len(texts), time.perf_counter() - started)
        pooled = torch_pooled(encoder, tokenizer, texts, device, params.gpu_batch_size)
        seconds = time.perf_counter() - started
        report = EncodeReport(device, len(texts), seconds, device_parity(pooled, texts, onnx_encoder, params))
    log.info("encoded %d texts on %s at %.0f texts/s", len(texts), device, len(texts) / max(seconds, 1e-9))
    return pooled, report


def device_parity(pooled: np.ndarray, texts: list[str], onnx_encoder: OnnxEncoder, params: ExportParams) -> float:
    """Largest |device − ONNX on CPU| over a spread sample of the texts; beyond the tolerance the
    export fails (a broken kernel or a wrong dtype must not reach a bundle)."""
    sample = np.unique(np.linspace(0, len(texts) - 1, min(DEVICE_PARITY_TEXTS, len(texts))).astype(int))
    reference = onnx_encoder.encode([texts[i] for i in sample])[0]
    diff = float(np.abs(pooled[sample] - reference).max()) if len(sample) else 0.0
    if diff > params.encode_parity_tolerance:
        raise ParityError(f"device vectors differ from the ONNX graph by {diff:.4g} > {params.encode_parity_tolerance}")
    return round(diff, 6)
