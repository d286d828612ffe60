"""Fit an RAE bundle's score fusion ((`service/engine/fusion.py`)) on a training run's held-out
instances, and write it as a derived bundle.

    python -m export.fuse --bundle bundles/debian-unidec --run runs/debian-unidec \\
        --data ../shared/data/debian-related --out bundles/debian-unidec-fused

The held-out instances (``<run>/holdout.txt``, written by a run with ``TrainParams.holdout``)
were never trained on, but they are keys of the bundle's memory. Each is searched through the
bundle's own encoder and index as a query, against the memory **without any held-out instance**
(``--held-out-memory without_holdout``, the default): their keys are never returned, and the
label counts and the lexicon's idf are those of the memory without them. A held-out query then
meets the memory as a dev or live query does, which is not in it: none of its labels is counted
for it, and a label only held-out instances carry looks as unseen as a dev query's zero-shot
label. ``leave_one_out`` searches the whole memory less each query's own key, as before; its
counts include the query itself, and boosted models learnt that (docs/score-fusion.md). The
served fusion keeps the whole memory's counts and idf. Every candidate label the search gives a
query becomes one pair (target 1 when the label is relevant), and the fusion's model T is fitted
to the pairs (``--model``): one regression tree (NGAME App. C: depth 7, scikit-learn),
gradient-boosted regression trees (LightGBM) or LambdaMART (LightGBM lambdarank, each search of a
held-out instance a group, boosted from p̂ so that p̂ + T is what it ranks by). The dev and test
splits are never read.

T is converted by the maintained converter of its library (skl2onnx, onnxmltools) into an
ai.onnx.ml TreeEnsemble ONNX model, ``fusion.onnx``, which the service runs with ONNX Runtime.
φ is cast to float32, the precision the service scores at, before the fit, and the export checks
ONNX Runtime's scores of every pair against the library's own (the max |difference| goes into the
manifest; above :data:`PARITY_BOUND` the export is refused).

Each held-out instance is searched twice, as the service is called two ways: with its filter-file
labels excluded before aggregation (a caller's ``exclude``), and blind to them, its same-item
label key retrieved and taking its share of the softmax (the filter labels are then left out of
the pairs, as an evaluation that filters after ranking drops them). A tree fitted on both kinds of
pairs ranks both kinds of call (``--fit-on``).

By default the fusion is lexical (`service/engine/lexical.py`): the idf of the memory's texts
(its training instances and labels) is fitted here, every key's term vector is written beside the
fusion (one file per shard) and φ gains the lexical features. ``--extra-features`` adds the
cheap optional groups of :data:`service.engine.FEATURE_GROUPS`; ``bench.fusion_models``
says, on a validation split of the held-out instances, which of them and which model to use.

``--rerank-depth M`` makes the fusion a two-stage ranking: T is fitted on, and at serving time
rescores, each search's top M candidates by p̂ only (the rest are not returned), so an ensemble's
cost is M rows a query, not every candidate.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import scipy.sparse as sp

from export.derive import derive_fused_bundle
from export.writer import refuse_existing
from service.engine import (
    FUSION_MODEL_FILE,
    OPTIONAL_GROUPS,
    TOKENIZER_FILE,
    FusionModelKind,
    FusionParams,
    KeyTerms,
    Lexicon,
    Manifest,
    Neighbours,
    OnnxTreeEnsemble,
    Predictor,
    ScoreFusion,
    features_of_groups,
    lexical_file_names,
    load_predictor,
    memory_log_frequency,
    rank_batch,
    shard_list,
)
from xmc.checkpoint import HOLDOUT_FILE
from xmc.data import XMCDataset, load_jsonl_split, rows_of_uids

log = logging.getLogger("xmcserve.fuse")

# Queries searched and featurised at once (bounds the key and feature arrays).
QUERY_BLOCK = 256
# Which searches of the held-out instances the model is fitted on (see the module docstring).
FitOn = Literal["both", "exclude"]
# What memory the held-out instances are searched against: the memory without any of them (as a
# dev or live query meets it), or the whole memory less each query's own key (module docstring).
HeldOutMemory = Literal["without_holdout", "leave_one_out"]
DEFAULT_HELD_OUT_MEMORY: HeldOutMemory = "without_holdout"
# how a manifest's fusion.fitted_on names each
FITTED_ON = {"without_holdout": "searched against the memory without them", "leave_one_out": "leave one out"}
# Keys fetched beyond the share the hidden keys are expected to take of a search's neighbours;
# a search that still comes short is fetched again, twice as wide.
HIDDEN_FETCH_MARGIN = 1.25
# The most |ONNX Runtime − fitting library| an exported model may differ by on its pairs: float32
# sums of leaf values, far below any difference between two candidates' fused scores that matters.
PARITY_BOUND = 1e-4
# ai.onnx.ml opset 3 / ONNX opset 15: what skl2onnx and onnxmltools both write TreeEnsembleRegressor in
ONNX_OPSETS = {"": 15, "ai.onnx.ml": 3}
# The default fusion: bench.fusion_models' choice on the CPU recipe's held-out instances, searched
# against the memory without them, among the models the fusion's bill leaves room for (at most
# 0.15 ms a query in ONNX Runtime; docs/score-fusion.md): LambdaMART (60 trees, 15 leaves) over the
# RAE and lexical features, rescoring each query's top 200 by p̂. No optional group added enough.
DEFAULT_MODEL: FusionModelKind = "lambdarank"
DEFAULT_RERANK_DEPTH: int | None = 200
DEFAULT_EXTRA_FEATURES: tuple[str, ...] = ()
DEFAULT_GROUPS: tuple[str, ...] = ("rae", "lexical", *DEFAULT_EXTRA_FEATURES)
DEFAULT_PARAMS: dict[str, dict] = {
    "tree": {"depth": 7, "min_leaf": 50},
    "gbdt": {"trees": 100, "depth": 6, "leaves": 31, "min_leaf": 20, "learning_rate": 0.1},
    "lambdarank": {"trees": 60, "depth": 6, "leaves": 15, "min_leaf": 20, "learning_rate": 0.1},
}


@dataclass
class HeldOutPairs:
    """Every (held-out search, candidate label) pair: φ (float32 values), the target, which
    search (``query``, numbered from 0, pairs of a search contiguous) and which label it is, and
    each search's relevant labels (its filter labels left out)."""

    X: np.ndarray
    y: np.ndarray
    query: np.ndarray
    labels: np.ndarray
    relevant: list[np.ndarray]
    found: float  # share of the relevant labels among the candidates, over the searches

    @classmethod
    def joined(cls, parts: list[HeldOutPairs]) -> HeldOutPairs:
        offsets = np.cumsum([0] + [len(part.relevant) for part in parts])
        return cls(
            X=np.concatenate([part.X for part in parts]),
            y=np.concatenate([part.y for part in parts]),
            query=np.concatenate([part.query + offset for part, offset in zip(parts, offsets, strict=False)]),
            labels=np.concatenate([part.labels for part in parts]),
            relevant=[r for part in parts for r in part.relevant],
            found=float(np.mean([part.found for part in parts])),
        )

    def subset(self, searches: np.ndarray) -> HeldOutPairs:
        """The pairs of ``searches`` (renumbered in that order)."""
        searches = np.sort(searches)
        at = np.isin(self.query, searches)
        return HeldOutPairs(
            X=self.X[at],
            y=self.y[at],
            query=np.searchsorted(searches, self.query[at]),
            labels=self.labels[at],
            relevant=[self.relevant[q] for q in searches],
            found=self.found,
        )

    def group_sizes(self) -> np.ndarray:
        """Pairs per search, in order, searches without a candidate left out (LightGBM's ``group``)."""
        sizes = np.bincount(self.query, minlength=len(self.relevant))
        return sizes[sizes > 0]


