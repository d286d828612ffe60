"""The score fusion's model T fitted on held-out pairs (:mod:`export.held_out`): one regression
tree (NGAME App. C: depth 7, scikit-learn), gradient-boosted regression trees (LightGBM) or
LambdaMART (LightGBM lambdarank, each held-out search a group, boosted from p̂ so that p̂ + T is
what it ranks by), and the default fusion, defined once here.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import numpy as np

from bundle import FusionModelKind
from engine.offline import SOURCE_GROUPS
from export.held_out import HeldOutPairs

# The feature groups every fusion has, the base the optional groups are added to (and named after).
BASE_GROUPS: tuple[str, ...] = ("rae", "lexical")


@dataclasses.dataclass(frozen=True)
class FusionChoice:
    """A fusion as ``studies.fusion_models`` compares them and ``export.fuse`` fits one: its model and
    the model's parameters, its feature groups, its rerank depth (None: T rescores every candidate)
    and the candidates a query gets from a sparse ranker (None: none; :mod:`engine.sparse`)."""

    model: FusionModelKind
    groups: tuple[str, ...]
    params: dict
    rerank_depth: int | None = None
    sparse_depth: int | None = None

    @property
    def extra_groups(self) -> tuple[str, ...]:
        """The optional feature groups added to the base ones (a source's own are named by it)."""
        return tuple(group for group in self.groups if group not in BASE_GROUPS + SOURCE_GROUPS)

    @property
    def name(self) -> str:
        """How results name it: ``lambdarank-60x15@200[rae+lexical]``."""
        extra = "+".join(self.extra_groups)
        size = f"-{self.params['trees']}x{self.params['leaves']}" if "trees" in self.params else ""
        depth = f"@{depth_name(self.rerank_depth)}"
        groups = "+".join(g for g in self.groups if g in BASE_GROUPS) + ("+" + extra if extra else "")
        sparse = f"+sparse@{self.sparse_depth}" if self.sparse_depth else ""
        return f"{self.model}{size}{depth}[{groups}]{sparse}"


def depth_name(rerank_depth: int | None) -> str:
    """How results name a rerank depth: its value, or ``all`` for every candidate."""
    return str(rerank_depth or "all")


# Each model's parameters when none are given (a tree: NGAME App. C).
DEFAULT_PARAMS: dict[str, dict] = {
    "tree": {"depth": 7, "min_leaf": 50},
    "gbdt": {"trees": 100, "depth": 6, "leaves": 31, "min_leaf": 20, "learning_rate": 0.1},
    "lambdarank": {"trees": 60, "depth": 6, "leaves": 31, "min_leaf": 20, "learning_rate": 0.1},
}
# The default fusion, the one place it is defined (export.fuse's defaults, studies.quality's, make
# fit's): the choice studies.fusion_models made on the CPU recipe's held-out instances, searched
# against the memory without them, over the candidates it serves: the memory's and a sparse linear
# ranker's top 100 (a label centroid over the lexical term space, each label's own text among its
# texts; the choice of studies.candidate_sources on the same held-out validation,
# bench/results/candidate-sources-debian.json). Among the models the serving bill leaves room for
# (at most 0.3 ms a query in ONNX Runtime): LambdaMART (60 trees, 31 leaves) over the RAE, lexical
# and sparse features, rescoring each query's top 200 by p̂. No optional group added enough. Its
# name is the "chosen" of bench/results/fusion-models-sparse.json (2026-11-28; 60 trees of 15
# leaves before, chosen over the memory's candidates alone in bench/results/fusion-models.json;
# tests/bench/test_fusion_models.py checks both).
DEFAULT_FUSION = FusionChoice("lambdarank", BASE_GROUPS, DEFAULT_PARAMS["lambdarank"], 200, sparse_depth=100)
# The ensemble sizes export.fuse cross-validates on a data set's own held-out instances, the
# default's first (a tie keeps it): the two the serving bill leaves room for that led the choice
# above. Each data set gets the one its held-out instances prefer: Debian-Related's chose 60x31 over
# 60x15 by +0.20 P@1, Gutenberg-Subjects' 60x15 by +0.72 (bench/results/fusion-models-sparse*.json).
DEFAULT_SIZES: tuple[dict, ...] = ({"trees": 60, "leaves": 31}, {"trees": 60, "leaves": 15})


def size_name(params: dict) -> str:
    """``60x31``: an ensemble's trees and leaves."""
    return f"{params['trees']}x{params['leaves']}"


def is_size(size: dict) -> bool:
    """Whether ``size`` is an ensemble size: integer trees (at least 1) and leaves (at least 2)."""
    if set(size) != {"trees", "leaves"} or not all(isinstance(value, int) for value in size.values()):
        return False
    return size["trees"] >= 1 and size["leaves"] >= 2


def parse_size(value: str) -> dict:
    """An ensemble size named ``TREESxLEAVES`` (e.g. ``60x31``; an argparse type)."""
    trees, sep, leaves = value.partition("x")
    size = {"trees": int(trees), "leaves": int(leaves)} if sep and trees.isdigit() and leaves.isdigit() else {}
    if not is_size(size):
        raise argparse.ArgumentTypeError(f"expected TREESxLEAVES such as 60x31, got {value!r}")
    return size


class FuseError(ValueError):
    """Fitting or exporting a score fusion was refused: the bundle, run or parameters do not
    allow it, or the exported model does not score as its library does. ``python -m export.fuse``
    turns it into its exit message."""


@dataclass
class FittedModel:
    """T as its library fitted it, and the library's own scores of φ."""

    kind: FusionModelKind
    params: dict
    library_model: object
    depth: int | None = None

    def predict(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(self.library_model.predict(X), dtype=np.float64).reshape(-1)


def fit_model(kind: FusionModelKind, pairs: HeldOutPairs, features: tuple[str, ...], params: dict | None = None):
    """T of ``kind`` (``params`` over :data:`DEFAULT_PARAMS`) fitted to ``pairs``."""
    params = DEFAULT_PARAMS[kind] | (params or {})
    unknown = set(params) - set(DEFAULT_PARAMS[kind])
    if unknown:
        raise ValueError(f"unknown {kind} parameters {sorted(unknown)}")
    if kind == "tree":
        from sklearn.tree import DecisionTreeRegressor

        model = DecisionTreeRegressor(max_depth=params["depth"], min_samples_leaf=params["min_leaf"], random_state=0)
        model.fit(pairs.X, pairs.y)
        return FittedModel(kind, params, model, int(model.get_depth()))
    import lightgbm

    common = {
        "n_estimators": params["trees"],
        "max_depth": params["depth"],
        "num_leaves": params["leaves"],
        "min_child_samples": params["min_leaf"],
        "learning_rate": params["learning_rate"],
        "random_state": 0,
        "deterministic": True,
        "force_row_wise": True,
        "verbose": -1,
    }
    if kind == "gbdt":  # NGAME's target, as the single tree: T(φ) ≈ P(relevant), added to p̂
        model = lightgbm.LGBMRegressor(**common).fit(pairs.X, pairs.y)
    else:  # boosted from p̂: the ranking it optimises is the served p̂ + T(φ)
        rae_score = np.ascontiguousarray(pairs.X[:, features.index("rae_score")])
        model = lightgbm.LGBMRanker(objective="lambdarank", **common)
        model.fit(pairs.X, pairs.y.astype(np.int64), group=pairs.group_sizes(), init_score=rae_score)
    return FittedModel(kind, params, model)
