"""export.fusion_fit: each model's parameters are checked against the model, and the default
fusion is one of the choices it can fit."""

import numpy as np
import pytest

from export.fusion_fit import DEFAULT_FUSION, DEFAULT_PARAMS, FusionChoice, fit_model
from export.held_out import HeldOutPairs


def pairs(n: int = 200) -> HeldOutPairs:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 3))
    y = (X[:, 0] > 0).astype(np.float64)
    return HeldOutPairs(X, y, np.repeat(np.arange(n // 10), 10), np.zeros(n, dtype=np.int64), [], 1.0)


def test_unknown_parameters_of_a_model_are_refused():
    with pytest.raises(ValueError, match="unknown tree parameters"):
        fit_model("tree", pairs(), ("a", "b", "rae_score"), {"trees": 10})


def test_a_tree_is_fitted_with_the_default_parameters_over_the_given_ones():
    fitted = fit_model("tree", pairs(), ("a", "b", "rae_score"), {"depth": 2})
    assert fitted.params == DEFAULT_PARAMS["tree"] | {"depth": 2} and fitted.depth <= 2
    assert np.all((fitted.predict(pairs().X) >= 0) & (fitted.predict(pairs().X) <= 1))


def test_the_default_fusion_takes_its_models_default_parameters_and_names_its_groups():
    assert DEFAULT_FUSION.params == DEFAULT_PARAMS[DEFAULT_FUSION.model]
    assert DEFAULT_FUSION.extra_groups == () and DEFAULT_FUSION.groups == ("rae", "lexical")
    with_rank = FusionChoice("gbdt", ("rae", "lexical", "rank"), {"trees": 40, "leaves": 15}, 200)
    assert with_rank.extra_groups == ("rank",) and with_rank.name == "gbdt-40x15@200[rae+lexical+rank]"
