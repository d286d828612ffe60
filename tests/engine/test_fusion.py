"""engine.fusion: the ONNX model predicts as its library does in one ONNX Runtime session of
one thread, each feature is what its definition says on a hand-made query, rescoring adds the model
to the RAE score, and a bundle from before the ONNX fusion is refused with what to do."""

import math

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.tree import DecisionTreeRegressor

from bundle.manifest import FUSION_FILE, FUSION_MODEL_FILE, FusionParams
from engine.fusion import (
    FEATURES,
    LABEL_KEY_FEATURES,
    LEXICAL_FEATURES,
    LEXICAL_TAU,
    LOG_FLOOR,
    QUERY_FEATURES,
    RANK_FEATURES,
    LabelKeySource,
    OnnxTreeEnsemble,
    ScoreFusion,
    batch_features,
    features_of_groups,
    groups_of,
    memory_log_frequency,
    ranks_within_rows,
    top_of_rows,
)
from engine.lexical import Lexicon
from engine.rae import KeptKeys, ValueRows, aggregate, aggregate_kept, keep_keys, softmax
from export.fusion_fit import FittedModel
from export.fusion_to_onnx import to_onnx
from xmc.checkpoint import default_encoder_dir

ALL_FEATURES = features_of_groups(["lexical", "ranks", "thresholds", "query"])


def random_sklearn_tree(seed: int = 0, depth: int = 6, features: tuple[str, ...] = FEATURES):
    """A tree that splits on every one of ``features`` (the target depends on all of them)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(2000, len(features))).astype(np.float32).astype(np.float64)
    y = np.sin(X @ rng.normal(size=len(features))) + 0.1 * rng.normal(size=len(X))
    return DecisionTreeRegressor(max_depth=depth, random_state=0).fit(X, y)


def random_onnx_tree(seed: int = 0, depth: int = 6, features: tuple[str, ...] = FEATURES) -> OnnxTreeEnsemble:
    """The same tree as ``export.fuse`` writes it: skl2onnx's ai.onnx.ml TreeEnsemble, in ONNX Runtime."""
    fitted = FittedModel("tree", {}, random_sklearn_tree(seed, depth, features))
    return OnnxTreeEnsemble.from_bytes(to_onnx(fitted, len(features)), len(features))


def fusion_params(features: tuple[str, ...]) -> FusionParams:
    return FusionParams(
        file=FUSION_FILE,
        model=FUSION_MODEL_FILE,
        features=list(features),
        fitted_on="a test",
        queries=1,
        pairs=1,
    )


def onnx_of(tree: DecisionTreeRegressor, width: int) -> OnnxTreeEnsemble:
    return OnnxTreeEnsemble.from_bytes(to_onnx(FittedModel("tree", {}, tree), width), width)


def leaf(value: float, features: tuple[str, ...] = FEATURES) -> OnnxTreeEnsemble:
    """T = ``value`` whatever φ: a tree of one leaf, in ONNX."""
    X = np.zeros((2, len(features)))
    return onnx_of(DecisionTreeRegressor(max_depth=1).fit(X, [value, value]), len(features))


def split_on(feature: str, threshold: float, below: float, above: float) -> OnnxTreeEnsemble:
    """T = ``below`` where φ's ``feature`` ≤ ``threshold``, else ``above``: a one-split tree, in ONNX,
    over the RAE features (and the lexical ones for a lexical ``feature``)."""
    features = FEATURES if feature in FEATURES else FEATURES + LEXICAL_FEATURES
    X = np.zeros((2, len(features)))
    X[:, features.index(feature)] = [threshold - 0.25, threshold + 0.25]  # sklearn splits at the midpoint
    return onnx_of(DecisionTreeRegressor(max_depth=1).fit(X, [below, above]), len(features))


