"""export.fuse: a fusion fitted on held-out training instances (leave one out), written as a derived
bundle whose answers are the source's RAE scores plus the tree, lexical by default (the keys' term
vectors beside it, one file per shard); appends and compaction keep it; wrong inputs are refused."""

import json

import numpy as np
import pytest

from export.build import ExportParams, build_bundle
from export.compact import compact_bundle
from export.derive import derive_rae_bundle
from export.fuse import leave_one_out, main
from service.engine.bundle import BundleError, load_bundle, load_labels, load_shard
from service.engine.fusion import FEATURE_SETS, FEATURES
from service.engine.manifest import FUSION_FILE, LEXICAL_FILE, MANIFEST_FILE
from service.engine.memory import AppendBatch, base_view, fetch_and_ef
from service.engine.search import RankedSearch, load_predictor, merged_neighbours
from service.engine.shards import ShardQuery
from training.data import load_jsonl_split
from training.params import HOLDOUT_FILE


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
    main(["--bundle", str(bundle), "--run", str(run_dir), "--data", str(sample_dir), "--out", str(out), *options])
    return out


@pytest.fixture(scope="module")
def fused(sample_bundle, sample_dir, run_dir, tmp_path_factory):
    """The default bundle with its (lexical) fusion."""
    return fuse(sample_bundle, sample_dir, run_dir, tmp_path_factory.mktemp("fused") / "sample-fused")


@pytest.fixture(scope="module")
def plain_fused(sample_bundle, sample_dir, run_dir, tmp_path_factory):
    """The default bundle with a fusion of the RAE features alone."""
    return fuse(sample_bundle, sample_dir, run_dir, tmp_path_factory.mktemp("fused") / "plain", "--no-lexical")


@pytest.fixture(params=["fused", "plain_fused"])
def any_fused(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def sharded_fused(distilbert_dir, train, sample_dir, run_dir, tmp_path_factory):
    """A 3-shard RAE memory of the whole sample (tiny DistilBERT), fused."""
    source = tmp_path_factory.mktemp("bundles") / "tiny-3shards"
    build_bundle(source, train.labels, train, distilbert_dir, ExportParams(dim=16, rae_top_b=50, shards=3))
    return fuse(source, sample_dir, run_dir, tmp_path_factory.mktemp("fused") / "tiny-3shards-fused")


def test_leave_one_out_drops_only_each_rows_own_key():
    keys = np.array([[5, 7, 9, 11], [3, 4, 8, 6]])
    sims = np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2]], dtype=np.float32)
    kept_keys, kept_sims = leave_one_out(keys, sims, np.array([7, 1]))
    assert kept_keys.tolist() == [[5, 9, 11], [3, 4, 8]]  # a row without its own key loses its last
    np.testing.assert_allclose(kept_sims, [[0.9, 0.7, 0.6], [0.5, 0.4, 0.3]])


def test_the_fused_bundle_ranks_by_rae_score_plus_the_tree(fused, sample_bundle, sample_dir):
    bundle = load_bundle(fused)  # checksums verified, fusion.npz and lexical.npz among them
    source = load_bundle(sample_bundle)
    assert bundle.manifest.fusion.features == list(FEATURE_SETS[1]) and bundle.manifest.fusion.queries == 150
    assert {FUSION_FILE, LEXICAL_FILE} <= set(bundle.manifest.files) and bundle.bundle_id != source.bundle_id
    assert (
        bundle.manifest.fusion.lexical == [LEXICAL_FILE]
        and bundle.key_terms.rows.shape[0] == len(source.label_uids) + bundle.manifest.counts.train_instances
    )
    assert "held-out training instances" in bundle.manifest.fusion.fitted_on
    lexical_splits = np.isin(bundle.fusion.tree.feature[bundle.fusion.tree.left >= 0], np.arange(len(FEATURES), 12))
    assert lexical_splits.any()  # the tree uses the lexical features
    check_rae_score_plus_a_leaf(fused, sample_bundle, load_jsonl_split(sample_dir, "dev").texts[:20])


def test_the_lexical_features_can_be_left_out(plain_fused, sample_bundle, sample_dir):
    bundle = load_bundle(plain_fused)
    assert bundle.manifest.fusion.features == list(FEATURES) and bundle.manifest.fusion.lexical is None
    assert bundle.fusion.lexicon is None and bundle.key_terms is None and LEXICAL_FILE not in bundle.manifest.files
    check_rae_score_plus_a_leaf(plain_fused, sample_bundle, load_jsonl_split(sample_dir, "dev").texts[:20])


def check_rae_score_plus_a_leaf(fused, source, texts):
    """Each fused answer is a candidate of the source's RAE ranking whose score is its RAE score
    plus one of the tree's leaves, and some rankings change."""
    tree = load_bundle(fused).fusion.tree
    leaves = tree.value[tree.left < 0]
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
    ingress merges and ranks) gives the single process's answers."""
    manifest = load_bundle(sharded_fused).manifest
    assert manifest.fusion.lexical == ["lexical-0.npz", "lexical-1.npz", "lexical-2.npz"]
    predictor = load_predictor(sharded_fused)
    texts = load_jsonl_split(sample_dir, "dev").texts[:16]
    vectors, _ = predictor.encode(texts)
    expected = predictor.search(vectors, 10, None, None, None, texts).rankings

    _, uids, label_texts = load_labels(sharded_fused)
    searchers = [load_shard(sharded_fused, i)[1] for i in range(3)]
    assert [s.key_terms.first_key for s in searchers] == [shard.first_key for shard in manifest.shards]
    search = RankedSearch(manifest, [10] * len(texts), [()] * len(texts), predictor.bundle.fusion)
    fetch, ef = fetch_and_ef(search.neighbours, manifest.hnsw.ef_search, manifest.counts.memory_rows)
    terms = predictor.bundle.fusion.lexicon.query_terms(texts)  # the ingress's (a fusion it loads)
    answers = [s.search_many([ShardQuery(vectors, fetch, ef, terms)])[0] for s in searchers]
    view = base_view(uids, label_texts, manifest.counts.memory_rows, None)
    got = search.rank(merged_neighbours(answers, search.neighbours, view))
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
    with pytest.raises(BundleError, match="cannot load key terms"):
        load_bundle(copy, verify=False)


def test_changing_the_rae_parameters_drops_the_fusion(fused, train, tmp_path):
    derived = derive_rae_bundle(fused, tmp_path / "d", train.Y, lam=0.2)
    assert derived.fusion is None and not {FUSION_FILE, LEXICAL_FILE} & set(derived.files)
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
