"""The append log: one writer per lineage enforced by the OS from the first append on, loads and
readers that never write or lock, log names only from checked bundle ids."""

import gc
import subprocess
import sys

import pytest

from engine import AppendBatch, AppendLogError, AppendLogHeld, load_predictor
from engine.append_log import check_bundle_id
from engine.offline import AppendLog
from export.compact import compact_bundle

LABEL = ("zz-log-label", "zz-log-label: a label appended in a log test")

HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def rae(tiny_rae_bundle, tmp_path):
    return load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")


def test_a_second_process_cannot_append_to_a_held_log_but_can_load_and_read_it(tiny_rae_bundle, tmp_path):
    """Another process holds the log's lock (a second server on the same directory that appended):
    this one loads the bundle and serves it, but its append is refused naming the log; compaction,
    a reader, still works; once the holder is gone the append succeeds."""
    first = load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")
    first.append(AppendBatch(labels=[LABEL]))
    log_path = first.memory.log.path
    del first  # this process lets go of the log (its lock goes with the last predictor using it)
    gc.collect()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(log_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")
        assert second.view.label_id(LABEL[0]) is not None  # loaded, the log replayed
        with pytest.raises(AppendLogHeld, match="held for writing by another process") as refused:
            second.append(AppendBatch(labels=[("zz-second", "zz-second: refused")]))
        assert str(log_path) in str(refused.value) and second.view.version == 1
        before = log_path.read_bytes()
        out = compact_bundle(tiny_rae_bundle, tmp_path / "compacted", appends_dir=tmp_path / "appends")
        assert out.counts.labels == load_predictor(tiny_rae_bundle).view.num_labels + 1
        assert log_path.read_bytes() == before
    finally:
        holder.kill()
        holder.wait(30)
    second.append(AppendBatch(labels=[("zz-second", "zz-second: appended once the holder is gone")]))
    assert load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends").view.version == 2


def test_predictors_of_one_process_share_the_lock(rae, tiny_rae_bundle, tmp_path):
    """A and B of one server on one bundle, or a reload of the bundle serving: not another process.
    Neither holds the log before its first append."""
    again = load_predictor(tiny_rae_bundle, appends_dir=tmp_path / "appends")
    assert not again.memory.log.writing and not rae.memory.log.writing
    rae.append(AppendBatch(labels=[LABEL]))
    again.append(AppendBatch(labels=[("zz-again", "zz-again: appended by the other predictor")]))
    assert again.memory.log.writing and rae.memory.log.writing


@pytest.mark.parametrize("bundle_id", ["../escape-16d-0123456789ab", "/tmp/x", "a.b-16d-0123456789ab", "", "UP-1"])
def test_a_log_is_never_named_from_a_free_form_id(tmp_path, bundle_id):
    with pytest.raises(AppendLogError, match="no append log is named from it"):
        AppendLog.in_directory(tmp_path, bundle_id)
    assert check_bundle_id("rae-memory-16d-0123456789ab") == "rae-memory-16d-0123456789ab"


def test_a_torn_tail_is_left_in_place_by_a_reader(rae, tmp_path):
    rae.append(AppendBatch(labels=[LABEL]))
    log_path = rae.memory.log.path
    whole = log_path.read_bytes()
    log_path.write_bytes(whole + b"0123 {unfinished")  # a write in progress
    read = AppendLog(log_path, rae.bundle.bundle_id).read()
    assert len(read.records) == 1 and read.size == len(whole)
    assert log_path.read_bytes() == whole + b"0123 {unfinished"


class Lag:
    """How far reading a log runs ahead of applying it: the records decoded and not yet applied
    when each one is applied (the most a replay or a catch-up holds at once), and each read's size."""

    def __init__(self, monkeypatch):
        from engine import append_log
        from engine.memory import Memory

        self.decoded = self.applied = self.most = 0
        self.reads: list[int] = []
        decode, replay = AppendLog._decode, Memory.replay

        def counted_decode(log, line):
            self.decoded += 1
            return decode(log, line)

        def counted_replay(memory, batch, vectors):
            self.most = max(self.most, self.decoded - self.applied)
            self.applied += 1
            return replay(memory, batch, vectors)

        def spied_open(path, mode="r", *args, **kwargs):
            return SpiedFile(open(path, mode, *args, **kwargs), self.reads)

        monkeypatch.setattr(AppendLog, "_decode", counted_decode)
        monkeypatch.setattr(Memory, "replay", counted_replay)
        monkeypatch.setattr(append_log, "open", spied_open, raising=False)


class SpiedFile:
    def __init__(self, file, reads: list[int]):
        self.file, self.reads = file, reads

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def read(self, *args):
        data = self.file.read(*args)
        self.reads.append(len(data))
        return data


def test_replay_and_catch_up_read_the_log_a_chunk_at_a_time(tiny_rae_bundle, tmp_path, monkeypatch):
    """Issue 53: a load's replay and a catch-up (a promote's, an append's) read a whole log tail
    into memory, decoded, before applying any of it: in the serving process, under the admin lock,
    outside the vetting child's memory cap. Now they read a fixed number of bytes at a time and
    apply each record as it is read."""
    from engine import append_log

    appends = tmp_path / "appends"
    writer = load_predictor(tiny_rae_bundle, appends_dir=appends)
    behind = load_predictor(tiny_rae_bundle, appends_dir=appends)  # another slot of the lineage
    records = 30
    for i in range(records):
        writer.append(AppendBatch(labels=[(f"zz-chunk-{i}", f"zz-chunk-{i}: a label of a long log tail")]))
    size = writer.memory.log.path.stat().st_size
    chunk = 3 * size // records  # about three records a read
    monkeypatch.setattr(append_log, "READ_CHUNK_BYTES", chunk, raising=False)

    lag = Lag(monkeypatch)
    reloaded = load_predictor(tiny_rae_bundle, appends_dir=appends)
    assert reloaded.view.version == records and lag.applied == records
    assert lag.most <= 4, f"{lag.most} records read ahead of the replay"
    assert lag.reads and max(lag.reads) <= chunk and sum(lag.reads) >= size

    lag = Lag(monkeypatch)
    assert behind.memory.catch_up() == records and behind.view.version == records
    assert lag.most <= 4, f"{lag.most} records read ahead of the catch-up"
    assert lag.reads and max(lag.reads) <= chunk and sum(lag.reads) >= size
    behind.append(AppendBatch(labels=[("zz-chunk-last", "zz-chunk-last: after catching up")]))
    assert load_predictor(tiny_rae_bundle, appends_dir=appends).view.version == records + 1


@pytest.mark.parametrize(
    ("relative", "accepted"),
    [
        ("{log}", True),  # the log directory itself (a shared XMCSERVE_APPEND_LOG_DIR)
        ("../source.appends/{log}", True),  # the default log directory of a bundle beside it
        ("../appends/../source.appends/{log}", True),
        ("../../elsewhere.appends/{log}", False),
        ("../outside/{log}", False),
        ("deeper/{log}", False),  # a directory the first append would create
        ("../source.appends/deeper/{log}", False),
        ("/abs/source.appends/{log}", False),
        ("../source.appends/other-16d-0123456789ab.appends.log", False),
    ],
)
def test_a_lineage_log_is_found_only_in_the_log_directory_or_a_bundle_s_beside_it(tmp_path, relative, accepted):
    from engine.append_log import lineage_log_path

    lineage = "rae-memory-16d-0123456789ab"
    named = relative.format(log=f"{lineage}.appends.log")
    if accepted:
        path = lineage_log_path(tmp_path / "appends", named, lineage)
        assert path.parent in (tmp_path / "appends", tmp_path / "source.appends")
    else:
        with pytest.raises(AppendLogError, match="lineage log"):
            lineage_log_path(tmp_path / "appends", named, lineage)


def test_in_a_group_the_others_records_are_read_under_the_lock_or_the_read_is_refused(
    tiny_rae_bundle, tmp_path, monkeypatch
):
    """Issue 67: with XMCSERVE_WORKERS, a search that could not take the log's shared lock within
    its wait ran without the newest records (an acknowledged append missing from another worker's
    answer); a catch-up read them without the lock, and a load ignored that it had not got it.
    Now each of them is refused (MemoryBusy: a /predict answers 503) while another worker holds the
    log, and reads the records once it lets go."""
    from engine import MemoryBusy, append_log

    monkeypatch.setattr(append_log, "_shared_writes", True)  # as share_writes() makes a group's worker
    monkeypatch.setattr(append_log, "READ_WAIT_S", 0.05)
    appends = tmp_path / "appends"
    writer = load_predictor(tiny_rae_bundle, appends_dir=appends)
    reader = load_predictor(tiny_rae_bundle, appends_dir=appends)  # another worker's memory
    writer.append(AppendBatch(labels=[LABEL], append_id="acked"))
    log_path = writer.memory.log.path
    # a worker between its write and its apply (or its taking the record back) holds the log
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(log_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(MemoryBusy):
            reader.latest_view()  # the view a batch searches
        with pytest.raises(MemoryBusy):
            reader.memory.catch_up()  # a promote's, an append's
        with pytest.raises(MemoryBusy):
            load_predictor(tiny_rae_bundle, appends_dir=appends)
        assert reader.view.label_id(LABEL[0]) is None and reader.memory.log.size == 0
    finally:
        holder.kill()
        holder.wait(30)
    assert reader.latest_view().label_id(LABEL[0]) == writer.view.label_id(LABEL[0])
    assert load_predictor(tiny_rae_bundle, appends_dir=appends).view.label_id(LABEL[0]) is not None