def test_the_onnx_model_scores_as_its_library_in_one_single_threaded_session():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(3000, len(FEATURES))).astype(np.float32).astype(np.float64)
    sklearn_tree = random_sklearn_tree(depth=7)
    onnx_tree = random_onnx_tree(depth=7)
    np.testing.assert_allclose(onnx_tree.predict(X), sklearn_tree.predict(X), rtol=0, atol=1e-6)
    options = onnx_tree.session.get_session_options()
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)  # the encoder keeps the cores
    assert onnx_tree.predict(np.zeros((0, len(FEATURES)))).shape == (0,)
    with pytest.raises(ValueError, match=r"one float input \[batch, 12\]"):
        OnnxTreeEnsemble.from_bytes(onnx_tree.serialized, 12)


def test_the_one_split_test_trees_are_what_they_say():
    X = np.zeros((3, len(FEATURES)))
    X[:, FEATURES.index("label_retrieved")] = [0.0, 0.5, 1.0]
    assert split_on("label_retrieved", 0.5, -1.0, 2.0).predict(X).tolist() == [-1.0, -1.0, 2.0]
    assert leaf(0.25).predict(X).tolist() == [0.25] * 3


def memory():
    """Two instances (labels {0, 1} and {1, 2}) then four label keys: keys 0, 1 | 2..5 = labels 0..3."""
    Y = sp.csr_matrix(np.array([[1, 1, 0, 0], [0, 1, 1, 0]], dtype=np.float32))
    lam = 0.6
    V = sp.vstack([lam * Y, (1 - lam) * sp.identity(4, dtype=np.float32, format="csr")]).tocsr()
    return ValueRows(V), lam


def test_each_feature_is_its_definition_on_a_hand_made_query():
    values, lam = memory()
    tau = 0.1
    keys = np.array([0, 3, 1, 5])  # instance 0, label 1, instance 1, label 3
    sims = np.array([0.9, 0.8, 0.7, 0.2], dtype=np.float32)
    key_labels = np.array([-1, 1, -1, 3])
    log_frequency = np.log1p(np.array([1.0, 2.0, 1.0, 0.0]))
    scores = aggregate(keys[None], sims[None], key_labels[None], values, tau, 4, [()], "split")
    candidates = scores.indices
    F = batch_features(scores, [KeptKeys(keys, sims, key_labels)], values, tau, log_frequency)
    column = {name: dict(zip(candidates.tolist(), F[:, j], strict=True)) for j, name in enumerate(FEATURES)}

    w_instance = softmax(np.array([0.9, 0.7]), tau)  # instance 0, instance 1
    w_label = softmax(np.array([0.8, 0.2]), tau)  # label 1, label 3
    assert sorted(candidates.tolist()) == [0, 1, 2, 3]
    expected_vote = {0: w_instance[0], 1: w_instance.sum(), 2: w_instance[1], 3: 0.0}
    for label, vote in expected_vote.items():
        assert column["instance_vote"][label] == pytest.approx(math.log(LOG_FLOOR + vote))
    assert column["label_match"][1] == pytest.approx(math.log(LOG_FLOOR + w_label[0]))
    assert column["label_match"][0] == pytest.approx(math.log(LOG_FLOOR))
    assert column["label_similarity"] == pytest.approx({0: 0.2, 1: 0.8, 2: 0.2, 3: 0.2})  # unretrieved: the lowest
    assert column["label_retrieved"] == {0: 0.0, 1: 1.0, 2: 0.0, 3: 1.0}
    assert column["log_frequency"] == pytest.approx(dict(enumerate(log_frequency)))
    assert column["log_instance_votes"] == pytest.approx({0: math.log(2), 1: math.log(3), 2: math.log(2), 3: 0.0})
    assert column["best_instance_similarity"] == pytest.approx({0: 0.9, 1: 0.9, 2: 0.7, 3: 0.7})  # none: the lowest
    expected_rae = {label: lam * expected_vote[label] for label in range(4)}
    expected_rae[1] += (1 - lam) * w_label[0]
    expected_rae[3] += (1 - lam) * w_label[1]
    assert column["rae_score"] == pytest.approx(expected_rae, rel=1e-5)