def without_keys(keys: np.ndarray, sims: np.ndarray, dropped: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's keys and similarities less the ``dropped`` ones (a mask of ``keys``' shape),
    order kept, ``width`` wide (−1 / 0 padding at the end)."""
    kept_keys = np.full((len(keys), width), -1, dtype=keys.dtype)
    kept_sims = np.zeros((len(keys), width), dtype=sims.dtype)
    for i in range(len(keys)):
        mask = ~dropped[i]
        row_keys, row_sims = keys[i][mask][:width], sims[i][mask][:width]
        kept_keys[i, : len(row_keys)], kept_sims[i, : len(row_sims)] = row_keys, row_sims
    return kept_keys, kept_sims


def leave_one_out(keys: np.ndarray, sims: np.ndarray, own_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's keys and similarities without its own key (order kept, −1 / 0 padding at the end)."""
    return without_keys(keys, sims, keys == own_keys[:, None], keys.shape[1] - 1)


def search_without(
    predictor: Predictor, vectors: np.ndarray, width: int, own: np.ndarray | None, hidden: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The ``width`` nearest keys of ``vectors`` (best first, with similarities) that are neither a
    query's ``own`` key (None: no query is a key) nor one of the ``hidden`` keys (sorted; None:
    none): the search of a memory that lacks them. Fetched wider than ``width`` by the hidden keys'
    share of the memory, and again twice as wide for as long as a search comes short."""
    total = predictor.view.num_keys
    share = len(hidden) / total if hidden is not None else 0.0
    fetch = min(total, int(np.ceil((width + 1) * HIDDEN_FETCH_MARGIN / max(1.0 - share, 1e-3))) if share else width + 1)
    while True:
        keys, sims, _ = predictor.knn(vectors, fetch, None)
        dropped = np.isin(keys, hidden) if hidden is not None else np.zeros(keys.shape, dtype=bool)
        if own is not None:
            dropped |= keys == own[:, None]
        kept_keys, kept_sims = without_keys(keys, sims, dropped, width)
        short = (kept_keys[:, -1] < 0) & (keys[:, -1] >= 0)  # fewer than width left, more in the memory
        if not short.any() or fetch >= total:
            return kept_keys, kept_sims
        fetch = min(total, 2 * fetch)


def pairs_of(
    predictor: Predictor,
    train: XMCDataset,
    rows: np.ndarray,
    unfitted: ScoreFusion,
    key_terms: KeyTerms | None,
    excluding: bool,
    in_memory: bool = True,
    hidden: np.ndarray | None = None,
) -> HeldOutPairs:
    """φ (``unfitted.features``) and targets of every (held-out instance, candidate label) pair,
    searched as the service searches (``rows``: the instances of ``train``, which are also keys
    ``rows`` of the memory, left out of their own search; ``in_memory`` False: instances of
    another split, such as dev, which are not; ``hidden``: memory keys no search returns, as if
    the memory lacked them), with their filter labels excluded or (``excluding`` False) left out
    of the pairs."""
    manifest, view = predictor.bundle.manifest, predictor.view
    rae, filters = manifest.rae, train.filter_sets()
    features, targets, queries, labels, relevant_of, found = [], [], [], [], [], 0.0
    for start in range(0, len(rows), QUERY_BLOCK):
        block = rows[start : start + QUERY_BLOCK]
        texts = [train.texts[r] for r in block]
        excluded = [filters[r] if excluding else set() for r in block]
        vectors, _ = predictor.bundle.encoder.encode(texts)
        widest = max(len(e) for e in excluded)
        keys, sims = search_without(predictor, vectors, rae.top_b + widest, block if in_memory else None, hidden)
        lexical = None
        if unfitted.lexicon is not None:
            lexical = key_terms.similarities(unfitted.lexicon.query_terms(texts), keys)
        found = Neighbours(keys, sims, view.labels_of_keys(keys), view.values, lexical, ef=0)
        # the candidates T will rescore when served (the top rerank depth by p̂, or all) and their φ
        rows_of_block = rank_batch(manifest, found, None, excluded, unfitted, feature_rows=True)
        scores, X = rows_of_block.candidates, rows_of_block.features
        offset = 0
        for i, row in enumerate(block):
            candidates = scores.indices[scores.indptr[i] : scores.indptr[i + 1]]
            scored = ~np.isin(candidates, list(filters[row]))  # a filter label is never a pair
            relevant = np.setdiff1d(train.Y[row].indices, list(filters[row]))
            hits = np.isin(candidates[scored], relevant)
            found += hits.sum() / max(len(relevant), 1)
            features.append(X[offset : offset + len(candidates)][scored])
            targets.append(hits.astype(np.float64))
            queries.append(np.full(int(scored.sum()), start + i, dtype=np.int64))
            labels.append(candidates[scored])
            relevant_of.append(relevant)
            offset += len(candidates)
    return HeldOutPairs(
        # the precision the service scores φ at: the model is fitted on the values it will see
        X=np.concatenate(features).astype(np.float32).astype(np.float64),
        y=np.concatenate(targets),
        query=np.concatenate(queries),
        labels=np.concatenate(labels),
        relevant=relevant_of,
        found=found / len(rows),
    )


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
        raise SystemExit(f"export.fuse: the converter wrote {ops}, not an ai.onnx.ml TreeEnsembleRegressor")
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
        raise SystemExit(
            f"export.fuse: the ONNX {fitted.kind} scores the pairs up to {parity:.3g} away from "
            f"{type(fitted.library_model).__name__}'s own (bound {PARITY_BOUND})"
        )
    return model, parity


@dataclass
class FusionFit:
    """The fitted fusion (with its keys' term vectors when lexical) and what it was fitted on."""

    fusion: ScoreFusion
    fitted: FittedModel
    parity: float  # max |ONNX Runtime − library| over the pairs
    key_terms: sp.csr_matrix | None
    queries: int
    pairs: int
    positives_found: float  # share of the queries' relevant labels among their candidates
    seconds: float
    extra: dict = field(default_factory=dict)


def unfitted_fusion(
    predictor: Predictor,
    train: XMCDataset,
    groups: tuple[str, ...],
    rerank_depth: int | None = None,
    hidden: np.ndarray | None = None,
) -> tuple[ScoreFusion, sp.csr_matrix | None]:
    """The fusion's features over ``predictor``'s memory, before a model (``groups``: its
    feature groups; with ``lexical``, the lexicon of the memory's texts; ``rerank_depth``: the
    candidates it rescores; ``hidden``: instance rows of the memory to count and fit the lexicon
    without, as if it lacked them), and the keys' term vectors of a lexical one."""
    bundle = predictor.bundle
    num_train = bundle.manifest.counts.train_instances
    counted = np.setdiff1d(np.arange(num_train), hidden if hidden is not None else [])
    log_frequency = memory_log_frequency(bundle.values[counted], len(counted))
    lexicon, key_rows = None, None
    if "lexical" in groups:
        texts = list(train.texts) + list(bundle.label_texts)  # the memory's keys, in key order
        seen = [train.texts[r] for r in counted] + list(bundle.label_texts)
        lexicon = Lexicon.fit(bundle.path / TOKENIZER_FILE, bundle.manifest.tokenizer.max_length, seen)
        key_rows = lexicon.rows(texts)
    return ScoreFusion(None, log_frequency, lexicon, features_of_groups(groups), rerank_depth), key_rows


@dataclass
class HeldOutSearch:
    """How the held-out instances ``rows`` are searched and featurised: the unfitted fusion
    whose counts and lexicon φ is computed with, its keys' term vectors, and the hidden keys."""

    rows: np.ndarray
    unfitted: ScoreFusion
    key_terms: KeyTerms | None
    hidden: np.ndarray | None

    @classmethod
    def of(
        cls,
        predictor: Predictor,
        train: XMCDataset,
        rows: np.ndarray,
        served: tuple[ScoreFusion, sp.csr_matrix | None],
        memory: HeldOutMemory = DEFAULT_HELD_OUT_MEMORY,
    ) -> HeldOutSearch:
        """The search of ``rows`` against ``memory``, whose features are those of ``served`` (an
        :func:`unfitted_fusion` of the whole memory and its key rows, used as they are when no key
        is hidden)."""
        unfitted, key_rows = served
        hidden = None
        if memory == "without_holdout":
            hidden = np.sort(rows)
            unfitted, key_rows = unfitted_fusion(predictor, train, unfitted.groups, unfitted.rerank_depth, hidden)
        return cls(rows, unfitted, KeyTerms(key_rows) if key_rows is not None else None, hidden)

    def pairs(self, predictor: Predictor, train: XMCDataset, fit_on: FitOn) -> HeldOutPairs:
        """The pairs of both kinds of search of the rows (or the excluding one alone)."""
        searches = (True, False) if fit_on == "both" else (True,)
        return HeldOutPairs.joined(
            [
                pairs_of(predictor, train, self.rows, self.unfitted, self.key_terms, e, hidden=self.hidden)
                for e in searches
            ]
        )


def fit_fusion(
    predictor: Predictor,
    train: XMCDataset,
    rows: np.ndarray,
    kind: FusionModelKind = DEFAULT_MODEL,
    params: dict | None = None,
    groups: tuple[str, ...] = DEFAULT_GROUPS,
    fit_on: FitOn = "both",
    rerank_depth: int | None = DEFAULT_RERANK_DEPTH,
    memory: HeldOutMemory = DEFAULT_HELD_OUT_MEMORY,
) -> FusionFit:
    """Fit the fusion's model on the held-out instances ``rows`` of ``train`` (the bundle's memory
    split, searched against ``memory``) over the feature ``groups`` and the top ``rerank_depth``
    candidates of each search (None: all), convert it to ONNX and check it against its library.
    The fusion served keeps the whole memory's label counts and lexicon."""
    started = time.perf_counter()
    served, key_rows = unfitted_fusion(predictor, train, groups, rerank_depth)
    search = HeldOutSearch.of(predictor, train, rows, (served, key_rows), memory)
    pairs = search.pairs(predictor, train, fit_on)
    fitted = fit_model(kind, pairs, served.features, params)
    model, parity = onnx_fusion_model(fitted, pairs.X)
    log.info("fusion %s fitted on %d pairs (%s); ONNX parity %.3g", kind, len(pairs.y), memory, parity)
    fusion = ScoreFusion(model, served.log_frequency, served.lexicon, served.features, rerank_depth)
    return FusionFit(
        fusion, fitted, parity, key_rows, len(rows), len(pairs.y), pairs.found, time.perf_counter() - started
    )


def check_memory(predictor: Predictor, train: XMCDataset) -> None:
    """The bundle's memory must be ``train`` as given: same labels, every instance a key in order."""
    manifest = predictor.bundle.manifest
    if manifest.index_kind != "rae_memory":
        raise SystemExit("export.fuse: score fusion needs an rae_memory bundle")
    if predictor.bundle.label_uids != list(train.labels.uids):
        raise SystemExit("export.fuse: the bundle's labels are not the data's labels")
    if manifest.counts.train_instances != len(train):
        raise SystemExit(
            f"export.fuse: the bundle's memory holds {manifest.counts.train_instances} instances, the split "
            f"{len(train)}: build it from the whole split (max_train 0)"
        )


def add_held_out_memory_option(parser: argparse.ArgumentParser, flag: str = "--held-out-memory") -> None:
    """The option that says what the held-out instances are searched against (every CLI that fits
    or measures a fusion on them takes it)."""
    parser.add_argument(
        flag,
        choices=get_args(HeldOutMemory),
        default=DEFAULT_HELD_OUT_MEMORY,
        help="what the held-out instances are searched against: the memory without any of them (its counts and "
        "idf too), as a dev query meets it, or the whole memory less each query's own key; default "
        f"{DEFAULT_HELD_OUT_MEMORY}",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="the rae_memory bundle to fuse")
    parser.add_argument("--run", type=Path, required=True, help=f"the training run whose {HOLDOUT_FILE} to fit on")
    parser.add_argument("--data", type=Path, required=True, help="dataset dir the bundle's memory was built from")
    parser.add_argument("--split", default="trn", help="the memory's split (default: trn)")
    parser.add_argument("--out", type=Path, required=True, help="the fused bundle dir to create")
    parser.add_argument(
        "--model",
        choices=get_args(FusionModelKind),
        default=DEFAULT_MODEL,
        help="the fusion's model: one regression tree (NGAME App. C), LightGBM regression GBDT, or LightGBM "
        f"lambdarank (LambdaMART, each held-out search a group); default {DEFAULT_MODEL}",
    )
    parser.add_argument("--depth", type=int, help="max depth of the tree(s) (default: tree 7, ensembles 6)")
    parser.add_argument("--min-leaf", type=int, help="fewest pairs in a leaf (default: tree 50, ensembles 20)")
    parser.add_argument(
        "--trees",
        type=int,
        help=f"boosting rounds of gbdt / lambdarank (default {DEFAULT_PARAMS['gbdt']['trees']} / "
        f"{DEFAULT_PARAMS['lambdarank']['trees']})",
    )
    parser.add_argument(
        "--leaves",
        type=int,
        help=f"max leaves per tree of gbdt / lambdarank (default {DEFAULT_PARAMS['gbdt']['leaves']} / "
        f"{DEFAULT_PARAMS['lambdarank']['leaves']})",
    )
    parser.add_argument("--learning-rate", type=float, help="shrinkage of gbdt / lambdarank (default 0.1)")
    parser.add_argument(
        "--rerank-depth",
        type=int,
        default=DEFAULT_RERANK_DEPTH,
        help="fit on, and serve T over, each search's top N candidates by p̂ only; 0: every candidate "
        f"(default {DEFAULT_RERANK_DEPTH or 0})",
    )
    parser.add_argument(
        "--extra-features",
        nargs="*",
        choices=[group for group in OPTIONAL_GROUPS if group != "lexical"],
        default=list(DEFAULT_EXTRA_FEATURES),
        help="optional cheap feature groups to add to φ (service.engine.FEATURE_GROUPS); default "
        f"{' '.join(DEFAULT_EXTRA_FEATURES) or 'none'}",
    )
    parser.add_argument(
        "--no-lexical",
        action="store_true",
        help="leave out the lexical features (and the key term files they read): the tree reads the RAE features only",
    )
    parser.add_argument(
        "--fit-on",
        choices=get_args(FitOn),
        default="both",
        help="the held-out searches the model is fitted on: both (filter labels excluded, and not) or exclude only",
    )
    add_held_out_memory_option(parser)
    parser.add_argument("--force", action="store_true", help="replace an existing --out bundle")
    return parser


def model_params(args: argparse.Namespace) -> dict:
    """The model parameters given on the command line (the others default)."""
    given = {name: getattr(args, name) for name in ("depth", "min_leaf", "trees", "leaves", "learning_rate")}
    params = {name: value for name, value in given.items() if value is not None}
    unknown = set(params) - set(DEFAULT_PARAMS[args.model])
    if unknown:
        raise SystemExit(f"export.fuse: --model {args.model} takes no {sorted(unknown)}")
    return params


def fuse_bundle(
    bundle: Path,
    run: Path,
    train: XMCDataset,
    out: Path,
    kind: FusionModelKind = DEFAULT_MODEL,
    params: dict | None = None,
    force: bool = False,
    groups: tuple[str, ...] = DEFAULT_GROUPS,
    fit_on: FitOn = "both",
    rerank_depth: int | None = DEFAULT_RERANK_DEPTH,
    memory: HeldOutMemory = DEFAULT_HELD_OUT_MEMORY,
) -> tuple[Manifest, FusionFit]:
    """``bundle`` with a fusion fitted on ``run``'s held-out instances of ``train`` (the bundle's
    memory split), written to ``out``."""
    holdout = run / HOLDOUT_FILE
    if not holdout.is_file():
        raise SystemExit(f"export.fuse: no {holdout}; train with holdout > 0 (TrainParams.holdout)")
    refuse_existing(out, force)
    predictor = load_predictor(bundle)
    check_memory(predictor, train)
    rows = rows_of_uids(train, holdout.read_text().split())
    fit = fit_fusion(predictor, train, rows, kind, params, groups, fit_on, rerank_depth, memory)
    shards = shard_list(predictor.bundle.manifest)
    fusion_params = FusionParams(
        model=FUSION_MODEL_FILE,
        kind=kind,
        model_params=fit.fitted.params,
        parity_max_abs=fit.parity,
        features=list(fit.fusion.features),
        depth=fit.fitted.depth,
        rerank_depth=rerank_depth,
        fitted_on=f"{len(rows)} held-out training instances of {run} ({FITTED_ON[memory]}; searches: {fit_on})",
        queries=fit.queries,
        pairs=fit.pairs,
        lexical=lexical_file_names(len(shards)) if "lexical" in groups else None,
    )
    return derive_fused_bundle(bundle, out, fit.fusion, fusion_params, fit.key_terms, force), fit


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = model_params(args)
    groups = ("rae", *(() if args.no_lexical else ("lexical",)), *args.extra_features)
    rerank_depth = args.rerank_depth or None  # 0: every candidate
    train = load_jsonl_split(args.data, args.split)
    manifest, fit = fuse_bundle(
        args.bundle,
        args.run,
        train,
        args.out,
        args.model,
        params,
        args.force,
        groups,
        args.fit_on,
        rerank_depth,
        args.held_out_memory,
    )
    summary = {
        "bundle": str(args.out),
        "bundle_id": manifest.bundle_id,
        "model": args.model,
        "model_params": fit.fitted.params,
        "rerank_depth": rerank_depth,
        "held_out_memory": args.held_out_memory,
        "onnx_parity_max_abs": fit.parity,
        "queries": fit.queries,
        "pairs": fit.pairs,
        "positives_among_candidates": round(fit.positives_found, 4),
        "features": list(fit.fusion.features),
        "seconds": round(fit.seconds, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
