"""Live memory: appends found by the next search, refused cleanly, durable across restarts and
torn writes, atomic under concurrent searches, and folded into an equivalent bundle."""

import threading

import numpy as np
import pytest

from engine import AppendBatch, AppendLogError, AppendRefused, BundleError, load_predictor
from engine import memory as memory_module
from export.compact import compact_bundle

NEW_LABEL = ("zz-new-label", "zz-new-label: a package published after the bundle was built")
NEW_INSTANCE = ("zz-new-tool: a command line tool for the new label", ["zz-new-label"])


def grow(predictor, batch=None):
    return predictor.append(batch or AppendBatch(labels=[NEW_LABEL], instances=[NEW_INSTANCE]))


def uids_of(prediction, row=0):
    return [prediction.view.label_uids[i] for i in prediction.rankings[row].ids.tolist()]


@pytest.fixture
def rae(tiny_rae_bundle, tmp_path):
    return load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")


def test_an_appended_instance_and_label_are_found_by_the_next_search(rae):
    text = NEW_INSTANCE[0]
    assert "zz-new-label" not in uids_of(rae.predict([text], k=5))
    outcome = grow(rae)
    view = rae.view
    assert outcome.version == 1 and outcome.instances == 1
    assert outcome.label_ids == {"zz-new-label": view.num_labels - 1}
    assert view.describe() | {"keys": 0} == {
        "version": 1,
        "keys": 0,
        "labels": view.num_labels,
        "appended_labels": 1,
        "appended_instances": 1,
    }
    # the new instance key is the query itself: its label takes the top
    assert uids_of(rae.predict([text], k=5))[0] == "zz-new-label"
    # ... and excluding it by uid removes it, as for any label
    excluded = rae.predict([text], k=5, exclude=[view.label_ids(["zz-new-label"])])
    assert "zz-new-label" not in uids_of(excluded)


def test_a_label_index_takes_new_labels(bundle_root, tmp_path):
    predictor = load_predictor(bundle_root / "tiny-labels", appends_dir=tmp_path)
    before = predictor.view.num_labels
    outcome = grow(predictor, AppendBatch(labels=[NEW_LABEL]))
    assert outcome.label_ids == {NEW_LABEL[0]: before}
    assert uids_of(predictor.predict([NEW_LABEL[1]], k=3))[0] == NEW_LABEL[0]
    with pytest.raises(AppendRefused, match="label index"):
        grow(predictor, AppendBatch(instances=[NEW_INSTANCE]))


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (AppendBatch(), "nothing to append"),
        (AppendBatch(instances=[("a tool", ["no-such-uid"])]), "unknown label uids"),
        (AppendBatch(labels=[NEW_LABEL, NEW_LABEL]), "given twice"),
        (AppendBatch(labels=[("libc6", "libc6 again")]), "already exists"),
        (AppendBatch(labels=[("fresh", "   ")]), "empty text"),
        (AppendBatch(instances=[("", ["libc6"])]), "empty text"),
        (AppendBatch(instances=[("a tool", [])]), "no labels"),
        (AppendBatch(instances=[("a tool", ["libc6", "libc6"])]), "given twice"),
    ],
)
def test_bad_appends_are_refused_and_change_nothing(rae, batch, reason):
    with pytest.raises(AppendRefused, match=reason):
        grow(rae, batch)
    assert rae.view.version == 0 and not rae.memory.log.path.exists()  # refused before the log is opened


def test_an_append_id_is_applied_once(rae):
    batch = AppendBatch(labels=[NEW_LABEL], instances=[NEW_INSTANCE], append_id="batch-1")
    first, again = grow(rae, batch), grow(rae, batch)
    assert (first.repeated, again.repeated) == (False, True) and again.version == first.version == 1
    assert again.label_ids == first.label_ids and rae.view.version == 1
    with pytest.raises(AppendRefused, match="already used"):
        grow(rae, AppendBatch(labels=[("other", "other: text")], append_id="batch-1"))


def test_a_restart_replays_the_log_to_the_same_answers(rae, tiny_rae_bundle, tmp_path):
    grow(rae)
    grow(rae, AppendBatch(instances=[("zz-second-tool: another user of the new label", ["zz-new-label", "libc6"])]))
    queries = [NEW_INSTANCE[0], "zz-second-tool", "libc6: GNU C Library"]
    expected = rae.predict(queries, k=10)
    restarted = load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")
    assert restarted.view.describe() == rae.view.describe()
    again = restarted.predict(queries, k=10)
    for row in range(len(queries)):
        assert uids_of(again, row) == uids_of(expected, row)
        np.testing.assert_allclose(again.rankings[row].scores, expected.rankings[row].scores, rtol=1e-5)


