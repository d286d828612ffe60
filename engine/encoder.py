"""Text -> query vector with ``tokenizers`` and ONNX Runtime (no torch).

The bundle's ONNX graph does pooling, projection and normalisation, so this module only
tokenises (truncated to the bundle's max length) and runs the session: on the CPU one call per
text, so a text's vector is the same bits whatever it is batched with; on CUDA one call per
length-sorted chunk of up to :data:`MAX_CHUNK` texts, padded to the chunk's longest
(:func:`plan_chunks`).

:class:`Encoder` is what the rest of the engine calls on an encoder; :class:`TokenizingEncoder`
holds the tokenizing and chunking every backend shares, and a backend supplies ``run`` (one
call on a chunk of token ids): :class:`OnnxEncoder`, the bundle's ONNX graph, or, for
benchmarks, :class:`engine.null_encoder.NullEncoder`, which looks vectors up instead
(``EncoderOptions.backend``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Encoding, Tokenizer

try:
    import onnxruntime as ort
except ImportError as exc:  # the core installs neither build: they ship the same module
    raise ImportError(
        "xmcserve needs ONNX Runtime: install xmcserve[cpu] (onnxruntime) or xmcserve[gpu] (onnxruntime-gpu)"
    ) from exc

log = logging.getLogger(__name__)

CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
# How a batch is cut into length-sorted session calls (:func:`plan_chunks`): the fixed cost of one
# call in token-equivalents, and the most texts one call carries (measured with bench/serving.py).
CALL_COST_TOKENS = 16.0
MAX_CHUNK = 64
# What answers an encoder's session call (EncoderOptions.backend): the bundle's ONNX graph, or
# for benchmarks a lookup of precomputed vectors (engine.null_encoder).
ENCODER_BACKENDS = ("onnx", "null")


def confined_cpu_count() -> int | None:
    """How many cores this process may run on, when that is fewer than the machine has (a
    ``taskset``, a cpuset container); None when it may use them all."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return allowed if allowed < (os.cpu_count() or allowed) else None


