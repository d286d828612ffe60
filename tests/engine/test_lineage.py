"""One lineage per memory (docs/operations.md, "Lineage model"): a bundle and the bundles compacted,
reindexed or derived from it go on in one log, in one order, so an acknowledged label id names the
same label in all of them forever and every acknowledged append is applied exactly once; loading
takes no lock and creates nothing; a compaction with nothing to fold writes nothing; a bundle never
replays one file twice, nor a log outside its log directory. Each case of issues 43 and 53 found on
the engine is one test here."""

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from bundle.manifest import MANIFEST_FILE
from engine import AppendBatch, AppendRefused, appends_dir_beside, load_predictor
from export.compact import compact_bundle, main

HOLD_LOCK = """
import fcntl, os, sys, time
os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(120)
"""


def label(name: str) -> tuple[str, str]:
    return (f"zz-{name}", f"zz-{name}: a label appended in a lineage test")


def add_label(predictor, name: str, append_id: str | None = None) -> int:
    return predictor.append(AppendBatch(labels=[label(name)], append_id=append_id)).label_ids[f"zz-{name}"]


def add_instance(predictor, name: str, uid: str = "libc6", append_id: str | None = None):
    text = f"zz-{name}: an instance appended in a lineage test"
    return predictor.append(AppendBatch(instances=[(text, [uid])], append_id=append_id))


@pytest.fixture
def own_bundle(tiny_rae_bundle, tmp_path):
    """A copy, so that its default log directory (beside it) is this test's."""
    shutil.copytree(tiny_rae_bundle, tmp_path / "bundles" / "live")
    return tmp_path / "bundles" / "live"


@pytest.mark.parametrize("shared_dir", [True, False], ids=["XMCSERVE_APPEND_LOG_DIR", "default-dir"])
def test_a_compaction_with_nothing_to_fold_writes_nothing_and_every_append_stays_applied_once(
    own_bundle, tmp_path, shared_dir
):
    """Issue 43, case 1: compacting a bundle that was just compacted wrote a bundle with the
    source's id whose log was its own recorded source log, replayed twice at load."""
    appends = tmp_path / "appends" if shared_dir else None
    live = load_predictor(own_bundle, appends_dir=appends or appends_dir_beside(own_bundle))
    add_instance(live, "i1", append_id="i1")
    first = compact_bundle(own_bundle, tmp_path / "bundles" / "c1", appends_dir=appends)
    assert first.bundle_id != live.bundle.bundle_id
    with pytest.raises(RuntimeError, match="nothing to fold"):
        compact_bundle(tmp_path / "bundles" / "c1", tmp_path / "bundles" / "c2", appends_dir=appends)
    assert not (tmp_path / "bundles" / "c2").exists()
    c1_dir = appends or appends_dir_beside(tmp_path / "bundles" / "c1")
    c1 = load_predictor(tmp_path / "bundles" / "c1", appends_dir=c1_dir)
    add_label(c1, "l1")
    del c1
    gc.collect()
    restarted = load_predictor(tmp_path / "bundles" / "c1", appends_dir=c1_dir)
    assert restarted.view.appended_instances == 0 and restarted.view.appended_labels == 1  # i1 folded, once
    assert restarted.bundle.manifest.counts.train_instances == live.bundle.manifest.counts.train_instances + 1


