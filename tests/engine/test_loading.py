"""Loading a bundle with its logs: compaction that reads the live log without touching it and a
compacted bundle that replays what came after, in both log-directory modes; identities checked
before a log is named; replay that refuses, or skips when asked, a record that no longer applies."""

import json
import shutil

import pytest

from bundle.manifest import MANIFEST_FILE
from engine import AppendBatch, BundleError, appends_dir_beside, load_predictor
from export.compact import compact_bundle


def label(name: str) -> tuple[str, str]:
    return (f"zz-{name}", f"zz-{name}: a label appended in a loading test")


def grow(predictor, name: str, append_id: str | None = None):
    return predictor.append(AppendBatch(labels=[label(name)], append_id=append_id))


@pytest.fixture
def own_bundle(tiny_rae_bundle, tmp_path):
    """A copy, so that its default log directory (beside it) is this test's."""
    shutil.copytree(tiny_rae_bundle, tmp_path / "bundles" / "live")
    return tmp_path / "bundles" / "live"


@pytest.mark.parametrize("shared_dir", [True, False], ids=["XMCSERVE_APPEND_LOG_DIR", "default-dir"])
def test_appends_acknowledged_during_a_compaction_are_served_by_the_compacted_bundle(own_bundle, tmp_path, shared_dir):
    """x1 before the compaction, x2 written half when it reads the log (a write in progress), x3
    after it: the source's log is left byte for byte, its writer keeps appending, and the
    compacted bundle serves all three, then its own appends, also after a restart."""
    appends = tmp_path / "shared" if shared_dir else None
    source_dir = appends or appends_dir_beside(own_bundle)
    live = load_predictor(own_bundle, appends_dir=source_dir)
    grow(live, "x1")
    grow(live, "x2")
    log_path = live.memory.log.path
    whole = log_path.read_bytes()
    first = len(whole.split(b"\n")[0]) + 1
    log_path.write_bytes(whole[: first + 40])  # the compaction meets x2 half written
    out = tmp_path / "bundles" / "compacted"
    manifest = compact_bundle(own_bundle, out, appends_dir=appends)
    assert log_path.read_bytes() == whole[: first + 40]  # not cut, not locked, not written
    log_path.write_bytes(whole)  # the write completes
    assert manifest.lineage.offset == first and manifest.lineage.log.endswith(log_path.name)
    grow(live, "x3")  # the live writer is not disturbed
    compacted_dir = appends or appends_dir_beside(out)
    compacted = load_predictor(out, appends_dir=compacted_dir)
    assert all(compacted.view.label_id(f"zz-{x}") is not None for x in ("x1", "x2", "x3"))
    assert compacted.view.num_labels == live.view.num_labels
    grow(compacted, "x4")
    del compacted
    restarted = load_predictor(out, appends_dir=compacted_dir)
    assert all(restarted.view.label_id(f"zz-{x}") is not None for x in ("x1", "x2", "x3", "x4"))
    assert restarted.view.num_labels == live.view.num_labels + 1


def test_a_source_log_altered_after_the_compaction_refuses_the_compacted_bundle(own_bundle, tmp_path):
    live = load_predictor(own_bundle, appends_dir=tmp_path / "appends")
    grow(live, "x1")
    compact_bundle(own_bundle, tmp_path / "compacted", appends_dir=tmp_path / "appends")
    live.memory.log.path.write_bytes(b"")  # the log the compaction read from is gone
    with pytest.raises(BundleError, match="not those the compaction folded"):
        load_predictor(tmp_path / "compacted", appends_dir=tmp_path / "appends")


def test_a_compaction_of_a_compacted_bundle_keeps_every_append(own_bundle, tmp_path):
    appends = tmp_path / "appends"
    live = load_predictor(own_bundle, appends_dir=appends)
    grow(live, "x1")
    compact_bundle(own_bundle, tmp_path / "c1", appends_dir=appends)
    grow(live, "x2")
    c1 = load_predictor(tmp_path / "c1", appends_dir=appends)
    grow(c1, "x3")
    compact_bundle(tmp_path / "c1", tmp_path / "c2", appends_dir=appends)
    grow(live, "x4")  # the first source still serving (a variant left on it)
    grow(c1, "x5")
    c2 = load_predictor(tmp_path / "c2", appends_dir=appends)
    assert all(c2.view.label_id(f"zz-x{i}") is not None for i in range(1, 6))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: m.update(bundle_id="../../outside-16d-0123456789ab"), "not of the form"),
        (lambda m: m.update(bundle_id="/abs/path"), "not of the form"),
        (lambda m: m.update(bundle_id="rae-memory-16d-0123456789ab"), "is not its content's"),
    ],
)
def test_a_bundle_id_that_is_not_its_content_s_is_refused_before_a_log_is_named(own_bundle, tmp_path, change, reason):
    manifest = json.loads((own_bundle / MANIFEST_FILE).read_text())
    change(manifest)
    (own_bundle / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=reason):
        load_predictor(own_bundle, appends_dir=tmp_path / "appends" / "deep")
    assert not (tmp_path / "appends").exists() and not (tmp_path / "outside-16d-0123456789ab.appends.log").exists()


def test_a_record_that_no_longer_applies_refuses_the_load_or_is_skipped_when_asked(own_bundle, tmp_path):
    live = load_predictor(own_bundle, appends_dir=tmp_path / "appends")
    grow(live, "x1")
    grow(live, "x2")
    log_path = live.memory.log.path
    lines = log_path.read_bytes().split(b"\n")
    del live
    log_path.write_bytes(b"\n".join([lines[0], lines[0], lines[1], b""]))  # x1 logged twice, no append_id
    with pytest.raises(BundleError, match=r"appends.log:2 \(byte \d+, append_id None\) no longer applies.*exists"):
        load_predictor(own_bundle, appends_dir=tmp_path / "appends")
    skipping = load_predictor(own_bundle, appends_dir=tmp_path / "appends", skip_refused=True)
    assert skipping.view.label_id("zz-x2") is not None and skipping.view.version == 2
    [skipped] = skipping.view.describe()["replay_skipped"]
    assert skipped["line"] == 2 and skipped["byte"] == len(lines[0]) + 1 and "already exists" in skipped["reason"]
    assert "replay_skipped" not in load_predictor(own_bundle).view.describe()  # reported only when there is one


def test_an_append_id_with_a_lone_surrogate_is_refused(own_bundle, tmp_path):
    from engine import AppendRefused

    live = load_predictor(own_bundle, appends_dir=tmp_path / "appends")
    with pytest.raises(AppendRefused, match="lone surrogate"):
        grow(live, "x1", append_id="bad-\ud800")
    assert live.view.version == 0
