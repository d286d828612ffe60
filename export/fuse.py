"""Fit an RAE bundle's score fusion ((`engine/fusion.py`)) on a training run's held-out
instances, and write it as a derived bundle.

    python -m export.fuse --bundle bundles/debian-unidec --run runs/debian-unidec \\
        --data ../shared/data/debian-related --out bundles/debian-unidec-fused

The held-out instances (``<run>/holdout.txt``, written by a run with ``TrainParams.holdout``) are
searched as the service searches, against the memory without them by default
(``--held-out-memory``), twice each (their filter labels excluded, and not; ``--fit-on``), and
every candidate label becomes one pair (:mod:`export.held_out`). The fusion's model T is fitted
to the pairs (``--model``, :mod:`export.fusion_fit`), converted to ONNX and checked against its
library (:mod:`export.fusion_to_onnx`), and written into a derived bundle
(:func:`export.derive.derive_fused_bundle`). The served fusion keeps the whole memory's counts and
idf. The dev and test splits are never read.

By default the fusion is lexical (`engine/lexical.py`): the idf of the memory's texts
(its training instances and labels) is fitted here, every key's term vector is written beside the
fusion (one file per shard) and φ gains the lexical features. ``--extra-features`` adds the
cheap optional groups of :data:`engine.FEATURE_GROUPS`; ``studies.fusion_models``
says, on a validation split of the held-out instances, which of them and which model to use.

Candidate sources beside the memory's top b: ``--sparse-depth D`` (a sparse linear ranker's top D,
fitted here on the memory's texts and the labels' own) and ``--label-key-depth K`` (each query's
nearest K label keys of a search ``--label-key-fetch`` keys deeper than b: the label index as a
source). Each adds its features to φ, and the held-out searches are made as deep as the served ones.

The ensemble's size is chosen on the same held-out instances (``--sizes``, default
:data:`~export.fusion_fit.DEFAULT_SIZES`): each size is cross-fitted on 5 folds of them, as
``studies.fusion_models`` validated the default, and the best by validation P@1 and P@5 is fitted on
them all; the manifest's ``fusion.size_choice`` keeps every size's figures. A data set gets the
size its own held-out instances prefer, not the one Debian-Related's did. ``--trees`` or
``--leaves`` given: that size, unchosen.

``--rerank-depth M`` makes the fusion a two-stage ranking: T is fitted on, and at serving time
rescores, each search's top M candidates by p̂ only (the rest are not returned), so an ensemble's
cost is M rows a query, not every candidate.

The fused bundle stays in its source's lineage: it replays and appends to the source's append log
(``--appends-dir``, the server's XMCSERVE_APPEND_LOG_DIR; default: each bundle's
``<bundle>.appends/``, the fused bundle then beside its source).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import numpy as np
import scipy.sparse as sp

from bundle import (
    FUSION_MODEL_FILE,
    FusionModelKind,
    FusionParams,
    FusionSizeChoice,
    LabelKeysParams,
    Manifest,
    SparseRankerParams,
    lexical_file_names,
    read_manifest,
    shard_list,
)
from engine import AppendLogError, Predictor, load_predictor
from engine.offline import OPTIONAL_GROUPS, LabelKeySource, ScoreFusion, SparseRanker, carried_lineage
from export.derive import derive_fused_bundle
from export.fusion_fit import (
    DEFAULT_FUSION,
    DEFAULT_PARAMS,
    DEFAULT_SIZES,
    FittedModel,
    FuseError,
    fit_model,
    is_size,
    parse_size,
    size_name,
)
from export.fusion_to_onnx import onnx_fusion_model
from export.fusion_validation import CHOICE_FOLDS, SizeChoice, best_validation, choose_size, selection_score
from export.held_out import (
    DEFAULT_HELD_OUT_MEMORY,
    FITTED_ON,
    FitOn,
    HeldOutMemory,
    HeldOutSearch,
    SparseSpec,
    add_held_out_memory_option,
    unfitted_fusion,
)
from export.sparse_fit import SparseFitParams
from export.writer import refuse_existing
from xmc.checkpoint import HOLDOUT_FILE
from xmc.command import program
from xmc.data import XMCDataset, label_frequencies, load_jsonl_split, rows_of_uids

log = logging.getLogger("xmcserve.fuse")

__all__ = ["FuseError", "FuseParams", "FusionFit", "check_memory", "fit_fusion", "fuse_bundle", "main"]


@dataclass
class FuseParams:
    """How a fusion is fitted; the defaults fit the default fusion (:data:`~export.fusion_fit.DEFAULT_FUSION`).

    Attributes:
        model: the fusion's model T: ``tree`` (NGAME App. C), ``gbdt`` (LightGBM regression) or
            ``lambdarank`` (LambdaMART, each held-out search a group)
        model_params: the model's parameters given (``depth``, ``min_leaf``, ``trees``, ``leaves``,
            ``learning_rate``); the others are :data:`~export.fusion_fit.DEFAULT_PARAMS`'. One the
            model does not take is refused (:class:`FuseError`)
        groups: the feature groups of φ (:data:`engine.FEATURE_GROUPS`); ``lexical`` adds
            the key term files it reads
        rerank_depth: T is fitted on, and rescores, each search's top N candidates by p̂ only
            (None: every candidate)
        fit_on: the held-out searches T is fitted on: ``both`` (filter labels excluded, and not)
            or ``exclude`` only
        held_out_memory: the memory the held-out instances are searched against
            (:data:`export.held_out.HeldOutMemory`)
        sparse_depth: candidates a query gets from a sparse linear ranker over the lexical term
            space (:mod:`engine.sparse`), fitted here on the memory's texts; None: none
        sparse_fit: how that ranker is fitted (:class:`~export.sparse_fit.SparseFitParams`)
        label_key_depth: nearest label keys a query adds to the candidates (the label index as a
            source, :class:`~engine.fusion.LabelKeySource`); None: none
        label_key_fetch: keys its search fetches beyond the RAE top b for them
        sizes: the ensemble sizes (``trees`` and ``leaves`` over :attr:`model_params`, which then
            names neither) cross-validated on the held-out instances, the best fitted
            (:func:`export.fusion_validation.choose_size`; a tie keeps the first): each data set gets
            the size its own held-out instances prefer. None (the default): the default fusion's
            :data:`~export.fusion_fit.DEFAULT_SIZES` when the model is the default's and
            ``model_params`` names no size, none otherwise (:attr:`resolved_sizes`). One size,
            searches fitted on ``exclude`` only (the validation ranks both protocols) or too few
            held-out instances to fold: the first is fitted unchosen
    """

    model: FusionModelKind = DEFAULT_FUSION.model
    model_params: dict = field(default_factory=dict)
    groups: tuple[str, ...] = DEFAULT_FUSION.groups
    rerank_depth: int | None = DEFAULT_FUSION.rerank_depth
    fit_on: FitOn = "both"
    held_out_memory: HeldOutMemory = DEFAULT_HELD_OUT_MEMORY
    sparse_depth: int | None = DEFAULT_FUSION.sparse_depth
    sparse_fit: SparseFitParams = field(default_factory=SparseFitParams)
    label_key_depth: int | None = None
    label_key_fetch: int = 200
    sizes: tuple[dict, ...] | None = None

    def __post_init__(self) -> None:
        # checked here, before the bundle is loaded and its held-out instances searched
        unknown = set(self.model_params) - set(DEFAULT_PARAMS[self.model])
        if unknown:
            raise FuseError(f"--model {self.model} takes no {sorted(unknown)}")
        if self.sizes is not None:
            if self.sizes and self.model == "tree":
                raise FuseError("a single tree has no ensemble size to choose (--sizes)")
            if self.sizes and {"trees", "leaves"} & set(self.model_params):
                raise FuseError("give the ensemble's size by --trees / --leaves or by --sizes, not both")
            for size in self.sizes:
                if not is_size(size):
                    raise FuseError(f"an ensemble size is trees (at least 1) and leaves (at least 2), not {size}")
        if self.sparse_depth is not None and "lexical" not in self.groups:
            raise FuseError("a sparse ranker scores the lexical term space: it needs the lexical features")
        if ("sparse" in self.groups) and self.sparse_depth is None:
            raise FuseError("the sparse features come with a sparse ranker: give it a depth (--sparse-depth)")
        if self.sparse_depth is not None and self.sparse_depth < 1:
            raise FuseError(f"--sparse-depth must be at least 1 (0: no sparse ranker), not {self.sparse_depth}")
        if self.label_key_depth is not None and (self.label_key_depth < 1 or self.label_key_fetch < 0):
            raise FuseError("--label-key-depth must be at least 1 (0: none) and --label-key-fetch 0 or more")

    @property
    def feature_groups(self) -> tuple[str, ...]:
        """φ's groups: :attr:`groups`, ``sparse`` with a sparse ranker, ``label_keys`` with a
        label-key source."""
        sparse = self.sparse_depth is not None and "sparse" not in self.groups
        keys = self.label_key_depth is not None and "label_keys" not in self.groups
        return (*self.groups, *(("sparse",) if sparse else ()), *(("label_keys",) if keys else ()))

    @property
    def label_keys(self) -> LabelKeySource | None:
        depth = self.label_key_depth
        return LabelKeySource(depth, self.label_key_fetch) if depth is not None else None

    @property
    def sparse_spec(self) -> SparseSpec | None:
        return SparseSpec(self.sparse_depth, self.sparse_fit) if self.sparse_depth is not None else None

    @property
    def resolved_sizes(self) -> tuple[dict, ...]:
        """:attr:`sizes`, None resolved (resolved here, not at construction, so that a
        ``dataclasses.replace`` of the model or its parameters resolves it again)."""
        if self.sizes is not None:
            return tuple(self.sizes)
        default = self.model == DEFAULT_FUSION.model and not {"trees", "leaves"} & set(self.model_params)
        return DEFAULT_SIZES if default else ()

    @property
    def choosing(self) -> bool:
        """Whether the ensemble's size is chosen on the held-out instances (see :attr:`sizes`)."""
        return len(self.resolved_sizes) > 1 and self.fit_on == "both"

    @property
    def first_params(self) -> dict:
        """The model's parameters given, with the first size (what is fitted unchosen)."""
        sizes = self.resolved_sizes
        return self.model_params | (sizes[0] if sizes else {})


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
    size_choice: SizeChoice | None = None  # how the ensemble's size was chosen; None: as given
    params: FuseParams | None = None  # the parameters fitted (the ranker chosen among the candidates)
    dense_choice: dict = field(default_factory=dict)  # each dense weight tried -> its best validation


