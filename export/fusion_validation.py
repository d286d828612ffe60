"""The cross-fitted validation of a score fusion on held-out pairs: each held-out instance is ranked
by a model fitted on the other folds, and the ranking's metrics are computed per protocol. The
benchmarks that chose the default fusion's model (``studies.fusion_models``) and its candidate
sources (``studies.candidate_sources``) validate with it, and :mod:`export.fuse` chooses the
ensemble's size on a data set's own held-out instances with it (:func:`choose_size`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from engine.offline import OPTIONAL_GROUPS, features_of_groups
from export.fusion_fit import FusionChoice, fit_model, size_name
from export.fusion_to_onnx import onnx_fusion_model
from export.held_out import HeldOutPairs
from xmc.metrics import HEADLINE, compute_all

VALIDATION_METRICS = HEADLINE
# the two searches of each held-out instance, in the order held_out_pairs joins them
PROTOCOL_OF_SEARCH = ("exclude_before", "filter_after")


def selection_score(validation: dict) -> float:
    """What the choice maximises: the mean of P@1 and P@5 under the peers' protocol."""
    return (validation["filter_after"]["P@1"] + validation["filter_after"]["P@5"]) / 2


def best_validation(validation: dict) -> float | None:
    """The best :func:`selection_score` among validated sizes (size -> protocol -> metric, as a
    :class:`SizeChoice` and the manifest's size choice hold them); None when none was validated."""
    return max((selection_score(v) for v in validation.values()), default=None)


def fold_of_instances(instances: int, folds: int, seed: int = 0) -> np.ndarray:
    """Each held-out instance's fold (shuffled, sizes differing by at most one)."""
    return np.random.default_rng(seed).permutation(instances) % folds


# the groups the held-out pairs are computed with: every group but the sparse ranker's, which
# comes with a ranker to fit (studies.candidate_sources adds it)
PAIR_GROUPS = ("rae", *OPTIONAL_GROUPS)


def columns_of(groups: tuple[str, ...], computed: tuple[str, ...] = PAIR_GROUPS) -> np.ndarray:
    """The columns of φ over the ``computed`` groups that ``groups``' features are."""
    every = features_of_groups(computed)
    return np.array([every.index(name) for name in features_of_groups(groups)])


def with_columns(pairs: HeldOutPairs, columns: np.ndarray) -> HeldOutPairs:
    return dataclasses.replace(pairs, X=pairs.X[:, columns])


def ranked_by(pairs: HeldOutPairs, scores: np.ndarray, k: int = 100) -> np.ndarray:
    """Each search's candidate labels by ``scores``, best first, ``k`` wide (−1 padded)."""
    searches = len(pairs.relevant)
    order = np.lexsort((-scores, pairs.query))
    query = pairs.query[order]
    position = np.arange(len(order)) - np.searchsorted(query, query)
    ranked = np.full((searches, k), -1, dtype=np.int64)
    top = position < k
    ranked[query[top], position[top]] = pairs.labels[order][top]
    return ranked


def relevant_matrix(pairs: HeldOutPairs, labels: int) -> sp.csr_matrix:
    rows = np.repeat(np.arange(len(pairs.relevant)), [len(r) for r in pairs.relevant])
    cols = np.concatenate(pairs.relevant) if pairs.relevant else np.zeros(0, dtype=np.int64)
    return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(pairs.relevant), labels))


def cross_fitted_scores(
    model: str,
    params: dict,
    pairs: HeldOutPairs,
    features: tuple[str, ...],
    fold: np.ndarray,
    share: float = 1.0,
):
    """(each pair's T(φ) by a model fitted on the other folds' instances, the last fold's model,
    which pairs its fold holds): ``pairs``' columns are ``features``; ``share`` of the training
    folds' instances is fitted on. An instance's searches are in one fold."""
    instances = len(fold)
    out_of_fold = np.zeros(len(pairs.y))
    rng = np.random.default_rng(1)
    for f in range(fold.max() + 1):
        fitting = np.flatnonzero(fold != f)
        if share < 1.0:
            fitting = rng.choice(fitting, max(1, round(share * len(fitting))), replace=False)
        searches = np.concatenate([fitting + s * instances for s in range(len(PROTOCOL_OF_SEARCH))])
        fitted = fit_model(model, pairs.subset(searches), features, params)
        held = np.isin(pairs.query % instances, np.flatnonzero(fold == f))
        out_of_fold[held] = fitted.predict(pairs.X[held])
    return out_of_fold, fitted, held