def test_rescoring_adds_the_tree_to_the_rae_score_and_keeps_exclusions():
    values, _ = memory()
    keys = np.array([[0, 3, 1, 5], [2, 1, 4, 0]])
    sims = np.array([[0.9, 0.8, 0.7, 0.2], [0.95, 0.6, 0.5, 0.4]], dtype=np.float32)
    key_labels = np.array([[-1, 1, -1, 3], [0, -1, 2, -1]])
    excluded = [(), {2}]
    kept = keep_keys(keys, sims, key_labels, excluded, 4)
    scores = aggregate_kept(kept, values, 0.1, excluded, "joint")
    np.testing.assert_array_equal(
        scores.toarray(), aggregate(keys, sims, key_labels, values, 0.1, 4, excluded).toarray()
    )
    log_frequency = np.zeros(4)

    shifted = ScoreFusion(leaf(0.5), log_frequency).rescore(scores, kept, values, 0.1)
    np.testing.assert_allclose(shifted.data, scores.data + 0.5)
    assert shifted.indices.tolist() == scores.indices.tolist() and 2 not in shifted[1].indices

    # a tree that lifts the labels whose own key was retrieved puts them first
    lifted = ScoreFusion(split_on("label_retrieved", 0.5, 0.0, 10.0), log_frequency)
    fused = lifted.rescore(scores, kept, values, 0.1).toarray()
    assert set(np.flatnonzero(fused[0] > 10)) == {1, 3} and set(np.flatnonzero(fused[1] > 10)) == {0}


def test_top_of_rows_keeps_each_rows_best_entries_with_ties_to_the_lower_label():
    scores = sp.csr_matrix(np.array([[0.1, 0.5, 0.5, 0.3, 0.0], [0.0, 0.2, 0.0, 0.0, 0.9], [0.0] * 5]))
    top = top_of_rows(scores, [2, 5, 3])
    assert top.toarray().tolist() == [[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.2, 0.0, 0.0, 0.9], [0.0] * 5]
    assert top_of_rows(scores, [1, 1, 1])[0].indices.tolist() == [1]  # 0.5 twice: label 1 before label 2


@pytest.mark.parametrize("rows", [1, 6])
def test_ranks_within_rows_rank_each_rows_entries_best_first_with_ties_in_storage_order(rows):
    rng = np.random.default_rng(rows)
    lengths = rng.integers(0, 9, rows) if rows > 1 else np.array([7])
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    x = rng.choice([0.1, 0.2, 0.3, -1.0], indptr[-1])  # few values: many ties
    expected = np.concatenate(
        [
            [sum(x[j] > x[i] for j in range(a, b)) + sum(x[j] == x[i] for j in range(a, i)) for i in range(a, b)]
            for a, b in zip(indptr[:-1], indptr[1:], strict=True)
        ]
    )
    assert ranks_within_rows(indptr, x).tolist() == expected.astype(int).tolist()