def thread_layout(workers: int, intra_op_threads: int, providers: str, processes: int = 1) -> tuple[int, int]:
    """(encode workers, intra-op threads of each session call); 0 asks for the default.
    ``processes``: the server processes sharing the cores (``XMCSERVE_WORKERS``), each given its
    share of them.

    On CPU the default is one worker per core, each call on one thread: a MiniLM call on a batch
    of short titles is too small to split well over cores, and independent calls are not (on 2
    cores: 790 texts/s at batch 1 against 600 for one call on both cores, 840 against 766 at batch
    32; bench/results/README.md). A given count of either fills the cores with the other. On CUDA
    two workers, so one batch is prepared while the other runs, and the default pool."""
    if CUDA_PROVIDER in choose_providers(providers):
        return workers or 2, intra_op_threads
    cores = max(1, (confined_cpu_count() or os.cpu_count() or 1) // processes)
    if not workers:
        workers = max(1, cores // (intra_op_threads or 1))
    return workers, intra_op_threads or max(1, cores // workers)


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


def runs_on_cuda(preference: str) -> bool:
    """Whether a session asked for ``preference`` would be offered the CUDA provider (without
    creating one: where ``cuda`` cannot be had, :func:`choose_providers` says so)."""
    return preference != "cpu" and CUDA_PROVIDER in ort.get_available_providers()


def load_tokenizer(path: Path, max_length: int) -> tuple[Tokenizer, int]:
    """The tokenizer, truncating to ``max_length`` and not padding, and its pad id: the encoder
    pads each length-sorted chunk itself (the MiniLM tokenizer.json as shipped pads every text
    to 128 tokens)."""
    tokenizer = Tokenizer.from_file(str(path))
    pad_id = int((tokenizer.padding or {}).get("pad_id", 0))
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.no_padding()
    return tokenizer, pad_id


def plan_chunks(
    sorted_lengths: list[int] | np.ndarray, call_cost_tokens: float, max_chunk: int
) -> list[tuple[int, int]]:
    """Split texts sorted by token length into contiguous chunks minimising the modelled cost.

    A chunk ``[i, j)`` costs ``call_cost_tokens + (j - i) * sorted_lengths[j - 1]``: one session
    call's fixed overhead (in token-equivalents) plus its padded tokens. Dynamic programming,
    O(n · max_chunk). One text per call wastes the fixed overhead; one call for all texts pads
    short titles to the longest one.
    """
    n = len(sorted_lengths)
    if n <= 1:
        return [(0, n)] if n else []
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        starts = np.arange(max(0, end - max_chunk), end)
        costs = best[starts] + call_cost_tokens + (end - starts) * sorted_lengths[end - 1]
        i = int(np.argmin(costs))
        best[end], cut[end] = costs[i], starts[i]
    chunks, end = [], n
    while end > 0:
        chunks.append((int(cut[end]), end))
        end = int(cut[end])
    return chunks[::-1]


@dataclass(frozen=True)
class EncoderOptions:
    """How a bundle's encoder runs (not what it computes), and, for benchmarks, whether it runs.

    Attributes:
        providers: ``auto`` (CUDA when this onnxruntime has it, else CPU), ``cpu`` or ``cuda``.
        intra_op_threads: ONNX Runtime intra-op threads; 0 = one per core this process may use.
        allow_spinning: intra-op threads spin while waiting for work (lower latency, more CPU).
        backend: ``onnx`` (the bundle's graph) or ``null``: the bundle's tokenizer, then a vector
            looked up instead of computed (:class:`engine.null_encoder.NullEncoder`), so a
            benchmark measures everything but the encoder. Never for serving answers.
        null_vectors: the null backend's vector file (None: a deterministic vector per text).
    """

    providers: str = "auto"
    intra_op_threads: int = 0
    allow_spinning: bool = True
    backend: str = "onnx"
    null_vectors: Path | None = None

    def __post_init__(self):
        if self.backend not in ENCODER_BACKENDS:
            raise ValueError(f"unknown encoder backend {self.backend!r} ({', '.join(ENCODER_BACKENDS)})")
        if self.null_vectors is not None and self.backend != "null":
            raise ValueError(f"null_vectors {self.null_vectors} given for the {self.backend} encoder backend")


@dataclass
class EncodeTimes:
    tokenize_s: float
    encode_s: float


class Encoder(Protocol):
    """What the engine calls on a bundle's encoder (the predictor, the batcher's encode stage, an
    append's encoding, the load's warm-up check) and what the front ends read of it.

    Attributes:
        options: how it was asked to run.
        provider: what runs it, for logs and ``/info`` (ONNX Runtime's execution provider, or
            ``null``).
        texts_per_call: the most texts one :meth:`run` carries.
    """

    options: EncoderOptions
    provider: str
    texts_per_call: int

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, truncated to the bundle's max length, not padded."""
        ...

    def run(self, token_ids: list[list[int]]) -> np.ndarray:
        """The ``[len(token_ids), dim]`` float32 unit vectors of one chunk of tokenized texts."""
        ...

    def encode(self, texts: list[str]) -> tuple[np.ndarray, EncodeTimes]:
        """Vectors in input order, and the time spent tokenizing and running."""
        ...

    def encode_keeping_tokens(self, texts: list[str]) -> tuple[np.ndarray, EncodeTimes, list[Encoding]]:
        """:meth:`encode`, and the tokenizer's encodings of ``texts`` (what a lexical fusion reads)."""
        ...


class TokenizingEncoder:
    """The tokenizing and chunking every backend shares: a backend sets :attr:`texts_per_call`
    and :attr:`provider` and supplies :meth:`run`, one call on a chunk of token ids."""

    provider: str
    texts_per_call: int

    def __init__(self, tokenizer_path: Path, max_length: int, options: EncoderOptions | None = None):
        self.options = options or EncoderOptions()
        self.tokenizer, self.pad_id = load_tokenizer(tokenizer_path, max_length)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def run(self, token_ids: list[list[int]]) -> np.ndarray:
        raise NotImplementedError

    def encode(self, texts: list[str]) -> tuple[np.ndarray, EncodeTimes]:
        """Vectors in input order: tokenise once, then one :meth:`run` per length-sorted chunk
        (of one text on the CPU: ``texts_per_call``)."""
        vectors, times, _ = self.encode_keeping_tokens(texts)
        return vectors, times

    def encode_keeping_tokens(self, texts: list[str]) -> tuple[np.ndarray, EncodeTimes, list[Encoding]]:
        """:meth:`encode`, and the tokenizer's encodings of ``texts`` it computed (the word pieces a
        lexical score fusion reads too)."""
        t0 = time.perf_counter()
        encodings = self.tokenizer.encode_batch(texts)
        token_ids = [encoding.ids for encoding in encodings]
        t1 = time.perf_counter()
        order = np.argsort([len(ids) for ids in token_ids], kind="stable")
        lengths = [len(token_ids[i]) for i in order]
        out: np.ndarray | None = None
        for start, end in plan_chunks(lengths, CALL_COST_TOKENS, self.texts_per_call):
            rows = order[start:end]
            vectors = self.run([token_ids[i] for i in rows])
            if out is None:
                out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
            out[rows] = vectors
        return out, EncodeTimes(tokenize_s=t1 - t0, encode_s=time.perf_counter() - t1), encodings


class OnnxEncoder(TokenizingEncoder):
    """Tokenizer + ONNX Runtime session producing L2-normalised ``[batch, dim]`` float32 vectors."""

    def __init__(
        self,
        onnx_path: Path,
        tokenizer_path: Path,
        max_length: int,
        options: EncoderOptions | None = None,
        texts_per_call: int | None = None,
    ):
        """``texts_per_call``: the most texts one session call carries (None: one on the CPU,
        :data:`MAX_CHUNK` on CUDA; see :attr:`texts_per_call`)."""
        super().__init__(tokenizer_path, max_length, options)
        options = self.options
        session_options = ort.SessionOptions()
        session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # ONNX Runtime's default pool pins one thread to each physical core of the machine,
        # whatever the process's own CPU mask (a server under `taskset -c 0` got a thread on core
        # 1); given a count, it leaves affinity alone and its threads stay within the mask.
        threads = options.intra_op_threads or confined_cpu_count()
        if threads:
            session_options.intra_op_num_threads = threads
        if not options.allow_spinning:
            # Spinning intra-op threads cut single-call latency but burn the core the event
            # loop needs under load.
            session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            str(onnx_path), session_options, providers=choose_providers(options.providers)
        )
        self.provider = self.session.get_providers()[0]
        if options.providers == "cuda" and self.provider != CUDA_PROVIDER:
            # ORT falls back to the CPU when the CUDA provider is listed but cannot be created
            # (missing CUDA/cuDNN libraries, no device): asked for CUDA, that is a failed start.
            raise RuntimeError(
                f"CUDA execution provider requested but the session runs on {self.session.get_providers()}: "
                "the CUDA provider could not be created (see ONNX Runtime's log above for the missing library)"
            )
        # On the CPU each text is its own session call, so that a text's vector is the same bits
        # whatever it is batched with: ONNX Runtime's kernels sum in an order that depends on the
        # call's shape (a batch of one against two differed by 4e-8, enough to move HNSW's path),
        # and an int8 graph's dynamic activation scales come from the whole batch tensor. With one
        # worker thread per core this costs little (bench/results/int8-methods.json); on CUDA,
        # where a batch is many times faster than its texts one by one, texts are batched.
        if texts_per_call is None:
            texts_per_call = MAX_CHUNK if self.provider == CUDA_PROVIDER else 1
        self.texts_per_call = texts_per_call
        self.input_names = [i.name for i in self.session.get_inputs()]
        log.info("encoder %s on %s", onnx_path, self.provider)

    def run(self, token_ids: list[list[int]]) -> np.ndarray:
        """One session call on a chunk, padded to its longest text."""
        longest = max(len(ids) for ids in token_ids)
        input_ids = np.full((len(token_ids), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(token_ids), longest), dtype=np.int64)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        return self.session.run(None, {name: feeds[name] for name in self.input_names})[0]