def test_a_crash_while_writing_leaves_all_or_none_of_the_append(rae, tiny_rae_bundle, tmp_path):
    grow(rae)
    log_path = rae.memory.log.path
    one = log_path.stat().st_size
    grow(rae, AppendBatch(labels=[("zz-other", "zz-other: a second new label")]))
    whole = log_path.read_bytes()
    for cut in [one + 1, one + 70, (one + len(whole)) // 2, len(whole) - 1]:
        log_path.write_bytes(whole[:cut])  # the process died with this much of the record written
        restarted = load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")
        assert restarted.view.version == 1 and restarted.view.label_id("zz-other") is None, cut
        assert log_path.read_bytes() == whole[:cut]  # a load writes nothing
        restarted.append(AppendBatch(labels=[("zz-after", "zz-after: appended after the crash")]))
        after = log_path.read_bytes()  # the next writer cut the torn tail off before writing
        assert after.startswith(whole[:one]) and after.count(b"\n") == 2 and b"zz-other" not in after
    log_path.write_bytes(whole)
    assert load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends").view.label_id("zz-other") is not None
    # damage before the end is not a crash but an altered log: refused
    log_path.write_bytes(whole[:10] + b"x" + whole[11:])
    with pytest.raises(BundleError, match="append log"):
        load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")


class FailingIndex:
    """The real index, whose ``fail_at``-th insertion call raises (out of memory, say)."""

    def __init__(self, index, fail_at: int):
        self.index, self.fail_at, self.calls = index, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.index, name)

    def add(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise MemoryError("simulated")
        return self.index.add(*args, **kwargs)


def test_an_append_that_fails_midway_is_taken_back(rae, monkeypatch):
    monkeypatch.setattr(memory_module, "APPEND_CHUNK", 1)
    real = rae.memory.index
    monkeypatch.setattr(rae.memory, "index", FailingIndex(real, fail_at=2))
    with pytest.raises(MemoryError):
        grow(rae)
    assert rae.view.version == 0 and rae.view.label_id("zz-new-label") is None
    assert rae.memory.log.path.stat().st_size == 0  # the record is cut back
    # the key inserted before the failure stays invisible (a search that met it would fail)
    assert "zz-new-label" not in uids_of(rae.predict([NEW_LABEL[1]], k=10))
    monkeypatch.setattr(rae.memory, "index", real)
    assert grow(rae).version == 1 and uids_of(rae.predict([NEW_INSTANCE[0]], k=1)) == ["zz-new-label"]


def test_an_unwritable_log_refuses_the_append(tiny_rae_bundle, tmp_path):
    (tmp_path / "not-a-dir").write_text("a file where the log directory should be")
    predictor = load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "not-a-dir")
    with pytest.raises(AppendLogError):
        grow(predictor)
    assert predictor.view.version == 0


def test_searches_during_appends_see_each_append_whole(rae, monkeypatch):
    """Each append adds a label and 20 instances of it; every search must see the label with all
    its keys or none of them: the value rows, keys and labels of its view always agree."""
    monkeypatch.setattr(memory_module, "APPEND_CHUNK", 4)  # many lock hand-overs per append
    stop, seen, problems = threading.Event(), [], []

    def search_loop():
        for _ in range(400):  # bounded; the appends end it sooner
            if stop.is_set():
                return
            prediction = rae.predict(["zz-label-3: new"], k=10)
            view = prediction.view
            seen.append(view.version)
            if (
                view.values.num_rows != view.num_keys
                or view.num_labels != rae.bundle.manifest.counts.labels + view.version
            ):
                problems.append(view.describe())
            if any(i >= view.num_labels for i in prediction.rankings[0].ids.tolist()):
                problems.append("an id beyond its view")

    searcher = threading.Thread(target=search_loop)
    searcher.start()
    try:
        for i in range(6):
            uid = f"zz-label-{i}"
            instances = [(f"{uid}: new instance {j}", [uid]) for j in range(20)]
            grow(rae, AppendBatch(labels=[(uid, f"{uid}: new")], instances=instances))
    finally:
        stop.set()
        searcher.join(60)
    assert not problems, problems[:3]
    assert seen == sorted(seen) and len(set(seen)) >= 2  # searches ran between appends
    assert uids_of(rae.predict(["zz-label-3: new instance 7"], k=1)) == ["zz-label-3"]


