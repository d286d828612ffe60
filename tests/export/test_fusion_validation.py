"""export.fusion_validation: held-out instances in even folds, each search ranked by its own
candidates, and the ensemble size chosen on cross-fitted validation (the same figures the
benchmarks' validate computes), or kept unchosen when there is nothing to choose or too little
to fold."""

import numpy as np
import pytest

from engine.offline import features_of_groups
from export.fusion_fit import FusionChoice, size_name
from export.fusion_validation import (
    CHOICE_FOLDS,
    MIN_INSTANCES_PER_FOLD,
    PROTOCOL_OF_SEARCH,
    choose_size,
    fold_of_instances,
    ranked_by,
    selection_score,
    validate,
)
from export.held_out import HeldOutPairs

# the RAE group's features: the pairs below fill two of them and p̂, the rest are zero
GROUPS = ("rae",)
FEATURES = features_of_groups(GROUPS)
LABELS = 12


def test_folds_split_the_instances_evenly():
    fold = fold_of_instances(11, 3)
    assert sorted(np.bincount(fold).tolist()) == [3, 4, 4]


def test_each_search_ranks_its_own_candidates_best_first():
    pairs = HeldOutPairs(
        X=np.zeros((5, 1)),
        y=np.zeros(5),
        query=np.array([0, 0, 0, 2, 2]),
        labels=np.array([7, 8, 9, 1, 2]),
        relevant=[np.array([8]), np.array([], dtype=np.int64), np.array([2])],
        found=1.0,
    )
    ranked = ranked_by(pairs, np.array([0.1, 0.9, 0.5, 0.2, 0.3]), k=2)
    assert ranked.tolist() == [[8, 9], [-1, -1], [2, 1]]


def interaction_pairs(instances: int, seed: int = 0) -> HeldOutPairs:
    """Both searches of ``instances`` held-out instances, every label a candidate; a label is
    relevant where its two features are both high (an interaction a stump cannot rank by) and p̂
    is noise, so only an ensemble big enough to model it ranks the relevant labels first."""
    rng = np.random.default_rng(seed)
    searches = instances * len(PROTOCOL_OF_SEARCH)
    a, b = rng.random((searches, LABELS)), rng.random((searches, LABELS))
    relevant_mask = (a > 0.6) & (b > 0.6)
    X = np.zeros((searches, LABELS, len(FEATURES)), dtype=np.float32)
    X[..., FEATURES.index("rae_score")] = 0.01 * rng.random((searches, LABELS))
    X[..., FEATURES.index("label_similarity")], X[..., FEATURES.index("best_instance_similarity")] = a, b
    X = X.reshape(-1, len(FEATURES))
    return HeldOutPairs(
        X=X,
        y=relevant_mask.reshape(-1).astype(np.float64),
        query=np.repeat(np.arange(searches), LABELS),
        labels=np.tile(np.arange(LABELS), searches),
        relevant=[np.flatnonzero(row) for row in relevant_mask],
        found=1.0,
    )


BASE = {"trees": 60, "depth": 6, "leaves": 31, "min_leaf": 5, "learning_rate": 0.1}
STUMP, ENSEMBLE = {"trees": 1, "leaves": 2}, {"trees": 30, "leaves": 8}


def test_the_size_whose_cross_fitted_validation_is_best_is_chosen_whichever_comes_first():
    pairs = interaction_pairs(CHOICE_FOLDS * MIN_INSTANCES_PER_FOLD * 2)
    frequencies = np.ones(LABELS)
    for sizes in ((STUMP, ENSEMBLE), (ENSEMBLE, STUMP)):
        choice = choose_size("lambdarank", BASE, sizes, pairs, FEATURES, frequencies, 1000)
        assert choice.chosen == "30x8" and choice.folds == CHOICE_FOLDS
        assert choice.params == BASE | ENSEMBLE
        scores = {name: selection_score(v) for name, v in choice.validation.items()}
        assert set(scores) == {"1x2", "30x8"}
        # far apart, whatever the machine: the stump ranks by one feature, the ensemble by both
        assert scores["30x8"] > scores["1x2"] + 5


def test_the_validation_it_chooses_on_is_the_one_the_benchmarks_measure():
    pairs = interaction_pairs(CHOICE_FOLDS * MIN_INSTANCES_PER_FOLD)
    frequencies = np.ones(LABELS)
    choice = choose_size("lambdarank", BASE, (STUMP, ENSEMBLE), pairs, FEATURES, frequencies, 1000)
    instances = len(pairs.relevant) // len(PROTOCOL_OF_SEARCH)
    fold = fold_of_instances(instances, CHOICE_FOLDS)
    for size in (STUMP, ENSEMBLE):  # studies.fusion_models' validate, the pairs' groups the candidate's
        candidate = FusionChoice("lambdarank", GROUPS, BASE | size)
        measured = validate(candidate, pairs, fold, frequencies, 1000, computed=GROUPS)
        assert measured["validation"] == choice.validation[size_name(size)]


def test_one_size_or_too_few_instances_to_fold_keeps_the_first_unvalidated():
    frequencies = np.ones(LABELS)
    few = interaction_pairs(CHOICE_FOLDS * MIN_INSTANCES_PER_FOLD - 1)
    choice = choose_size("lambdarank", BASE, (STUMP, ENSEMBLE), few, FEATURES, frequencies, 1000)
    assert choice.params == BASE | STUMP and not choice.validation and choice.folds == 0
    enough = interaction_pairs(CHOICE_FOLDS * MIN_INSTANCES_PER_FOLD)
    assert choose_size("gbdt", BASE, (ENSEMBLE,), enough, FEATURES, frequencies, 1000).validation == {}
    assert choose_size("gbdt", BASE, (), enough, FEATURES, frequencies, 1000).params == BASE


def test_pairs_without_both_searches_of_each_instance_are_refused():
    pairs = interaction_pairs(CHOICE_FOLDS * MIN_INSTANCES_PER_FOLD)
    one_search_short = pairs.subset(np.arange(len(pairs.relevant) - 1))
    with pytest.raises(ValueError, match="both searches"):
        choose_size("lambdarank", BASE, (STUMP, ENSEMBLE), one_search_short, FEATURES, np.ones(LABELS), 1000)
