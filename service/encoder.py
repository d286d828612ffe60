"""Text -> query vector with ``tokenizers`` and ONNX Runtime (no torch).

The bundle's ONNX graph does pooling, projection and normalisation, so this module only
tokenises (truncated to the bundle's max length, padded to the batch's longest text) and runs
one session call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

log = logging.getLogger(__name__)

CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"


def choose_providers(preference: str) -> list[str]:
    """``auto``: CUDA when this onnxruntime build has it, else CPU; ``cuda`` insists; ``cpu`` forces CPU."""
    available = ort.get_available_providers()
    if preference == "cpu":
        return [CPU_PROVIDER]
    if preference == "cuda":
        if CUDA_PROVIDER not in available:
            raise RuntimeError(f"CUDA execution provider requested but onnxruntime offers only {available}")
        return [CUDA_PROVIDER, CPU_PROVIDER]
    if preference != "auto":
        raise ValueError(f"unknown provider preference {preference!r} (auto, cpu, cuda)")
    return [CUDA_PROVIDER, CPU_PROVIDER] if CUDA_PROVIDER in available else [CPU_PROVIDER]


def load_tokenizer(path: Path, max_length: int) -> Tokenizer:
    """Truncate to ``max_length``; pad to the longest text of each batch, never to a fixed length."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=max_length)
    padding = tokenizer.padding or {}
    tokenizer.enable_padding(pad_id=padding.get("pad_id", 0), pad_token=padding.get("pad_token", "[PAD]"))
    return tokenizer


@dataclass
class EncodeTimes:
    tokenize_s: float
    encode_s: float


class OnnxEncoder:
    """Tokenizer + ONNX Runtime session producing L2-normalised ``[batch, dim]`` float32 vectors."""

    def __init__(
        self,
        onnx_path: Path,
        tokenizer_path: Path,
        max_length: int,
        providers: str = "auto",
        intra_op_threads: int = 0,
    ):
        self.tokenizer = load_tokenizer(tokenizer_path, max_length)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads > 0:
            options.intra_op_num_threads = intra_op_threads
        self.session = ort.InferenceSession(str(onnx_path), options, providers=choose_providers(providers))
        self.provider = self.session.get_providers()[0]
        self.input_names = [i.name for i in self.session.get_inputs()]
        log.info("encoder %s on %s", onnx_path, self.provider)

    @property
    def output_dim(self) -> int | None:
        dim = self.session.get_outputs()[0].shape[-1]
        return dim if isinstance(dim, int) else None

    def tokenize(self, texts: list[str]) -> dict[str, np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts)
        feeds = {
            "input_ids": np.asarray([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.asarray([e.attention_mask for e in encodings], dtype=np.int64),
        }
        return {name: feeds[name] for name in self.input_names}

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run(None, feeds)[0]

    def encode(self, texts: list[str]) -> tuple[np.ndarray, EncodeTimes]:
        t0 = time.perf_counter()
        feeds = self.tokenize(texts)
        t1 = time.perf_counter()
        vectors = self.run(feeds)
        t2 = time.perf_counter()
        return vectors, EncodeTimes(tokenize_s=t1 - t0, encode_s=t2 - t1)