def test_compaction_serves_what_the_grown_memory_served(rae, tiny_rae_bundle, tmp_path):
    grow(rae)
    instances = [(f"zz-more-{j}: another new tool", ["zz-new-label", "libc6"]) for j in range(5)]
    grow(rae, AppendBatch(labels=[("zz-late", "zz-late: added last")], instances=instances))
    out = compact_bundle(tiny_rae_bundle, tmp_path / "compacted", appends_dir=tmp_path / "appends")
    assert out.params["compacted_from"] == rae.bundle.bundle_id and out.params["appends"] == 2
    compacted = load_predictor(tmp_path / "compacted", appends_dir=tmp_path / "appends")
    assert compacted.view.version == 0  # the source log holds nothing past what was folded in
    assert out.counts.labels == rae.view.num_labels and out.counts.memory_rows == rae.view.num_keys
    assert compacted.view.label_uids == rae.view.label_uids[: rae.view.num_labels]
    queries = [NEW_INSTANCE[0], "zz-more-3: another new tool", "zz-late", "libc6: GNU C Library"]
    exhaustive = rae.view.num_keys  # an ef as large as the memory: both searches are exact
    grown, rebuilt = rae.predict(queries, 10, ef=exhaustive), compacted.predict(queries, 10, ef=exhaustive)
    for row in range(len(queries)):
        assert uids_of(rebuilt, row) == uids_of(grown, row)
        np.testing.assert_allclose(rebuilt.rankings[row].scores, grown.rankings[row].scores, rtol=1e-4, atol=1e-6)


def test_a_second_writer_of_one_log_catches_up_first_and_a_duplicate_record_is_skipped(rae, tiny_rae_bundle, tmp_path):
    """Two predictors of one bundle over one log (A and B of one server): the one that did not
    write last applies the other's appends before its own, so both hold one order."""
    other = load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")
    grow(rae, AppendBatch(labels=[NEW_LABEL], instances=[NEW_INSTANCE], append_id="once"))
    outcome = other.append(AppendBatch(labels=[("zz-other", "zz-other: text")]))
    assert other.view.label_id(NEW_LABEL[0]) == rae.view.label_id(NEW_LABEL[0])
    assert outcome.label_ids["zz-other"] == rae.view.num_labels and other.view.version == 2
    del other
    # the same append logged twice (a retry that reached two writers) is applied once on replay
    log_path = rae.memory.log.path
    data = log_path.read_bytes()
    log_path.write_bytes(data.split(b"\n")[0] + b"\n" + data)
    assert load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends").view.version == 2


def test_a_compacted_bundle_replays_what_its_source_got_after_the_compaction(rae, tiny_rae_bundle, tmp_path):
    grow(rae)
    compact_bundle(tiny_rae_bundle, tmp_path / "compacted", appends_dir=tmp_path / "appends")
    grow(rae, AppendBatch(labels=[("zz-late", "zz-late: appended while the compaction was shipped")]))
    compacted = load_predictor(tmp_path / "compacted", appends_dir=tmp_path / "appends")
    assert compacted.view.label_id("zz-new-label") is not None and compacted.view.label_id("zz-late") is not None
    assert compacted.view.describe()["labels"] == rae.view.num_labels


@pytest.fixture(scope="module")
def ivfpq_rae(distilbert_dir, sample_dir, tmp_path_factory):
    """The tiny_rae_bundle's inputs with the compressed index."""
    from export.build import ExportParams, build_bundle
    from xmc.data import load_jsonl_split

    train = load_jsonl_split(sample_dir, "trn")
    out = tmp_path_factory.mktemp("ivfpq") / "tiny-rae-ivfpq"
    params = ExportParams(dim=16, index="ivfpq", pq_m=8, ivf_nprobe=64, max_train=300, rae_top_b=50)
    build_bundle(out, train.labels, train, distilbert_dir, params)
    return out


class PartWayIndex:
    """The real index, whose ``fail_at``-th insertion call inserts its first ``keep`` keys and
    then raises (as hnswlib's add_items does when a key fails, or faiss when memory runs out)."""

    def __init__(self, index, fail_at: int, keep: int):
        self.index, self.fail_at, self.keep, self.calls = index, fail_at, keep, 0

    def __getattr__(self, name):
        return getattr(self.index, name)

    def add(self, data, ids, threads: int = 1):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.keep:
                self.index.add(data[: self.keep], ids[: self.keep], threads=threads)
            raise MemoryError("simulated: an insertion failed")
        return self.index.add(data, ids, threads=threads)


