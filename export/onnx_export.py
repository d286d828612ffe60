"""The ONNX side of an export: graph export, ORT fusion, int8 quantization and the parity checks.

Every graph a bundle is built with goes through :func:`export_checked_graph` (export, fuse,
check against torch); the served graph may then be quantized by :func:`quantize_checked`
(dynamic, or static with calibrated activation scales), which refuses an int8 graph that drifts
too far from the float one. Nothing that was not checked is kept.
"""

from __future__ import annotations

import logging
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from tokenizers import Tokenizer

from export.export_params import Quantize
from export.serving_graph import ServingEncoder, tokenize_batch

log = logging.getLogger("xmcserve.export")

INPUT_NAMES = ["input_ids", "attention_mask"]
OUTPUT_NAME = "embedding"
OPSET = 17


# ORT's transformer optimizer fuses attention, LayerNorm and GELU for BERT-class graphs; it has
# no separate DistilBERT type, the BERT fusions cover it.
OPTIMIZER_MODEL_TYPES = {"bert": "bert", "distilbert": "bert"}


class ParityError(RuntimeError):
    """ONNX Runtime and torch disagree beyond tolerance: the export is refused."""


def export_onnx(
    model: torch.nn.Module, tokenizer: Tokenizer, path: Path, output_name: str = OUTPUT_NAME, per_token: bool = False
) -> None:
    """Write one self-contained ONNX file with dynamic batch and sequence axes. ``per_token``: the
    output has a sequence axis too (a plain encoder's ``last_hidden_state``, for a server that
    pools by itself); the serving graph's has none."""
    example = tokenize_batch(tokenizer, ["example text for tracing", "a second one"])
    dynamic = {name: {0: "batch", 1: "sequence"} for name in INPUT_NAMES}
    dynamic[output_name] = {0: "batch", 1: "sequence"} if per_token else {0: "batch"}
    with warnings.catch_warnings(), torch.inference_mode():
        # The TorchScript exporter is deterministic and exact for BERT-class graphs; its
        # deprecation and tracer warnings are noise here.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(),
            (example["input_ids"], example["attention_mask"]),
            str(path),
            input_names=INPUT_NAMES,
            output_names=[output_name],
            dynamic_axes=dynamic,
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )


def random_texts(tokenizer: Tokenizer, count: int, seed: int = 0, max_words: int = 80) -> list[str]:
    """Texts of random vocabulary words, punctuation and digits, 1 to ``max_words`` words long
    (long ones hit the truncation limit)."""
    rng = random.Random(seed)
    # sorted: the vocabulary dict's order differs from one process to the next, and with it the texts
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 1)
    extras = list(",.:;-()/+") + [str(d) for d in range(10)]
    texts = []
    for _ in range(count):
        n = rng.choice([1, 2, 3, 5, 8, 13, 21, 40, max_words])
        texts.append(" ".join(rng.choice(vocab) if rng.random() > 0.15 else rng.choice(extras) for _ in range(n)))
    return texts


@dataclass
class ParityReport:
    max_abs_diff: float
    max_batch_vs_single_diff: float
    texts: int

    def as_dict(self) -> dict:
        return {
            "max_abs_diff": self.max_abs_diff,
            "max_batch_vs_single_diff": self.max_batch_vs_single_diff,
            "texts": self.texts,
        }


@torch.inference_mode()
def check_parity(
    model: ServingEncoder,
    tokenizer: Tokenizer,
    onnx_path: Path,
    texts: list[str],
    tolerance: float = 1e-4,
    batch_size: int = 16,
) -> ParityReport:
    """Compare ONNX Runtime (CPU) with torch on ``texts`` in padded batches, and each text alone
    with the same text inside a padded batch (padding must not change a vector).

    Raises :class:`ParityError` when either difference exceeds ``tolerance``.
    """
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    worst = 0.0
    batched = []
    for start in range(0, len(texts), batch_size):
        feeds = tokenize_batch(tokenizer, texts[start : start + batch_size])
        expected = model(**feeds).numpy()
        actual = session.run(None, {k: v.numpy() for k, v in feeds.items()})[0]
        worst = max(worst, float(np.abs(actual - expected).max()))
        batched.append(actual)
    batched_all = np.concatenate(batched)
    padding_worst = 0.0
    for i in range(0, len(texts), max(1, len(texts) // 8)):
        feeds = tokenize_batch(tokenizer, [texts[i]])
        alone = session.run(None, {k: v.numpy() for k, v in feeds.items()})[0][0]
        padding_worst = max(padding_worst, float(np.abs(alone - batched_all[i]).max()))
    report = ParityReport(max_abs_diff=worst, max_batch_vs_single_diff=padding_worst, texts=len(texts))
    if worst > tolerance or padding_worst > tolerance:
        raise ParityError(
            f"ONNX parity failed on {len(texts)} texts: max |onnx - torch| = {worst:.2e}, "
            f"max |single - batched| = {padding_worst:.2e}, tolerance {tolerance:.0e}"
        )
    return report


def optimize_onnx(src: Path, dst: Path, architecture: str, num_heads: int, hidden_size: int) -> dict:
    """Fuse the transformer subgraphs with onnxruntime's offline optimizer; returns the fusion counts.

    Raises ``ValueError`` for an architecture the optimizer has no fusions for.
    """
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = OPTIMIZER_MODEL_TYPES.get(architecture)
    if model_type is None:
        raise ValueError(f"no transformer fusions known for {architecture!r}")
    optimized = optimize_model(str(src), model_type=model_type, num_heads=num_heads, hidden_size=hidden_size)
    optimized.save_model_to_file(str(dst))
    return {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}


def quantize_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 quantization of the MatMul weights (activations quantized at run time)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # The fused com.microsoft ops defeat shape inference; their outputs are float32.
    quantize_dynamic(
        str(src), str(dst), weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT}
    )


def quantize_int8_static(
    src: Path, dst: Path, tokenizer: Tokenizer, calibration_texts: list[str], batch_size: int = 32
) -> None:
    """Static int8 quantization: MatMul weights per channel, and each MatMul's input activations
    with one scale and zero point fitted here on ``calibration_texts`` (MinMax over their
    padded batches), fixed in the graph (QDQ). Unlike dynamic quantization, whose activation
    scale is computed per call from the whole batch tensor, a text's vector then does not
    depend on the other texts of its batch or on their padding."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    batches = [
        {k: v.numpy() for k, v in tokenize_batch(tokenizer, calibration_texts[i : i + batch_size]).items()}
        for i in range(0, len(calibration_texts), batch_size)
    ]

    class Batches:
        def __init__(self):
            self.remaining = iter(batches)

        def get_next(self) -> dict | None:
            return next(self.remaining, None)

    quantize_static(
        str(src),
        str(dst),
        Batches(),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        # the fused com.microsoft ops defeat shape inference; their outputs are float32
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )


def min_cosine(reference: Path, candidate: Path, tokenizer: Tokenizer, texts: list[str], batch_size: int = 32) -> float:
    """Smallest cosine between two graphs' outputs on ``texts`` (unit vectors: the dot product)."""
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (reference, candidate)]
    worst = 1.0
    for start in range(0, len(texts), batch_size):
        feeds = {k: v.numpy() for k, v in tokenize_batch(tokenizer, texts[start : start + batch_size]).items()}
        a, b = (s.run(None, feeds)[0] for s in sessions)
        worst = min(worst, float((a * b).sum(axis=1).min()))
    return worst