def fit_fusion(predictor: Predictor, train: XMCDataset, rows: np.ndarray, params: FuseParams) -> FusionFit:
    """Fit the fusion's model on the held-out instances ``rows`` of ``train`` (the bundle's memory
    split, searched against ``params.held_out_memory``) over the feature groups and the top rerank
    depth candidates of each search (``params``), convert it to ONNX and check it against its
    library (:class:`FuseError` if they differ). The fusion served keeps the whole memory's label
    counts and lexicon.

    When a size is chosen and the sparse ranker would weigh the dense vectors (one-vs-rest with a
    ``dense_weight``), the ranker without them is a candidate too (:func:`ranker_candidates`): each
    is fitted, its held-out pairs made and its sizes cross-fitted, and the best validation wins. The
    dense half helps where the memory's vectors do not already carry the labels (a pretrained
    encoder) and not always where training fitted the encoder to them; the held-out instances
    say which, never dev."""
    started = time.perf_counter()
    memory = params.held_out_memory
    best, tried = None, {}
    frequencies = label_frequencies(train.Y)
    for candidate in ranker_candidates(params, train.num_labels):
        served, key_rows = unfitted_fusion(
            predictor,
            train,
            candidate.feature_groups,
            candidate.rerank_depth,
            sparse=candidate.sparse_spec,
            label_keys=candidate.label_keys,
        )
        search = HeldOutSearch.of(predictor, train, rows, (served, key_rows), memory, candidate.sparse_fit)
        pairs = search.pairs(predictor, train, candidate.fit_on)
        model_params, size_choice = candidate.first_params, None
        if candidate.choosing:
            sizes = candidate.resolved_sizes
            size_choice = choose_size(
                candidate.model, candidate.model_params, sizes, pairs, served.features, frequencies, len(train)
            )
            model_params = size_choice.params
            if size_choice.validation:
                scores = {name: round(selection_score(v), 2) for name, v in size_choice.validation.items()}
                log.info("fusion size %s chosen on %d folds of the held-out instances (sparse dense weight %g): %s",
                         size_choice.chosen, size_choice.folds, candidate.sparse_fit.dense_weight, scores)  # fmt: skip
            else:
                log.info("%d held-out instances: too few to choose a size on, %s fitted", len(rows), size_choice.chosen)
        score = best_validation(size_choice.validation) if size_choice is not None else None
        if score is not None:
            tried[f"{candidate.sparse_fit.dense_weight:g}"] = round(score, 2)
        if best is None or (score is not None and best[0] is not None and score > best[0]):
            best = (score, candidate, served, key_rows, pairs, model_params, size_choice)
    score, chosen, served, key_rows, pairs, model_params, size_choice = best
    fitted = fit_model(chosen.model, pairs, served.features, model_params)
    model, parity = onnx_fusion_model(fitted, pairs.X)
    log.info("fusion %s fitted on %d pairs (%s); ONNX parity %.3g", chosen.model, len(pairs.y), memory, parity)
    fusion = dataclasses.replace(served, model=model)  # its counts, lexicon, features and sources as fitted
    seconds = time.perf_counter() - started
    return FusionFit(
        fusion,
        fitted,
        parity,
        key_rows,
        len(rows),
        len(pairs.y),
        pairs.found,
        seconds,
        size_choice=size_choice,
        params=chosen,
        dense_choice=tried if len(tried) > 1 else {},
    )