def test_a_rerank_depth_rescores_and_returns_only_each_querys_top_max_depth_k_candidates():
    values, _ = memory()
    keys = np.array([[0, 3, 1, 5], [2, 1, 4, 0]])
    sims = np.array([[0.9, 0.8, 0.7, 0.2], [0.95, 0.6, 0.5, 0.4]], dtype=np.float32)
    key_labels = np.array([[-1, 1, -1, 3], [0, -1, 2, -1]])
    kept = keep_keys(keys, sims, key_labels, [(), ()], 4)
    scores = aggregate_kept(kept, values, 0.1, [(), ()], "joint")
    assert min(np.diff(scores.indptr)) >= 3
    everything = ScoreFusion(leaf(0.5), np.zeros(4)).rescore(scores, kept, values, 0.1)
    fusion = ScoreFusion(leaf(0.5), np.zeros(4), rerank_depth=2)
    fused = fusion.rescore(scores, kept, values, 0.1, ks=[1, 3])
    assert np.diff(fused.indptr).tolist() == [2, 3]  # max(2, 1) and max(2, 3)
    for row, width in ((0, 2), (1, 3)):
        best = np.argsort(-scores[row].toarray()[0], kind="stable")[:width]
        assert sorted(fused[row].indices.tolist()) == sorted(best.tolist())
        np.testing.assert_allclose(fused[row].toarray()[0, best], everything[row].toarray()[0, best])
    # φ is computed for the kept candidates only, and equals their rows of the full φ
    full = ScoreFusion(None, np.zeros(4)).features_of(scores, kept, values, 0.1)
    cut = fusion.candidates(scores)
    part = ScoreFusion(None, np.zeros(4)).features_of(cut, kept, values, 0.1)
    position = {(r, c): j for j, (r, c) in enumerate(zip(*scores.nonzero(), strict=True))}
    rows = [position[(r, c)] for r, c in zip(*cut.nonzero(), strict=True)]
    np.testing.assert_allclose(part, full[rows])
    assert full.shape[0] == scores.nnz
    with pytest.raises(ValueError, match="at least 1"):
        ScoreFusion(leaf(0.5), np.zeros(4), rerank_depth=0)


def test_fusion_files_round_trip_and_a_wrong_frequency_table_is_refused(tmp_path):
    model = random_onnx_tree()
    fusion = ScoreFusion(model, np.log1p(np.arange(5, dtype=np.float32)))
    params = fusion_params(FEATURES)
    fusion.save(tmp_path, params)
    assert (tmp_path / FUSION_MODEL_FILE).is_file()
    loaded = ScoreFusion.load(tmp_path, params, 5)
    assert type(loaded.model) is type(model) and loaded.rerank_depth is None
    deep = ScoreFusion.load(tmp_path, params.model_copy(update={"rerank_depth": 3}), 5)
    assert deep.rerank_depth == 3
    X = np.random.default_rng(2).normal(size=(100, len(FEATURES)))
    np.testing.assert_array_equal(loaded.model.predict(X), fusion.model.predict(X))
    np.testing.assert_array_equal(loaded.log_frequency, fusion.log_frequency)
    with pytest.raises(ValueError, match="6 finite values"):
        ScoreFusion.load(tmp_path, params, 6)


