"""export.fusion_to_onnx: the converted model scores as its library does, LightGBM's double
thresholds floored to float32 so it converts exactly, and a model that drifts is refused."""

import numpy as np
import pytest

from engine.fusion import (
    FEATURES,
    OnnxTreeEnsemble,
)
from export.fusion_fit import FittedModel, FuseError, fit_model
from export.fusion_to_onnx import PARITY_BOUND, onnx_fusion_model
from export.held_out import HeldOutPairs
from tests.engine.test_fusion import random_sklearn_tree


def test_an_export_whose_onnx_model_differs_from_its_library_is_refused(monkeypatch):
    X = np.random.default_rng(4).normal(size=(500, len(FEATURES))).astype(np.float32).astype(np.float64)
    fitted = FittedModel("tree", {}, random_sklearn_tree(depth=4))
    model, parity = onnx_fusion_model(fitted, X)
    assert parity <= PARITY_BOUND and isinstance(model, OnnxTreeEnsemble)
    monkeypatch.setattr(FittedModel, "predict", lambda self, X: self.library_model.predict(X) + 1e-3)
    with pytest.raises(FuseError, match="bound"):
        onnx_fusion_model(fitted, X)


@pytest.mark.parametrize("kind", ["gbdt", "lambdarank"])
def test_lightgbm_s_double_thresholds_convert_exactly_on_float32_features(kind, monkeypatch):
    """A feature whose values are adjacent float32s: LightGBM splits between them at a double the
    converter alone rounds to the nearest float32, the upper value half the time, sending that
    value the wrong way; floored thresholds route every row as LightGBM does."""
    rng = np.random.default_rng(5)
    low = rng.uniform(0.1, 0.9, size=8).astype(np.float32)
    upper = rng.integers(0, 2, size=(4000, 8)).astype(bool)
    X = np.where(upper, np.nextafter(low, np.float32(1)), low).astype(np.float64)
    y = (upper @ rng.normal(size=8) + rng.normal(scale=0.3, size=4000) > 0).astype(np.float64)
    pairs = HeldOutPairs(X, y, np.repeat(np.arange(100), 40), np.zeros(4000, dtype=np.int64), [], 1.0)
    pairs.relevant = [np.zeros(0, dtype=np.int64)] * 100
    features = tuple(f"f{i}" for i in range(7)) + ("rae_score",)  # fit_model boosts lambdarank from rae_score
    fitted = fit_model(kind, pairs, features, {"trees": 30})
    _, parity = onnx_fusion_model(fitted, X)
    assert parity <= PARITY_BOUND
    monkeypatch.setattr("export.fusion_to_onnx.float32_thresholds", lambda booster: booster)  # the converter alone
    with pytest.raises(FuseError, match="bound"):
        onnx_fusion_model(fitted, X)