def ranker_candidates(params: FuseParams, labels: int) -> list[FuseParams]:
    """``params``, then (when a size is chosen and its sparse ranker weighs the dense vectors) the
    same fusion whose ranker reads the term vectors only: what :func:`fit_fusion` chooses between."""
    fit = params.sparse_fit
    if params.sparse_depth is None or not fit.dense_weight or fit.kind(labels) != "one_vs_rest" or not params.choosing:
        return [params]
    return [params, dataclasses.replace(params, sparse_fit=dataclasses.replace(fit, dense_weight=0.0))]


def check_memory(predictor: Predictor, train: XMCDataset) -> None:
    """The bundle's memory must be ``train`` as given: same labels, every instance a key in order
    (:class:`FuseError` if not)."""
    manifest = predictor.bundle.manifest
    if manifest.index_kind != "rae_memory":
        raise FuseError("score fusion needs an rae_memory bundle")
    if predictor.bundle.label_uids != list(train.labels.uids):
        raise FuseError("the bundle's labels are not the data's labels")
    if manifest.counts.train_instances != len(train):
        raise FuseError(
            f"the bundle's memory holds {manifest.counts.train_instances} instances, the split "
            f"{len(train)}: build it from the whole split (max_train 0)"
        )


def sparse_params(
    params: FuseParams,
    labels: int,
    fitted_on: str,
    ranker: SparseRanker | None = None,
    dense_choice: dict | None = None,
) -> SparseRankerParams | None:
    """The manifest's description of the sparse ranker ``params`` fit (None: no ranker);
    ``ranker``: the fitted one, whose dense weights' dimension it records; ``dense_choice``: the
    validation of each dense weight tried."""
    if params.sparse_depth is None:
        return None
    return SparseRankerParams(
        depth=params.sparse_depth,
        labels=labels,
        fit=params.sparse_fit.kind(labels),
        fit_params=params.sparse_fit.as_dict(),
        fitted_on=fitted_on,
        dense_dim=ranker.dense_dim if ranker is not None else 0,
        dense_choice=dense_choice or {},
    )