def attention_shape(config) -> tuple[int, int]:
    """(attention heads, hidden size) of a BERT-like or DistilBERT config."""
    heads = getattr(config, "num_attention_heads", None) or config.n_heads
    hidden = getattr(config, "hidden_size", None) or config.dim
    return heads, hidden


def fuse_or_keep(plain: Path, path: Path, config, fuse: bool = True) -> dict:
    """Move the graph ``plain`` to ``path``, fused when ``fuse`` and ORT has fusions for the
    architecture (otherwise as it is, with a warning); returns the fusion counts ({} if unfused)."""
    if fuse:
        try:
            fusions = optimize_onnx(plain, path, config.model_type, *attention_shape(config))
        except ValueError as exc:
            log.warning("graph not fused: %s", exc)
        else:
            plain.unlink()
            return fusions
    plain.rename(path)
    return {}


def export_checked_graph(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    config,
    path: Path,
    parity_texts: list[str],
    tolerance: float,
    fuse: bool = True,
) -> dict:
    """Write ``model`` to ``path`` as ONNX, fused when ``fuse``, and check it against torch on
    ``parity_texts`` (:class:`ParityError` beyond ``tolerance``).

    Returns ``{"fusions": counts, "parity": report}`` for the manifest's params.
    """
    plain = path.with_suffix(".plain.onnx")
    export_onnx(model, tokenizer, plain)
    report = {"fusions": fuse_or_keep(plain, path, config, fuse)}
    report["parity"] = check_parity(model, tokenizer, path, parity_texts, tolerance).as_dict()
    log.info("ONNX parity of %s: %s; fusions: %s", path.name, report["parity"], report["fusions"])
    return report


def quantize_checked(
    path: Path,
    tokenizer: Tokenizer,
    parity_texts: list[str],
    least_cosine: float,
    quantize: Quantize = "int8",
    calibration_texts: list[str] | None = None,
) -> float:
    """Replace the float graph at ``path`` by its ``quantize`` version (``int8``: dynamic;
    ``int8-static``: scales fitted on ``calibration_texts``); returns the smallest cosine between
    the two graphs' outputs on ``parity_texts`` and raises :class:`ParityError` below ``least_cosine``."""
    float_graph = path.with_suffix(".float.onnx")
    path.rename(float_graph)
    if quantize == "int8-static":
        if not calibration_texts:
            raise ValueError("static int8 quantization needs calibration texts")
        quantize_int8_static(float_graph, path, tokenizer, calibration_texts)
    else:
        quantize_int8(float_graph, path)
    cosine = min_cosine(float_graph, path, tokenizer, parity_texts)
    float_graph.unlink()
    if cosine < least_cosine:
        raise ParityError(f"int8 graph drifts too far: min cosine {cosine:.3f} < {least_cosine}")
    return cosine


def export_serving_graph(
    model: ServingEncoder,
    tokenizer: Tokenizer,
    config,
    path: Path,
    parity_texts: list[str],
    *,
    tolerance: float,
    fuse: bool,
    quantize: Quantize,
    int8_min_cosine: float,
    calibration_texts: list[str] | None = None,
) -> dict:
    """The served graph at ``path``: :func:`export_checked_graph`, then int8 when ``quantize`` says
    so (:func:`quantize_checked`). Returns what was done (fusions, parity, int8 drift)."""
    report = export_checked_graph(model, tokenizer, config, path, parity_texts, tolerance, fuse)
    if quantize != "none":
        report["int8_min_cosine"] = quantize_checked(
            path, tokenizer, parity_texts, int8_min_cosine, quantize, calibration_texts
        )
    return report
