"""The held-out instances of a training run searched as the service searches, and every (search,
candidate label) pair with its features φ and target: what a score fusion is fitted on
(:mod:`export.fuse`) and what ``studies.fusion_models`` and ``studies.fusion_shift`` measure on.

The held-out instances (``<run>/holdout.txt``) were never trained on, but they are keys of the
bundle's memory. Each is searched through the bundle's own encoder and index as a query, against
the memory **without any held-out instance** (``without_holdout``, the default): their keys are
never returned, and the label counts and the lexicon's idf are those of the memory without them.
A held-out query then meets the memory as a dev or live query does, which is not in it: none of
its labels is counted for it, and a label only held-out instances carry looks as unseen as a dev
query's zero-shot label. ``leave_one_out`` searches the whole memory less each query's own key;
its counts include the query itself, and boosted models learnt that (docs/score-fusion.md).

Each held-out instance is searched twice, as the service is called two ways: with its filter-file
labels excluded before aggregation (a caller's ``exclude``), and blind to them, its same-item
label key retrieved and taking its share of the softmax (the filter labels are then left out of
the pairs, as an evaluation that filters after ranking drops them). The candidates and φ of each
search come from the engine's ranking (:func:`engine.fusion_candidates`, computed as
:func:`engine.rank_batch` ranks), so the fit sees what the service computes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import scipy.sparse as sp

from bundle import TOKENIZER_FILE
from engine import Predictor
from engine.offline import (
    KeyTerms,
    LabelKeySource,
    Lexicon,
    Neighbours,
    ScoreFusion,
    features_of_groups,
    fusion_candidates,
    memory_log_frequency,
)
from export.sparse_fit import SparseFitParams, fit_for_memory
from xmc.data import XMCDataset

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
        fetch = rae.top_b + unfitted.extra_fetch + widest  # as deep as the served search (neighbours_needed)
        keys, sims = search_without(predictor, vectors, fetch, block if in_memory else None, hidden)
        lexical, terms = None, None
        if unfitted.lexicon is not None:
            terms = unfitted.lexicon.query_terms(texts)
            lexical = key_terms.similarities(terms, keys)
        neighbours = Neighbours(keys, sims, view.labels_of_keys(keys), view.values, lexical, 0, terms, vectors=vectors)
        # the candidates T will rescore when served (the top rerank depth by p̂, or all) and their φ
        rows_of_block = fusion_candidates(manifest, neighbours, excluded, unfitted)
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


@dataclass(frozen=True)
class SparseSpec:
    """A fusion's sparse ranker as it is to be fitted: its depth and fit parameters."""

    depth: int
    fit: SparseFitParams


def unfitted_fusion(
    predictor: Predictor,
    train: XMCDataset,
    groups: tuple[str, ...],
    rerank_depth: int | None = None,
    hidden: np.ndarray | None = None,
    sparse: SparseSpec | None = None,
    label_keys: LabelKeySource | None = None,
) -> tuple[ScoreFusion, sp.csr_matrix | None]:
    """The fusion's features over ``predictor``'s memory, before a model (``groups``: its
    feature groups; with ``lexical``, the lexicon of the memory's texts; ``rerank_depth``: the
    candidates it rescores; ``hidden``: instance rows of the memory to count and fit the lexicon
    and the sparse ranker without, as if it lacked them; ``sparse``: the sparse ranker to fit on
    the memory's texts, with the ``sparse`` group; ``label_keys``: a label-key source, with the
    ``label_keys`` group), and the keys' term vectors of a lexical one."""
    if ("sparse" in groups) != (sparse is not None):
        raise ValueError("the sparse features go with a sparse ranker to fit, and only with one")
    if ("label_keys" in groups) != (label_keys is not None):
        raise ValueError("the label-key features go with a label-key source, and only with one")
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
    ranker = None
    if sparse is not None:
        if lexicon is None:
            raise ValueError("a sparse ranker is fitted over the lexical term space: it needs the lexical group")
        memory_texts = [train.texts[r] for r in counted]
        # the keys' own vectors (the encoder's of the instances' and labels' texts), for dense weights
        vectors, label_vectors = None, None
        if sparse.fit.dense_weight and sparse.fit.kind(train.num_labels) == "one_vs_rest":
            vectors = bundle.index.vectors(counted)
            label_vectors = bundle.index.vectors(num_train + np.arange(len(bundle.label_texts)))
        ranker, _ = fit_for_memory(
            lexicon,
            memory_texts,
            train.Y[counted],
            list(bundle.label_texts),
            sparse.depth,
            sparse.fit,
            vectors,
            label_vectors,
        )
    fusion = ScoreFusion(None, log_frequency, lexicon, features_of_groups(groups), rerank_depth, ranker, label_keys)
    return fusion, key_rows


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
        sparse_fit: SparseFitParams | None = None,
    ) -> HeldOutSearch:
        """The search of ``rows`` against ``memory``, whose features are those of ``served`` (an
        :func:`unfitted_fusion` of the whole memory and its key rows, used as they are when no key
        is hidden; ``sparse_fit``: how its sparse ranker, if it has one, is fitted again without
        the hidden keys)."""
        unfitted, key_rows = served
        if unfitted.sparse is not None and sparse_fit is None:
            raise ValueError("a fusion with a sparse ranker is searched with its fit parameters")
        hidden = None
        if memory == "without_holdout":
            hidden = np.sort(rows)
            spec = SparseSpec(unfitted.sparse.depth, sparse_fit) if unfitted.sparse is not None else None
            unfitted, key_rows = unfitted_fusion(
                predictor, train, unfitted.groups, unfitted.rerank_depth, hidden, spec, unfitted.label_keys
            )
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