def test_a_fusion_file_declaring_more_values_than_it_holds_is_refused_before_it_is_inflated(tmp_path):
    """A compressed member whose .npy header declares 10^13 frequencies (80 TB) is refused from
    its header, not handed to numpy to allocate."""
    import io
    import zipfile

    ScoreFusion(random_onnx_tree(), np.zeros(5, dtype=np.float32)).save(tmp_path, fusion_params(FEATURES))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**13,)})
    with zipfile.ZipFile(tmp_path / FUSION_FILE, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("log_frequency.npy", header.getvalue() + b"\x00" * 64)
    with pytest.raises(ValueError, match="5 finite values"):
        ScoreFusion.load(tmp_path, fusion_params(FEATURES), 5)


def test_a_fusion_without_an_onnx_model_is_refused_with_how_to_re_fuse_it(tmp_path):
    with pytest.raises(ValueError, match="saved with its model as ONNX"):
        ScoreFusion(None, np.zeros(5)).save(tmp_path, fusion_params(FEATURES))
    # the manifest of a bundle from before the ONNX fusion: its tree as arrays, no model
    old = fusion_params(FEATURES).model_dump() | {"depth": 5}
    del old["model"]
    with pytest.raises(ValueError, match=r"no ONNX model \(fusion.model\).*python -m export.fuse --bundle"):
        FusionParams.model_validate(old)
    with pytest.raises(ValueError, match="no ONNX model"):
        FusionParams.model_validate(old | {"model": None})


def test_label_frequencies_come_from_the_instance_rows_only():
    values, _ = memory()
    np.testing.assert_allclose(memory_log_frequency(values.base, 2), np.log1p([1, 2, 1, 0]))


def test_each_lexical_feature_is_its_definition_on_a_hand_made_query():
    values, _ = memory()
    keys = np.array([0, 3, 1, 5])  # instance 0 (labels 0, 1), label 1, instance 1 (labels 1, 2), label 3
    key_labels = np.array([-1, 1, -1, 3])
    sims = np.array([0.9, 0.8, 0.7, 0.2], dtype=np.float32)
    lexical = np.array([0.6, 0.3, 0.2, 0.0])
    scores = aggregate(keys[None], sims[None], key_labels[None], values, 0.1, 4, [()], "split")
    candidates = scores.indices
    kept = [KeptKeys(keys, sims, key_labels, lexical)]
    F = batch_features(scores, kept, values, 0.1, np.zeros(4), ("rae", "lexical"))[:, len(FEATURES) :]
    column = {name: dict(zip(candidates.tolist(), F[:, j], strict=True)) for j, name in enumerate(LEXICAL_FEATURES)}
    w = softmax(np.array([0.6, 0.2]), LEXICAL_TAU)  # instance 0, instance 1
    assert column["instance_lexical_max"] == pytest.approx({0: 0.6, 1: 0.6, 2: 0.2, 3: 0.0})
    assert column["instance_lexical_sum"] == pytest.approx({0: 0.6, 1: 0.8, 2: 0.2, 3: 0.0})
    expected_vote = {0: w[0], 1: w.sum(), 2: w[1], 3: 0.0}
    assert column["instance_lexical_vote"] == pytest.approx(
        {k: math.log(LOG_FLOOR + v) for k, v in expected_vote.items()}
    )
    assert column["label_lexical"] == pytest.approx({0: 0.0, 1: 0.3, 2: 0.0, 3: 0.0})  # label 3 retrieved at 0.0


def lexicon() -> Lexicon:
    return Lexicon.fit(default_encoder_dir() / "tokenizer.json", 128, ["libc6: GNU C Library", "python3: language"])


def test_a_lexical_fusion_splits_on_the_keys_lexical_similarity_and_needs_it():
    values, _ = memory()
    keys, sims = np.array([[0, 3, 1, 5]]), np.array([[0.9, 0.8, 0.7, 0.2]], dtype=np.float32)
    key_labels = np.array([[-1, 1, -1, 3]])
    fusion = ScoreFusion(split_on("instance_lexical_max", 0.5, 0.0, 10.0), np.zeros(4), lexicon())
    assert fusion.features == FEATURES + LEXICAL_FEATURES
    kept = keep_keys(keys, sims, key_labels, [()], 4, lexical=np.array([[0.1, 0.0, 0.9, 0.0]]))
    scores = aggregate_kept(kept, values, 0.1, [()], "split")
    fused = fusion.rescore(scores, kept, values, 0.1).toarray()[0]
    assert np.flatnonzero(fused > 10).tolist() == [1, 2]  # the labels of instance 1, the lexical match
    with pytest.raises(ValueError, match="lexical similarities"):
        fusion.rescore(scores, keep_keys(keys, sims, key_labels, [()], 4), values, 0.1)


def test_exclusion_drops_a_key_s_lexical_similarity_with_it():
    kept = keep_keys(
        np.array([[0, 3, 5]]),
        np.array([[0.9, 0.8, 0.2]]),
        np.array([[-1, 1, 3]]),
        [{1}],
        4,
        np.array([[0.1, 0.7, 0.3]]),
    )
    assert kept[0].keys.tolist() == [0, 5] and kept[0].lexical.tolist() == [0.1, 0.3]


def test_lexical_fusion_files_round_trip_and_are_checked(tmp_path):
    features = FEATURES + LEXICAL_FEATURES
    fusion = ScoreFusion(random_onnx_tree(features=features), np.zeros(5), lexicon())
    params = fusion_params(features)
    fusion.save(tmp_path, params)
    tokenizer = (default_encoder_dir() / "tokenizer.json", 128)
    loaded = ScoreFusion.load(tmp_path, params, 5, tokenizer)
    np.testing.assert_array_equal(loaded.lexicon.idf, fusion.lexicon.idf)
    assert loaded.features == features
    with pytest.raises(ValueError, match="needs the bundle's tokenizer"):
        ScoreFusion.load(tmp_path, params, 5)
    # a model over other features than the manifest lists
    with pytest.raises(ValueError, match=r"one float input \[batch, 8\]"):
        ScoreFusion.load(tmp_path, fusion_params(FEATURES), 5, tokenizer)


def test_feature_lists_are_whole_groups_in_order():
    assert groups_of(ALL_FEATURES) == ("rae", "lexical", "ranks", "thresholds", "query")
    assert features_of_groups(["query", "ranks"]) == FEATURES + RANK_FEATURES + QUERY_FEATURES
    for wrong in (RANK_FEATURES + FEATURES, FEATURES + RANK_FEATURES[:2], tuple(reversed(FEATURES)), FEATURES[1:]):
        with pytest.raises(ValueError, match="not the groups"):
            groups_of(wrong)
    with pytest.raises(ValueError, match="unknown feature groups"):
        features_of_groups(["lexical", "label_vectors"])
    with pytest.raises(ValueError, match="exactly when it has a lexicon"):
        ScoreFusion(None, np.zeros(4), None, FEATURES + LEXICAL_FEATURES)


def test_each_cheap_feature_is_its_definition_on_a_hand_made_query():
    values, _ = memory()
    keys = np.array([0, 3, 1, 5])  # instance 0 (labels 0, 1), label 1, instance 1 (labels 1, 2), label 3
    key_labels = np.array([-1, 1, -1, 3])
    sims = np.array([0.9, 0.8, 0.86, 0.2], dtype=np.float32)
    scores = aggregate(keys[None], sims[None], key_labels[None], values, 0.1, 4, [()], "split")
    candidates = scores.indices.tolist()
    groups = ("rae", "ranks", "thresholds", "query")
    F = batch_features(scores, [KeptKeys(keys, sims, key_labels)], values, 0.1, np.zeros(4), groups)
    names = features_of_groups(groups)
    column = {name: dict(zip(candidates, F[:, j], strict=True)) for j, name in enumerate(names)}
    rae = column["rae_score"]
    by_rae = sorted(rae, key=lambda label: -rae[label])
    assert column["rae_rank"] == pytest.approx({label: math.log1p(by_rae.index(label)) for label in rae})
    # instance votes: label 1 carried by both instances, 0 by the best, 2 by the second, 3 by none
    assert column["instance_vote_rank"] == pytest.approx({1: 0.0, 0: math.log1p(1), 2: math.log1p(2), 3: math.log1p(3)})
    # label similarity: label 1 (0.8), label 3 (0.2), the unretrieved at the lowest (0.2), ties in storage order
    assert column["label_similarity_rank"][1] == 0.0
    within = {margin: column[f"instance_votes_within_{margin:g}"] for margin in (0.02, 0.05, 0.1)}
    assert within[0.02] == pytest.approx({0: math.log1p(1), 1: math.log1p(1), 2: 0.0, 3: 0.0})  # 0.86 is 0.04 off
    assert within[0.05] == pytest.approx({0: math.log1p(1), 1: math.log1p(2), 2: math.log1p(1), 3: 0.0})
    assert within[0.1] == within[0.05]
    assert column["query_best_similarity"] == pytest.approx(dict.fromkeys(candidates, 0.9))
    assert column["query_candidates"] == pytest.approx(dict.fromkeys(candidates, math.log1p(4)))


def test_a_batch_s_features_are_each_query_s_features_alone():
    """The features are computed for the whole batch at once; no query's may leak into another's,
    whatever keys each kept (instances only, labels only, none) and whatever it excluded."""
    values, _ = memory()
    rng = np.random.default_rng(3)
    keys = np.array([[0, 3, 1, 5], [2, 4, 3, 5], [0, 1, -1, -1], [-1, -1, -1, -1], [5, 0, 2, 1]])
    key_labels = np.where(keys >= 2, keys - 2, -1)
    sims = np.sort(rng.uniform(0, 1, size=keys.shape).astype(np.float32), axis=1)[:, ::-1].copy()
    lexical = rng.uniform(0, 1, size=keys.shape)
    excluded = [(), {1}, (), (), {0, 3}]
    kept = keep_keys(keys, sims, key_labels, excluded, 4, lexical)
    log_frequency = np.log1p(np.array([1.0, 2.0, 1.0, 0.0]))
    scores = aggregate_kept(kept, values, 0.1, excluded, "split")
    groups = groups_of(ALL_FEATURES)
    batch = batch_features(scores, kept, values, 0.1, log_frequency, groups)
    assert batch.shape == (scores.nnz, len(ALL_FEATURES))
    for i, row in enumerate(kept):
        alone = aggregate_kept([row], values, 0.1, [excluded[i]], "split")
        start, end = scores.indptr[i], scores.indptr[i + 1]
        assert alone.indices.tolist() == scores.indices[start:end].tolist()
        np.testing.assert_allclose(
            batch[start:end], batch_features(alone, [row], values, 0.1, log_frequency, groups), rtol=1e-12
        )


def test_a_label_key_source_adds_the_nearest_label_keys_beyond_b_with_their_features():
    """The label index as a source: a query fetches b + fetch keys; its nearest ``depth`` label
    keys among them (excluded labels left out) join the candidates with p̂ 0 when the top b did
    not carry them, and φ's last two columns are each candidate's label-key similarity (the
    lowest hit's when it is not one) and log(1 + its rank among them) (log(1 + depth) beyond)."""
    values, _ = memory()
    # fetched, best first: instance 0, label 1, instance 1 | beyond b = 3: label 3, label 0, label 2
    keys = np.array([0, 3, 1, 5, 2, 4])
    labels = np.array([-1, 1, -1, 3, 0, 2])
    sims = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4], dtype=np.float32)
    source = LabelKeySource(depth=3, fetch=3)
    hits = source.hits(labels[None], sims[None], [{0}], width=4)  # label 0 excluded
    assert hits.top.indices.tolist() == [1, 2, 3] and hits.top.data.tolist() == pytest.approx([0.8, 0.4, 0.6])
    assert hits.ranks.tolist() == [0, 2, 1] and hits.floor.tolist() == pytest.approx([0.4])

    kept = keep_keys(keys[None], sims[None], labels[None], [{0}], 3)  # the top b = 3
    scores = aggregate_kept(kept, values, 0.1, [{0}], "split")
    assert 3 not in scores.indices.tolist()  # label 3's key lies beyond b: the memory alone never votes for it
    fusion = ScoreFusion(leaf(0.0, features_of_groups(["label_keys"])), np.zeros(4), label_keys=source)
    assert fusion.features[-2:] == LABEL_KEY_FEATURES and fusion.extra_fetch == 3
    candidates = fusion.candidates(scores, hits=hits)
    assert 3 in candidates.indices.tolist() and 0 not in candidates.indices.tolist()
    F = fusion.features_of(candidates, kept, values, 0.1, hits=hits)
    column = {label: F[j, -2:].tolist() for j, label in enumerate(candidates.indices.tolist())}
    assert column[1] == pytest.approx([0.8, 0.0]) and column[3] == pytest.approx([0.6, math.log1p(1)])
    assert column[2] == pytest.approx([0.4, math.log1p(2)])
    with pytest.raises(ValueError, match="label-key"):
        ScoreFusion(None, np.zeros(4), features=features_of_groups(["label_keys"]))