def manifest_size_choice(choice: SizeChoice | None) -> FusionSizeChoice | None:
    """The manifest's record of a size choice (None: no size was validated)."""
    if choice is None or not choice.validation:
        return None
    return FusionSizeChoice(
        folds=choice.folds,
        selection="the mean of cross-fitted validation P@1 and P@5 (filter_after, the peers' protocol); a tie "
        "keeps the first size",
        validation=choice.validation,
        chosen=choice.chosen,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("export.fuse"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bundle", type=Path, required=True, help="the rae_memory bundle to fuse")
    parser.add_argument("--run", type=Path, required=True, help=f"the training run whose {HOLDOUT_FILE} to fit on")
    parser.add_argument("--data", type=Path, required=True, help="dataset dir the bundle's memory was built from")
    parser.add_argument("--split", default="trn", help="the memory's split (default: trn)")
    parser.add_argument("--out", type=Path, required=True, help="the fused bundle dir to create")
    parser.add_argument(
        "--model",
        choices=get_args(FusionModelKind),
        default=DEFAULT_FUSION.model,
        help="the fusion's model: one regression tree (NGAME App. C), LightGBM regression GBDT, or LightGBM "
        f"lambdarank (LambdaMART, each held-out search a group); default {DEFAULT_FUSION.model}",
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
        "--sizes",
        type=parse_size,
        nargs="*",
        default=None,
        metavar="TREESxLEAVES",
        help=f"ensemble sizes cross-validated on {CHOICE_FOLDS} folds of the held-out instances, the best fitted; "
        "one: that size; none: the model's default size, unchosen (default for --model "
        f"{DEFAULT_FUSION.model}: {' '.join(size_name(size) for size in DEFAULT_SIZES)}, unless --trees or "
        "--leaves is given; not with them)",
    )
    parser.add_argument(
        "--rerank-depth",
        type=int,
        default=DEFAULT_FUSION.rerank_depth,
        help="fit on, and serve T over, each search's top N candidates by p̂ only; 0: every candidate "
        f"(default {DEFAULT_FUSION.rerank_depth or 0})",
    )
    parser.add_argument(
        "--extra-features",
        nargs="*",
        choices=[group for group in OPTIONAL_GROUPS if group != "lexical"],
        default=list(DEFAULT_FUSION.extra_groups),
        help="optional cheap feature groups to add to φ (engine.FEATURE_GROUPS); default "
        f"{' '.join(DEFAULT_FUSION.extra_groups) or 'none'}",
    )
    parser.add_argument(
        "--no-lexical",
        action="store_true",
        help="leave out the lexical features (and the key term files they read) and the sparse ranker, which "
        "searches the same term space: the tree reads the RAE features only",
    )
    parser.add_argument(
        "--sparse-depth",
        type=int,
        default=DEFAULT_FUSION.sparse_depth or 0,
        help="candidates a query gets from a sparse linear ranker over the lexical term space, fitted here "
        f"(engine.sparse); 0: none (default {DEFAULT_FUSION.sparse_depth or 0})",
    )
    parser.add_argument(
        "--sparse-dense-weight",
        type=float,
        default=SparseFitParams().dense_weight,
        help="a one-vs-rest sparse ranker's weight of each text's dense vector beside its term vector (0: term "
        f"vectors only; default {SparseFitParams().dense_weight:g})",
    )
    parser.add_argument(
        "--label-key-depth",
        type=int,
        default=0,
        help="nearest label keys a query adds to the candidates (the label index as a source); 0: none (default)",
    )
    parser.add_argument(
        "--label-key-fetch",
        type=int,
        default=200,
        help="keys the search fetches beyond the RAE top b for those label keys (default 200)",
    )
    parser.add_argument(
        "--fit-on",
        choices=get_args(FitOn),
        default="both",
        help="the held-out searches the model is fitted on: both (filter labels excluded, and not) or exclude only",
    )
    add_held_out_memory_option(parser)
    parser.add_argument("--force", action="store_true", help="replace an existing --out bundle")
    parser.add_argument(
        "--appends-dir",
        type=Path,
        default=None,
        help="directory of the append logs (the server's XMCSERVE_APPEND_LOG_DIR; default: each bundle's "
        "<bundle>.appends, the fused bundle then beside its source): it goes on in its source's log",
    )
    return parser


def params_of_arguments(args: argparse.Namespace) -> FuseParams:
    """The :class:`FuseParams` of the command line (model parameters not given default)."""
    given = {name: getattr(args, name) for name in ("depth", "min_leaf", "trees", "leaves", "learning_rate")}
    return FuseParams(
        model=args.model,
        model_params={name: value for name, value in given.items() if value is not None},
        groups=("rae", *(() if args.no_lexical else ("lexical",)), *args.extra_features),
        rerank_depth=args.rerank_depth or None,  # 0: every candidate
        fit_on=args.fit_on,
        held_out_memory=args.held_out_memory,
        sparse_depth=(args.sparse_depth or None) if not args.no_lexical else None,
        sparse_fit=SparseFitParams(dense_weight=args.sparse_dense_weight),
        label_key_depth=args.label_key_depth or None,
        label_key_fetch=args.label_key_fetch,
        sizes=None if args.sizes is None else tuple(args.sizes),  # None: FuseParams' rule
    )


def fuse_bundle(
    bundle: Path,
    run: Path,
    train: XMCDataset,
    out: Path,
    params: FuseParams | None = None,
    force: bool = False,
    appends_dir: Path | None = None,
) -> tuple[Manifest, FusionFit]:
    """``bundle`` with a fusion fitted as ``params`` say (default :class:`FuseParams`) on ``run``'s
    held-out instances of ``train`` (the bundle's memory split), written to ``out`` (``force``:
    replacing a bundle there), in ``bundle``'s lineage (its log found through ``appends_dir``:
    :func:`~engine.carried_lineage`). Raises :class:`FuseError` when the run has no
    held-out instances, the bundle's memory is not ``train``'s or the exported model does not
    score as its library does."""
    params = params or FuseParams()
    holdout = run / HOLDOUT_FILE
    if not holdout.is_file():
        raise FuseError(f"no {holdout}; train with holdout > 0 (TrainParams.holdout)")
    refuse_existing(out, force)
    carried_lineage(bundle, read_manifest(Path(bundle).resolve()), out, appends_dir)  # refused before the fit
    predictor = load_predictor(bundle)
    check_memory(predictor, train)
    rows = rows_of_uids(train, holdout.read_text().split())
    fit = fit_fusion(predictor, train, rows, params)
    params = fit.params or params  # the sparse ranker chosen on the held-out instances
    shards = shard_list(predictor.bundle.manifest)
    fitted_on = FITTED_ON[params.held_out_memory]
    fusion_params = FusionParams(
        model=FUSION_MODEL_FILE,
        kind=params.model,
        model_params=fit.fitted.params,
        parity_max_abs=fit.parity,
        features=list(fit.fusion.features),
        depth=fit.fitted.depth,
        rerank_depth=params.rerank_depth,
        fitted_on=f"{len(rows)} held-out training instances of {run} ({fitted_on}; searches: {params.fit_on})",
        queries=fit.queries,
        pairs=fit.pairs,
        lexical=lexical_file_names(len(shards)) if "lexical" in params.groups else None,
        sparse=sparse_params(
            params,
            len(train.labels),
            f"the memory's {len(train)} instances and the labels' texts",
            fit.fusion.sparse,
            fit.dense_choice,
        ),
        label_keys=LabelKeysParams(depth=params.label_key_depth, fetch=params.label_key_fetch)
        if params.label_key_depth is not None
        else None,
        size_choice=manifest_size_choice(fit.size_choice),
    )
    fused = derive_fused_bundle(bundle, out, fit.fusion, fusion_params, fit.key_terms, force, appends_dir)
    return fused, fit


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        params = params_of_arguments(args)
        train = load_jsonl_split(args.data, args.split)
        manifest, fit = fuse_bundle(args.bundle, args.run, train, args.out, params, args.force, args.appends_dir)
    except (FuseError, FileExistsError, AppendLogError) as exc:
        raise SystemExit(f"export.fuse: {exc}") from None
    summary = {
        "bundle": str(args.out),
        "bundle_id": manifest.bundle_id,
        "model": params.model,
        "model_params": fit.fitted.params,
        "rerank_depth": params.rerank_depth,
        "held_out_memory": params.held_out_memory,
        "onnx_parity_max_abs": fit.parity,
        "queries": fit.queries,
        "pairs": fit.pairs,
        "positives_among_candidates": round(fit.positives_found, 4),
        "features": list(fit.fusion.features),
        "size_choice": manifest.fusion.size_choice.model_dump() if manifest.fusion.size_choice else None,
        "seconds": round(fit.seconds, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
