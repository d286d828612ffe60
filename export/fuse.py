"""Fit an RAE bundle's score fusion (:mod:`service.engine.fusion`) on a training run's held-out
instances, and write it as a derived bundle.

    python -m export.fuse --bundle bundles/debian-unidec --run runs/debian-unidec \\
        --data ../shared/data/debian-related --out bundles/debian-unidec-fused

The held-out instances (``<run>/holdout.txt``, written by a run with ``TrainParams.holdout``)
were never trained on, but they are keys of the bundle's memory: each is searched through the
bundle's own encoder and index as a query with its own key removed (leave one out). Every
candidate label the search gives it becomes one pair (target 1 when the label is relevant), and a
regression tree (NGAME App. C: depth 7) is fitted to the pairs. The dev and test splits are never
read.

Each held-out instance is searched twice, as the service is called two ways: with its filter-file
labels excluded before aggregation (a caller's ``exclude``), and blind to them, its same-item
label key retrieved and taking its share of the softmax (the filter labels are then left out of
the pairs, as an evaluation that filters after ranking drops them). A tree fitted on both kinds of
pairs ranks both kinds of call (``--fit-on``).

By default the fusion is lexical (:mod:`service.engine.lexical`): the idf of the memory's texts
(its training instances and labels) is fitted here, every key's term vector is written beside the
fusion (one file per shard) and φ gains the lexical features.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import scipy.sparse as sp
from sklearn.tree import DecisionTreeRegressor

from export.derive import derive_fused_bundle
from export.writer import refuse_existing
from service.engine.fusion import RegressionTree, ScoreFusion, memory_log_frequency
from service.engine.lexical import KeyTerms, Lexicon
from service.engine.loading import load_predictor
from service.engine.manifest import TOKENIZER_FILE, FusionParams, Manifest, lexical_file_names, shard_list
from service.engine.rae import aggregate_kept, keep_keys
from service.engine.search import Predictor
from training.data import XMCDataset, load_jsonl_split, rows_of_uids
from training.params import HOLDOUT_FILE

log = logging.getLogger("xmcserve.fuse")

# Queries searched and featurised at once (bounds the key and feature arrays).
QUERY_BLOCK = 256
# Which searches of the held-out instances the tree is fitted on (see the module docstring).
FitOn = Literal["both", "exclude"]


@dataclass
class FusionFit:
    """The fitted fusion (with its keys' term vectors when lexical) and what it was fitted on."""

    fusion: ScoreFusion
    key_terms: sp.csr_matrix | None
    queries: int
    pairs: int
    positives_found: float  # share of the queries' relevant labels among their candidates
    seconds: float


def leave_one_out(keys: np.ndarray, sims: np.ndarray, own_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's keys and similarities without its own key (order kept, −1 / 0 padding at the end)."""
    kept_keys = np.full((len(keys), keys.shape[1] - 1), -1, dtype=keys.dtype)
    kept_sims = np.zeros((len(keys), keys.shape[1] - 1), dtype=sims.dtype)
    for i, own in enumerate(own_keys):
        mask = keys[i] != own
        row_keys, row_sims = keys[i][mask][: kept_keys.shape[1]], sims[i][mask][: kept_keys.shape[1]]
        kept_keys[i, : len(row_keys)], kept_sims[i, : len(row_sims)] = row_keys, row_sims
    return kept_keys, kept_sims


def pairs_of(
    predictor: Predictor,
    train: XMCDataset,
    rows: np.ndarray,
    unfitted: ScoreFusion,
    key_terms: KeyTerms | None,
    excluding: bool,
):
    """φ (``unfitted.features``) and targets of every (held-out instance, candidate label) pair,
    searched as the service searches (``rows``: the instances, which are also keys ``rows`` of
    the memory), with their filter labels excluded or (``excluding`` False) left out of the pairs."""
    manifest, view = predictor.bundle.manifest, predictor.view
    rae, filters = manifest.rae, train.filter_sets()
    features, targets, found = [], [], 0.0
    for start in range(0, len(rows), QUERY_BLOCK):
        block = rows[start : start + QUERY_BLOCK]
        texts = [train.texts[r] for r in block]
        excluded = [filters[r] if excluding else set() for r in block]
        vectors, _ = predictor.bundle.encoder.encode(texts)
        widest = max(len(e) for e in excluded)
        keys, sims, _ = predictor.knn(vectors, rae.top_b + widest + 1, None)
        keys, sims = leave_one_out(keys, sims, block)
        lexical = None
        if unfitted.lexicon is not None:
            lexical = key_terms.similarities(unfitted.lexicon.query_terms(texts), keys)
        kept = keep_keys(keys, sims, view.labels_of_keys(keys), excluded, rae.top_b, lexical)
        scores = aggregate_kept(kept, view.values, rae.tau, excluded, rae.mode)
        X = unfitted.features_of(scores, kept, view.values, rae.tau)
        offset = 0
        for i, row in enumerate(block):
            candidates = scores.indices[scores.indptr[i] : scores.indptr[i + 1]]
            scored = ~np.isin(candidates, list(filters[row]))  # a filter label is never a pair
            relevant = np.setdiff1d(train.Y[row].indices, list(filters[row]))
            hits = np.isin(candidates[scored], relevant)
            found += hits.sum() / max(len(relevant), 1)
            features.append(X[offset : offset + len(candidates)][scored])
            targets.append(hits.astype(np.float64))
            offset += len(candidates)
    return np.concatenate(features), np.concatenate(targets), found / len(rows)


def fit_fusion(
    predictor: Predictor,
    train: XMCDataset,
    rows: np.ndarray,
    depth: int = 7,
    min_leaf: int = 50,
    seed: int = 0,
    lexical: bool = True,
    fit_on: FitOn = "both",
) -> FusionFit:
    """Fit the fusion tree on the held-out instances ``rows`` of ``train`` (the bundle's memory
    split); ``lexical``: with the lexicon of the memory's texts and the lexical features."""
    started = time.perf_counter()
    bundle = predictor.bundle
    manifest = bundle.manifest
    log_frequency = memory_log_frequency(bundle.values, manifest.counts.train_instances)
    lexicon, key_rows = None, None
    if lexical:
        texts = list(train.texts) + list(bundle.label_texts)  # the memory's keys, in key order
        lexicon = Lexicon.fit(bundle.path / TOKENIZER_FILE, manifest.tokenizer.max_length, texts)
        key_rows = lexicon.rows(texts)
    unfitted = ScoreFusion(RegressionTree.constant(0.0), log_frequency, lexicon)
    key_terms = KeyTerms(key_rows) if key_rows is not None else None
    parts = [
        pairs_of(predictor, train, rows, unfitted, key_terms, excluding)
        for excluding in ((True, False) if fit_on == "both" else (True,))
    ]
    X, y = np.concatenate([part[0] for part in parts]), np.concatenate([part[1] for part in parts])
    model = DecisionTreeRegressor(max_depth=depth, min_samples_leaf=min_leaf, random_state=seed).fit(X, y)
    t = model.tree_
    tree = RegressionTree(
        feature=t.feature.astype(np.int64),
        threshold=t.threshold.astype(np.float64),
        left=t.children_left.astype(np.int64),
        right=t.children_right.astype(np.int64),
        value=t.value[:, 0, 0].astype(np.float64),
    )
    fusion = ScoreFusion(tree, log_frequency, lexicon)
    return FusionFit(fusion, key_rows, len(rows), len(y), float(parts[0][2]), time.perf_counter() - started)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True, help="the rae_memory bundle to fuse")
    parser.add_argument("--run", type=Path, required=True, help=f"the training run whose {HOLDOUT_FILE} to fit on")
    parser.add_argument("--data", type=Path, required=True, help="dataset dir the bundle's memory was built from")
    parser.add_argument("--split", default="trn", help="the memory's split (default: trn)")
    parser.add_argument("--out", type=Path, required=True, help="the fused bundle dir to create")
    parser.add_argument("--depth", type=int, default=7, help="regression tree depth (NGAME App. C: 7)")
    parser.add_argument("--min-leaf", type=int, default=50, help="fewest pairs in a leaf of the tree")
    parser.add_argument(
        "--no-lexical",
        action="store_true",
        help="leave out the lexical features (and the key term files they read): the tree reads the RAE features only",
    )
    parser.add_argument(
        "--fit-on",
        choices=get_args(FitOn),
        default="both",
        help="the held-out searches the tree is fitted on: both (filter labels excluded, and not) or exclude only",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out bundle")
    return parser


def fuse_bundle(
    bundle: Path,
    run: Path,
    train: XMCDataset,
    out: Path,
    depth: int = 7,
    min_leaf: int = 50,
    force: bool = False,
    lexical: bool = True,
    fit_on: FitOn = "both",
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
    fit = fit_fusion(predictor, train, rows, depth, min_leaf, lexical=lexical, fit_on=fit_on)
    shards = shard_list(predictor.bundle.manifest)
    params = FusionParams(
        features=list(fit.fusion.features),
        depth=fit.fusion.tree.depth,
        fitted_on=f"{len(rows)} held-out training instances of {run} (leave one out; searched: {fit_on})",
        queries=fit.queries,
        pairs=fit.pairs,
        lexical=lexical_file_names(len(shards)) if lexical else None,
    )
    return derive_fused_bundle(bundle, out, fit.fusion, params, fit.key_terms, force), fit


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    train = load_jsonl_split(args.data, args.split)
    manifest, fit = fuse_bundle(
        args.bundle,
        args.run,
        train,
        args.out,
        args.depth,
        args.min_leaf,
        args.force,
        lexical=not args.no_lexical,
        fit_on=args.fit_on,
    )
    summary = {
        "bundle": str(args.out),
        "bundle_id": manifest.bundle_id,
        "queries": fit.queries,
        "pairs": fit.pairs,
        "positives_among_candidates": round(fit.positives_found, 4),
        "features": list(fit.fusion.features),
        "tree_nodes": len(fit.fusion.tree.value),
        "seconds": round(fit.seconds, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