def test_the_compaction_cli_says_there_is_nothing_to_fold_and_exits_non_zero(own_bundle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--bundle", str(own_bundle), "--out", str(tmp_path / "empty"), "--appends-dir", str(tmp_path / "a")])
    assert exited.value.code not in (0, None) and "nothing to fold" in str(exited.value.code)
    assert not (tmp_path / "empty").exists()


def test_a_compacted_bundle_s_id_hashes_its_lineage(own_bundle, tmp_path):
    """The same files at another point of the log are another bundle: two compactions folding
    different prefixes never share an id, and neither shares its source's."""
    appends = tmp_path / "appends"
    live = load_predictor(own_bundle, appends_dir=appends)
    add_label(live, "x1")
    one = compact_bundle(own_bundle, tmp_path / "one", appends_dir=appends)
    manifest = json.loads((tmp_path / "one" / MANIFEST_FILE).read_text())
    manifest["lineage"]["offset"] += 1  # the same files, claiming another point of the log
    (tmp_path / "one" / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="is not its content's"):
        load_predictor(tmp_path / "one", appends_dir=appends)
    assert one.bundle_id != live.bundle.bundle_id and one.lineage.offset == live.memory.log.size


def test_a_label_id_acknowledged_by_either_bundle_of_a_lineage_names_that_label_forever(own_bundle, tmp_path):
    """Issue 43, case 2: the source A kept acknowledging appends while its compaction C served as
    B; A gave p an id and C gave q the same id, and C's next load renumbered q."""
    appends = tmp_path / "appends"
    a = load_predictor(own_bundle, appends_dir=appends)
    add_label(a, "x0")
    compact_bundle(own_bundle, tmp_path / "c", appends_dir=appends)
    c = load_predictor(tmp_path / "c", appends_dir=appends)
    acked = {"p": add_label(a, "p"), "q": add_label(c, "q"), "r": add_label(a, "r"), "s": add_label(c, "s")}
    assert len(set(acked.values())) == 4, acked  # no id handed out twice
    for bundle in (tmp_path / "c", own_bundle, tmp_path / "c", own_bundle):  # reloads, in any order
        reloaded = load_predictor(bundle, appends_dir=appends)
        assert {name: reloaded.view.label_id(f"zz-{name}") for name in acked} == acked
        assert reloaded.view.num_labels == max(acked.values()) + 1


def test_one_uid_sent_to_both_bundles_of_a_lineage_is_refused_by_the_second(own_bundle, tmp_path):
    """Issue 43, case 2: the same uid sent to A and to C without an append_id made C unloadable."""
    appends = tmp_path / "appends"
    a = load_predictor(own_bundle, appends_dir=appends)
    add_label(a, "x0")
    compact_bundle(own_bundle, tmp_path / "c", appends_dir=appends)
    c = load_predictor(tmp_path / "c", appends_dir=appends)
    acked = add_label(a, "u")
    with pytest.raises(AppendRefused, match="already exists"):
        add_label(c, "u")
    assert c.view.label_id("zz-u") == acked  # C applied A's append before refusing its own
    assert load_predictor(tmp_path / "c", appends_dir=appends).view.label_id("zz-u") == acked
    # with an append_id, a retry that reaches the other bundle is the same append, once
    first = add_instance(a, "retried", append_id="once")
    again = add_instance(c, "retried", append_id="once")
    assert again.repeated and not first.repeated
    assert load_predictor(own_bundle, appends_dir=appends).view.appended_instances == 1


def test_loading_takes_no_lock_and_creates_no_directory(own_bundle, tmp_path):
    """Issue 43, case 4: merely serving a bundle created ``<bundle>.appends/`` and took its log's
    lock, so a second process serving it (a shadow) made B's load fail."""
    beside = appends_dir_beside(own_bundle)
    served = load_predictor(own_bundle, appends_dir=beside)
    deep = load_predictor(own_bundle, appends_dir=tmp_path / "not" / "yet")
    assert not beside.exists() and not (tmp_path / "not").exists()
    log_path = beside / f"{served.bundle.bundle_id}.appends.log"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(log_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # another process writes this lineage
        shadow = load_predictor(own_bundle, appends_dir=beside)  # loads all the same
        with pytest.raises(Exception, match="held for writing by another process") as refused:
            add_label(shadow, "x1")
        assert type(refused.value).__name__ == "AppendLogHeld" and shadow.view.version == 0
    finally:
        holder.kill()
        holder.wait(30)
    add_label(deep, "x1")  # the first append creates the directory
    assert (tmp_path / "not" / "yet" / f"{served.bundle.bundle_id}.appends.log").is_file()


@pytest.mark.parametrize("alias", ["same-path", "hard-link"])
def test_a_bundle_never_replays_one_file_twice(own_bundle, tmp_path, alias):
    """A bundle compacted before lineages whose recorded source log is its own log (issue 43,
    case 1, as written by the old compaction), under the same name or another name of the same
    inode: replayed once."""
    appends = tmp_path / "appends"
    live = load_predictor(own_bundle, appends_dir=appends)
    add_instance(live, "i1")  # no append_id: nothing but the file's identity tells a second replay
    log_path = live.memory.log.path
    name = log_path.name
    if alias == "hard-link":
        (tmp_path / "other").mkdir()
        os.link(log_path, tmp_path / "other" / name)
        name = f"../other/{name}"
    manifest = json.loads((own_bundle / MANIFEST_FILE).read_text())
    empty = hashlib.sha256(b"").hexdigest()
    entry = {"bundle_id": live.bundle.bundle_id, "log": name, "offset": 0, "sha256": empty}
    manifest["params"]["source_logs"] = [entry]  # params are not part of the id
    (own_bundle / MANIFEST_FILE).write_text(json.dumps(manifest))
    del live
    gc.collect()
    reloaded = load_predictor(own_bundle, appends_dir=appends)
    assert reloaded.view.appended_instances == 1 and reloaded.view.version == 1


@pytest.fixture(scope="module")
def memory_labels(sample_dir):
    """The label matrix of the tiny_rae_bundle's memory (its first 300 training instances)."""
    import numpy as np

    from xmc.data import load_jsonl_split

    return load_jsonl_split(sample_dir, "trn").subset(np.arange(300)).Y


def make_twin(how: str, source, out, appends, memory_labels):
    """A bundle made from ``source`` without its appends: reindexed, derived, retuned."""
    from export.derive import derive_rae_bundle
    from export.export_params import ExportParams
    from export.reindex import reindex_bundle, retune_bundle

    given = {} if appends is None else {"appends_dir": appends}  # the default log directories: none given
    if how == "reindexed":
        return reindex_bundle(source, out, ExportParams(index="ivfpq", pq_m=8, ivf_nprobe=64), **given)
    if how == "derived":
        return derive_rae_bundle(source, out, memory_labels, tau=0.2, **given)
    reindex_bundle(source, out.with_name(out.name + "-ivfpq"), ExportParams(index="ivfpq", pq_m=8), **given)
    return retune_bundle(out.with_name(out.name + "-ivfpq"), out, nprobe=64, **given)


@pytest.mark.parametrize("how", ["reindexed", "derived", "retuned"])
@pytest.mark.parametrize("shared_dir", [True, False], ids=["XMCSERVE_APPEND_LOG_DIR", "default-dir"])
def test_a_bundle_made_from_a_bundle_goes_on_in_its_source_s_lineage(
    own_bundle, tmp_path, memory_labels, how, shared_dir
):
    """Issue 53: export.reindex (and derive) started a new lineage: an append the source had
    acknowledged was missing from the twin, and its append_id retried there was applied again, so
    promoting the twin lost acknowledged appends. Now the twin replays the source's log (the
    appends made before and after it was made) with the same ids, and appends to that log."""
    appends = tmp_path / "appends" if shared_dir else None
    dir_of = (lambda bundle: appends) if shared_dir else appends_dir_beside
    live = load_predictor(own_bundle, appends_dir=dir_of(own_bundle))
    acked = {"a": add_label(live, "a", append_id="a")}
    first = add_instance(live, "i", append_id="i")
    out = own_bundle.with_name(f"twin-{how}")
    manifest = make_twin(how, own_bundle, out, appends, memory_labels)
    acked["b"] = add_label(live, "b", append_id="b")  # after the twin was made: replayed all the same
    twin = load_predictor(out, appends_dir=dir_of(out))
    assert {name: twin.view.label_id(f"zz-{name}") for name in acked} == acked
    assert twin.view.describe() == live.view.describe()
    assert manifest.lineage.bundle_id == live.bundle.bundle_id and manifest.lineage.offset == 0
    again = add_instance(twin, "i", append_id="i")  # a client's retry, reaching the twin
    assert again.repeated and again.version == first.version and twin.view.appended_instances == 1
    acked["t"] = add_label(twin, "t", append_id="t")  # the twin writes the lineage's one log
    acked["c"] = add_label(live, "c", append_id="c")  # after the twin's: the source catches up first
    assert len(set(acked.values())) == len(acked)
    del twin, live
    gc.collect()
    for bundle in (out, own_bundle):  # either, at a restart, serves the one memory
        restarted = load_predictor(bundle, appends_dir=dir_of(bundle))
        assert {name: restarted.view.label_id(f"zz-{name}") for name in acked} == acked
        assert restarted.view.version == 5 and restarted.view.appended_instances == 1


def test_a_bundle_made_from_a_compaction_goes_on_from_its_offset(own_bundle, tmp_path):
    """A twin of a compacted bundle keeps the compaction's offset (what it folded) and its
    append_ids: it replays only what came after, and recognises a retry of a folded append."""
    from export.export_params import ExportParams
    from export.reindex import reindex_bundle

    appends = tmp_path / "appends"
    live = load_predictor(own_bundle, appends_dir=appends)
    folded = add_label(live, "folded", append_id="folded")
    compacted = compact_bundle(own_bundle, tmp_path / "c1", appends_dir=appends)
    after = add_label(live, "after", append_id="after")
    twin = reindex_bundle(
        tmp_path / "c1", tmp_path / "c1-ivfpq", ExportParams(index="ivfpq", pq_m=8), appends_dir=appends
    )
    assert twin.lineage.model_copy(update={"seen": None}) == compacted.lineage
    assert twin.append_ids == compacted.append_ids and twin.lineage.seen == live.memory.log.size  # "after" too
    served = load_predictor(tmp_path / "c1-ivfpq", appends_dir=appends)
    assert served.view.version == 1 and served.view.label_id("zz-after") == after
    retried = served.append(AppendBatch(labels=[label("folded")], append_id="folded"))
    assert retried.repeated and retried.label_ids == {"zz-folded": folded}


def test_a_lineage_log_outside_the_log_directory_is_refused_at_load_and_nothing_is_created(own_bundle, tmp_path):
    """Issue 53: ``lineage.log`` was followed wherever its ``..`` led: a crafted bundle had its
    first append write a log outside the log directory (and create the directories on the way)."""
    from bundle.manifest import Manifest, content_id

    appends = tmp_path / "appends"
    live = load_predictor(own_bundle, appends_dir=appends)
    add_label(live, "x0")
    compact_bundle(own_bundle, tmp_path / "c", appends_dir=appends)
    log_name = live.memory.log.path.name
    elsewhere = tmp_path / "elsewhere" / "deep"
    elsewhere.mkdir(parents=True)
    shutil.copy(live.memory.log.path, elsewhere / log_name)  # a log of the lineage, outside the log directory
    (tmp_path / "c2").mkdir()
    for name in os.listdir(tmp_path / "c"):
        os.link(tmp_path / "c" / name, tmp_path / "c2" / name)

    def crafted(lineage: dict, bundle) -> None:
        manifest = json.loads((bundle / MANIFEST_FILE).read_text())
        manifest["lineage"] |= lineage
        manifest["bundle_id"] = content_id(Manifest.model_validate(manifest | {"bundle_id": "x"}))
        (bundle / MANIFEST_FILE).unlink()  # a hard link: the original keeps its manifest
        (bundle / MANIFEST_FILE).write_text(json.dumps(manifest))

    crafted({"log": f"../elsewhere/deep/{log_name}"}, tmp_path / "c")
    with pytest.raises(Exception, match="lineage log") as refused:
        load_predictor(tmp_path / "c", appends_dir=appends)
    assert "neither in the log directory" in str(refused.value)
    empty = hashlib.sha256(b"").hexdigest()
    crafted({"log": f"../../made/by/an/append/{log_name}", "offset": 0, "sha256": empty}, tmp_path / "c2")
    with pytest.raises(Exception, match="lineage log"):
        load_predictor(tmp_path / "c2", appends_dir=appends)
    assert (
        not (tmp_path.parent / "made").exists()
        and (elsewhere / log_name).read_bytes() == live.memory.log.path.read_bytes()
    )


def test_a_twin_made_without_appends_dir_and_served_with_its_source_s_log_dir_serves_its_appends(
    own_bundle, tmp_path, memory_labels
):
    """Issue 67: a twin made without --appends-dir names its source's log beside the source
    (``../live.appends/<id>.appends.log``), which a shared XMCSERVE_APPEND_LOG_DIR's "beside" test
    accepted for any directory; that log did not exist, and a missing log at offset 0 replayed as
    empty. Served with its source's log directory, the twin was served without the acknowledged
    appends, and a retried append_id was applied again under a new id. Now the twin finds its
    lineage's log in the directory it is served with, by its lineage's bundle id."""
    appends = tmp_path / "appends"  # the source's and then the twin's XMCSERVE_APPEND_LOG_DIR
    live = load_predictor(own_bundle, appends_dir=appends)
    acked = add_label(live, "a", append_id="a")
    manifest = make_twin("reindexed", own_bundle, own_bundle.with_name("twin"), None, memory_labels)
    assert manifest.lineage.bundle_id == live.bundle.bundle_id
    twin = load_predictor(own_bundle.with_name("twin"), appends_dir=appends)
    assert twin.view.label_id("zz-a") == acked and twin.view.describe() == live.view.describe()
    again = twin.append(AppendBatch(labels=[label("a")], append_id="a"))  # the client's retry
    assert again.repeated and again.label_ids == {"zz-a": acked} and twin.view.appended_labels == 1
    acked_t = add_label(twin, "t", append_id="t")  # the twin writes the log its source serves from
    assert load_predictor(own_bundle, appends_dir=appends).view.label_id("zz-t") == acked_t
    assert sorted(p.name for p in tmp_path.iterdir()) == ["appends", "bundles"]  # nothing made elsewhere


def test_a_twin_served_where_its_lineage_s_acknowledged_appends_are_not_is_refused_naming_appends_dir(
    own_bundle, tmp_path, memory_labels
):
    """The reverse: the source appended in its default log directory, the twin (made beside it,
    without --appends-dir) is served with another XMCSERVE_APPEND_LOG_DIR. The twin records how
    far its lineage's log went when it was made, so a log directory without those appends refuses
    it, naming --appends-dir, instead of serving it without them."""
    live = load_predictor(own_bundle, appends_dir=appends_dir_beside(own_bundle))
    add_label(live, "a", append_id="a")
    manifest = make_twin("reindexed", own_bundle, own_bundle.with_name("twin"), None, memory_labels)
    assert manifest.lineage.seen == live.memory.log.size > 0
    with pytest.raises(Exception, match="--appends-dir") as refused:
        load_predictor(own_bundle.with_name("twin"), appends_dir=tmp_path / "appends")
    assert type(refused.value).__name__ == "BundleError" and not (tmp_path / "appends").exists()
    beside = load_predictor(own_bundle.with_name("twin"), appends_dir=appends_dir_beside(own_bundle.with_name("twin")))
    assert beside.view.label_id("zz-a") == live.view.label_id("zz-a")  # where it was made for: served whole


def test_a_twin_of_a_source_with_no_appends_yet_writes_its_first_where_the_source_reads(
    own_bundle, tmp_path, memory_labels
):
    """The same twin made before its lineage logged anything: its first append created
    ``<log dir>/../<source>.appends/`` (its lineage.log read against the shared directory), a log
    its source, served with that XMCSERVE_APPEND_LOG_DIR, never reads; now it goes in the shared
    directory, and two logs of one lineage refuse the load."""
    appends = tmp_path / "appends"
    make_twin("reindexed", own_bundle, own_bundle.with_name("twin"), None, memory_labels)
    twin = load_predictor(own_bundle.with_name("twin"), appends_dir=appends)
    acked = add_label(twin, "first", append_id="first")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["appends", "bundles"]
    assert load_predictor(own_bundle, appends_dir=appends).view.label_id("zz-first") == acked
    stray = tmp_path / "live.appends" / twin.memory.log.path.name  # where lineage.log leads from there
    stray.parent.mkdir()
    stray.write_bytes(b"")
    with pytest.raises(Exception, match="two logs of lineage"):
        load_predictor(own_bundle.with_name("twin"), appends_dir=appends)