def validate(
    candidate: FusionChoice,
    pairs: HeldOutPairs,
    fold: np.ndarray,
    frequencies: np.ndarray,
    num_train: int,
    share: float = 1.0,
    computed: tuple[str, ...] = PAIR_GROUPS,
) -> dict:
    """``candidate``'s cross-fitted validation metrics per protocol (``share``: of the training
    folds' instances it is fitted on; ``computed``: the groups ``pairs``' columns are)."""
    features = features_of_groups(candidate.groups)
    pairs = with_columns(pairs, columns_of(candidate.groups, computed))
    rae_score = pairs.X[:, features.index("rae_score")]
    started = time.perf_counter()
    out_of_fold, model, held = cross_fitted_scores(candidate.model, candidate.params, pairs, features, fold, share)
    seconds = time.perf_counter() - started
    # what serving it costs: the last fold's model in ONNX Runtime as the service runs it, on its fold
    onnx_model, _ = onnx_fusion_model(model, pairs.X[held])
    timings = []
    for _ in range(3):
        timed = time.perf_counter()
        onnx_model.predict(pairs.X[held])
        timings.append(time.perf_counter() - timed)
    validation = validation_metrics(pairs, rae_score + out_of_fold, frequencies, num_train)
    us_per_pair = 1e6 * min(timings) / max(int(held.sum()), 1)
    pairs_per_search = len(pairs.y) / len(pairs.relevant)
    return {
        "validation": validation,
        "fit_seconds": round(seconds, 1),
        "onnx_us_per_pair": round(us_per_pair, 4),
        "onnx_ms_per_query": round(us_per_pair * pairs_per_search / 1e3, 4),
    }


def validation_metrics(pairs: HeldOutPairs, scores: np.ndarray, frequencies: np.ndarray, num_train: int) -> dict:
    """The held-out searches ranked by ``scores`` (one per pair), their metrics per protocol."""
    ranked, Y = ranked_by(pairs, scores), relevant_matrix(pairs, len(frequencies))
    instances = len(pairs.relevant) // len(PROTOCOL_OF_SEARCH)
    validation = {}
    for s, protocol in enumerate(PROTOCOL_OF_SEARCH):
        rows = slice(s * instances, (s + 1) * instances)
        metrics = compute_all(ranked[rows], Y[rows], frequencies, num_train, ks=(1, 5), recall_ks=(100,))
        validation[protocol] = {name: round(metrics[name], 2) for name in VALIDATION_METRICS}
    return validation


def unfused_validation(pairs: HeldOutPairs, frequencies: np.ndarray, num_train: int) -> dict:
    """The memory's own ranking (p̂ alone) of the held-out searches: what every candidate's
    validation gain is measured from."""
    rae_score = features_of_groups(PAIR_GROUPS).index("rae_score")
    return validation_metrics(pairs, pairs.X[:, rae_score], frequencies, num_train)


# Held-out instances a size choice needs: each of its folds ranks at least this many per fold
# (fewer, and one instance's luck decides; the first size is fitted unchosen).
CHOICE_FOLDS, MIN_INSTANCES_PER_FOLD = 5, 10


@dataclass
class SizeChoice:
    """Which ensemble size :func:`choose_size` chose, and every size's cross-fitted validation."""

    params: dict
    validation: dict[str, dict] = field(default_factory=dict)  # size name -> metrics per protocol
    folds: int = 0

    @property
    def chosen(self) -> str:
        return size_name(self.params)


def choose_size(
    model: str,
    params: dict,
    sizes: tuple[dict, ...],
    pairs: HeldOutPairs,
    features: tuple[str, ...],
    frequencies: np.ndarray,
    num_train: int,
) -> SizeChoice:
    """The ensemble size (each of ``sizes`` over ``params``) whose cross-fitted validation on
    ``pairs`` (their columns ``features``) has the best :func:`selection_score`, ties to the first:
    the choice ``studies.fusion_models`` made for the default, made again on a data set's own held-out
    instances. ``pairs`` must hold both searches of each instance, in :data:`PROTOCOL_OF_SEARCH`'s
    order (``export.held_out``'s ``both``): the folds are cut by instance. Fewer sizes than two, or
    too few instances to fold, and the first is kept unvalidated."""
    candidates = [params | size for size in sizes] or [params]
    instances, odd = divmod(len(pairs.relevant), len(PROTOCOL_OF_SEARCH))
    if odd:
        raise ValueError(f"{len(pairs.relevant)} searches: not both searches of each held-out instance")
    if len(candidates) < 2 or instances < CHOICE_FOLDS * MIN_INSTANCES_PER_FOLD:
        return SizeChoice(candidates[0])
    fold = fold_of_instances(instances, CHOICE_FOLDS)
    rae_score = pairs.X[:, features.index("rae_score")]
    choice, best = SizeChoice(candidates[0], folds=CHOICE_FOLDS), -np.inf
    for candidate in candidates:
        out_of_fold, _, _ = cross_fitted_scores(model, candidate, pairs, features, fold)
        validation = validation_metrics(pairs, rae_score + out_of_fold, frequencies, num_train)
        choice.validation[size_name(candidate)] = validation
        score = selection_score(validation)
        if score > best:
            best, choice.params = score, candidate
    return choice
