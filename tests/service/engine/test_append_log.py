"""The append log: one writer per lineage enforced by the OS from the first append on, loads and
readers that never write or lock, log names only from checked bundle ids."""

import gc
import subprocess
import sys

import pytest

from export.compact import compact_bundle
from service.engine import AppendBatch, AppendLog, AppendLogError, AppendLogHeld, load_predictor
from service.engine.append_log import check_bundle_id

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
