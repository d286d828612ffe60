"""The fitted T as an ai.onnx.ml TreeEnsemble ONNX model, ``fusion.onnx``, which the service runs
with ONNX Runtime: converted by the maintained converter of its library (skl2onnx, onnxmltools),
LightGBM's split thresholds first moved to float32 so the conversion routes every row as the fit
does, and ONNX Runtime's scores of the pairs checked against the library's own (the max
|difference| goes into the manifest; above :data:`PARITY_BOUND` the export is refused:
:class:`~export.fusion_fit.FuseError`).
"""

from __future__ import annotations

import numpy as np

from engine.offline import OnnxTreeEnsemble
from export.fusion_fit import FittedModel, FuseError

# The most |ONNX Runtime − fitting library| an exported model may differ by on its pairs: float32
# sums of leaf values, far below any difference between two candidates' fused scores that matters.
PARITY_BOUND = 1e-4
# ai.onnx.ml opset 3 / ONNX opset 15: what skl2onnx and onnxmltools both write TreeEnsembleRegressor in
ONNX_OPSETS = {"": 15, "ai.onnx.ml": 3}


def to_onnx(fitted: FittedModel, width: int) -> bytes:
    """T as an ai.onnx.ml TreeEnsembleRegressor model over a float ``[batch, width]`` input,
    written by its library's maintained converter."""
    if fitted.kind == "tree":
        from skl2onnx import convert_sklearn
        from skl2onnx.common.data_types import FloatTensorType

        model = convert_sklearn(
            fitted.library_model, initial_types=[("features", FloatTensorType([None, width]))], target_opset=ONNX_OPSETS
        )
    else:
        from onnxmltools import convert_lightgbm
        from onnxmltools.convert.common.data_types import FloatTensorType

        model = convert_lightgbm(
            float32_thresholds(fitted.library_model.booster_),
            initial_types=[("features", FloatTensorType([None, width]))],
            target_opset=ONNX_OPSETS[""],
            zipmap=False,
        )
    ops = [node.op_type for node in model.graph.node]
    if "TreeEnsembleRegressor" not in ops:
        raise FuseError(f"the converter wrote {ops}, not an ai.onnx.ml TreeEnsembleRegressor")
    return model.SerializeToString()


def float32_thresholds(booster):
    """``booster`` with every split threshold t replaced by the largest float32 ≤ t. LightGBM's
    thresholds are doubles, which the converter rounds to the nearest float32 of an ai.onnx.ml
    TreeEnsemble: a feature value equal to a rounded-up threshold then goes left where LightGBM
    sends it right. φ is float32, and a float32 x is ≤ t exactly when it is ≤ that float, so the
    replaced booster routes every row as the fitted one does and converts exactly."""
    import lightgbm

    lines = []
    for line in booster.model_to_string().splitlines():
        if line.startswith("threshold="):
            exact = np.array(line.removeprefix("threshold=").split(), dtype=np.float64)
            nearest = exact.astype(np.float32)
            below = np.where(nearest > exact, np.nextafter(nearest, np.float32(-np.inf)), nearest)
            line = "threshold=" + " ".join(repr(float(t)) for t in below)
        elif line.startswith("tree_sizes="):  # byte offsets of the trees' text, which changed: parse in order
            continue
        lines.append(line)
    return lightgbm.Booster(model_str="\n".join(lines) + "\n")


def onnx_fusion_model(fitted: FittedModel, X: np.ndarray) -> tuple[OnnxTreeEnsemble, float]:
    """``fitted`` converted to ONNX and loaded as the service loads it, and the max |ONNX Runtime
    − library| over ``X``; refused above :data:`PARITY_BOUND`."""
    model = OnnxTreeEnsemble.from_bytes(to_onnx(fitted, X.shape[1]), X.shape[1])
    parity = float(np.max(np.abs(model.predict(X) - fitted.predict(X)), initial=0.0))
    if not parity <= PARITY_BOUND:
        raise FuseError(
            f"the ONNX {fitted.kind} scores the pairs up to {parity:.3g} away from "
            f"{type(fitted.library_model).__name__}'s own (bound {PARITY_BOUND})"
        )
    return model, parity
