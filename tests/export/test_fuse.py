"""export.fuse: a fusion fitted on held-out training instances (leave one out), written as a derived
bundle whose answers are the source's RAE scores plus the tree; wrong inputs are refused."""

import json

import numpy as np
import pytest

from export.compact import compact_bundle
from export.derive import derive_rae_bundle
from export.fuse import leave_one_out, main
from service.engine.bundle import BundleError, load_bundle
from service.engine.fusion import FEATURES
from service.engine.manifest import FUSION_FILE, MANIFEST_FILE
from service.engine.memory import AppendBatch
from service.engine.search import load_predictor
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


@pytest.fixture(scope="module")
def fused(sample_bundle, sample_dir, run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fused") / "sample-fused"
    main(["--bundle", str(sample_bundle), "--run", str(run_dir), "--data", str(sample_dir), "--out", str(out)])
    return out


def test_leave_one_out_drops_only_each_rows_own_key():
    keys = np.array([[5, 7, 9, 11], [3, 4, 8, 6]])
    sims = np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2]], dtype=np.float32)
    kept_keys, kept_sims = leave_one_out(keys, sims, np.array([7, 1]))
    assert kept_keys.tolist() == [[5, 9, 11], [3, 4, 8]]  # a row without its own key loses its last
    np.testing.assert_allclose(kept_sims, [[0.9, 0.7, 0.6], [0.5, 0.4, 0.3]])


def test_the_fused_bundle_ranks_by_rae_score_plus_the_tree(fused, sample_bundle, sample_dir):
    bundle = load_bundle(fused)  # checksums verified, fusion.npz among them
    source = load_bundle(sample_bundle)
    assert bundle.manifest.fusion.features == list(FEATURES) and bundle.manifest.fusion.queries == 150
    assert FUSION_FILE in bundle.manifest.files and bundle.bundle_id != source.bundle_id
    assert "held-out training instances" in bundle.manifest.fusion.fitted_on
    leaves = bundle.fusion.tree.value[bundle.fusion.tree.left < 0]
    assert len(leaves) > 2  # it learnt something from the pairs

    texts = load_jsonl_split(sample_dir, "dev").texts[:20]
    fused_answers = load_predictor(fused).predict(texts, k=10).rankings
    everything = load_predictor(sample_bundle).predict(texts, k=100_000).rankings  # every candidate's RAE score
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


def test_a_fused_bundle_takes_appends_and_ranks_a_new_label(fused):
    predictor = load_predictor(fused)
    text = "zzfusionpkg: a packager for fused retrieval tests"
    predictor.append(AppendBatch(labels=[("zzfusionpkg", text)], instances=[(text + " tool", ["zzfusionpkg"])]))
    answer = predictor.predict([text], k=10)
    new_id = predictor.view.label_id("zzfusionpkg")
    assert new_id == predictor.bundle.manifest.counts.labels  # the first id past the bundle's labels
    assert new_id in answer.rankings[0].ids.tolist()


def test_a_compacted_fused_bundle_keeps_its_fusion_and_answers_as_the_grown_one(fused, tmp_path):
    grown = load_predictor(fused, appends_dir=tmp_path / "appends")
    text = "zzcompactpkg: compaction of fused memories"
    grown.append(
        AppendBatch(labels=[("zzcompactpkg", text)], instances=[(text + " helper", ["zzcompactpkg", "libc6"])])
    )
    manifest = compact_bundle(fused, tmp_path / "compacted", appends_dir=tmp_path / "appends")
    assert manifest.fusion is not None and manifest.counts.labels == grown.view.num_labels
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


def test_changing_the_rae_parameters_drops_the_fusion(fused, train, tmp_path):
    derived = derive_rae_bundle(fused, tmp_path / "d", train.Y, lam=0.2)
    assert derived.fusion is None and FUSION_FILE not in derived.files
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