class FailingFaissThreads:
    """ivfpq's faiss_threads, raising on leaving its ``fail_at``-th use: faiss has taken the keys'
    codes, the index's buffer and count have not."""

    real = None
    fail_at = 0
    uses = 0

    def __init__(self, count: int):
        self.inner = type(self).real(count)

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        type(self).uses += 1
        if type(self).uses == type(self).fail_at:
            raise RuntimeError("simulated: faiss failed after adding the codes")


@pytest.mark.parametrize(
    ("kind", "where"),
    [
        ("hnswlib", "between chunks"),
        ("hnswlib", "inside a chunk"),
        ("ivfpq", "between chunks"),
        ("ivfpq", "inside a chunk"),
        ("ivfpq", "after faiss added"),
    ],
)
def test_an_append_that_fails_part_way_leaves_the_memory_as_it_was_and_the_next_one_applies(
    tiny_rae_bundle, ivfpq_rae, tmp_path, monkeypatch, kind, where
):
    """Issue 53: an insertion failing part-way left ivfpq's count ahead of the view (every later
    append refused until a restart), and hnswlib's keys inserted but not yet hidden answering
    searches past the view's keys. Now the failed append's keys are taken back out: the same
    answers as before, and the retried append gives the memory a restart replays."""
    from engine.index import ivfpq as ivfpq_module

    bundle = tiny_rae_bundle if kind == "hnswlib" else ivfpq_rae
    predictor = load_predictor(bundle, appends_dir=tmp_path / "appends")
    monkeypatch.setattr(memory_module, "APPEND_CHUNK", 4)  # the append below inserts 14 keys in 4 chunks
    grow(predictor, AppendBatch(labels=[("zz-before", "zz-before: appended before the failure")]))
    queries = [NEW_LABEL[1], NEW_INSTANCE[0], "zz-tool-3 for the new label", "libc6: GNU C Library"]
    ef = predictor.view.num_keys + 20  # as wide as the memory: the answers do not depend on the graph's history
    before, described = predictor.predict(queries, 10, ef=ef), predictor.view.describe()
    size = predictor.memory.log.path.stat().st_size
    tools = [(f"zz-tool-{j} for the new label", ["zz-new-label", "libc6"]) for j in range(12)]
    batch = AppendBatch(labels=[NEW_LABEL], instances=[NEW_INSTANCE, *tools], append_id="part-way")
    real = predictor.memory.index
    if where == "after faiss added":
        monkeypatch.setattr(FailingFaissThreads, "real", ivfpq_module.faiss_threads)
        monkeypatch.setattr(FailingFaissThreads, "fail_at", 2)  # the second chunk's insertion
        monkeypatch.setattr(FailingFaissThreads, "uses", 0)
        monkeypatch.setattr(ivfpq_module, "faiss_threads", FailingFaissThreads)
        error = RuntimeError
    else:  # the second chunk fails before inserting anything, or the third after two of its keys
        keep = 0 if where == "between chunks" else 2
        monkeypatch.setattr(predictor.memory, "index", PartWayIndex(real, fail_at=2 + (keep > 0), keep=keep))
        error = MemoryError
    with pytest.raises(error, match="simulated"):
        grow(predictor, batch)
    monkeypatch.undo()

    assert predictor.view.describe() == described and predictor.view.label_id(NEW_LABEL[0]) is None
    assert predictor.memory.log.path.stat().st_size == size  # the record is cut back
    if kind == "ivfpq":
        assert real.count == real.index.ntotal == predictor.view.num_keys
    after = predictor.predict(queries, 10, ef=ef)  # nothing of the failed append answers
    for row in range(len(queries)):
        assert uids_of(after, row) == uids_of(before, row), row
        np.testing.assert_allclose(after.rankings[row].scores, before.rankings[row].scores, rtol=1e-6)

    outcome = grow(predictor, batch)  # the same append again: applied whole, where it would have gone
    assert not outcome.repeated and outcome.version == 2 and predictor.view.num_keys == described["keys"] + 14
    grow(predictor, AppendBatch(labels=[("zz-after", "zz-after: appended after the failure")]))
    restarted = load_predictor(bundle, appends_dir=tmp_path / "appends")
    assert restarted.view.describe() == predictor.view.describe()
    grown, replayed = predictor.predict(queries, 10, ef=ef), restarted.predict(queries, 10, ef=ef)
    for row in range(len(queries)):
        assert uids_of(grown, row) == uids_of(replayed, row), row
        np.testing.assert_allclose(grown.rankings[row].scores, replayed.rankings[row].scores, rtol=1e-5)
    assert uids_of(grown, 1)[0] == "zz-new-label"
