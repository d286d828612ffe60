"""service.rollout.shadow_child: copies gathered into calls (same k and ef, up to the batch's
texts), each call's answers split back to its copies, and the comparison log's records (texts
by digest unless asked for)."""

import hashlib
import json
from collections import deque
from pathlib import Path

from service.rollout.shadow import ShadowConfig, text_digest
from service.rollout.shadow_child import WorkerLoop, split_answers, take_batch
from tests.service.rollout.test_shadow_worker import copy


def test_take_batch_keeps_k_apart_and_the_rest_in_order():
    pending = deque([copy(["a"]), copy(["b"], k=5), copy(["c", "d"]), copy(["e", "f"]), copy(["g"])])
    batch = take_batch(pending, batch_texts=4)
    assert [c.request.texts for c in batch] == [["a"], ["c", "d"], ["g"]]
    assert [c.request.texts for c in pending] == [["b"], ["e", "f"]]
    big = deque([copy([str(i) for i in range(9)]), copy(["z"])])
    assert len(take_batch(big, batch_texts=4)) == 1  # a copy over the limit still goes, alone


def test_split_answers_gives_each_copy_its_texts_answers():
    batch = [copy(["a"]), copy(["b", "c"])]
    answers = [[("A", 1.0)], [("B", 1.0)], [("C", 1.0)]]
    assert split_answers(answers, batch) == [[[("A", 1.0)]], [[("B", 1.0)], [("C", 1.0)]]]


class RecordingLog:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def logged(config):
    """The comparison log's records of one call carrying two copies (three texts)."""
    log = RecordingLog()
    loop = WorkerLoop(None, None, None, config, log, workers=1, target_name="http://shadow")
    batch = [copy(["a private query"]), copy(["b", "a private query"])]
    answers = [[[("x", 1.0)]], [[("x", 1.0)], [("y", 1.0)]]]
    try:
        loop._compare(batch, answers, shadow_seconds=0.02)
    finally:
        loop._pool.shutdown()
    return log.records


def test_the_comparison_log_names_texts_by_digest_not_by_text():
    """Request texts are never logged by default (docs/operations.md): the log carries a short
    sha256 of each text, the same for the same text, so an operator can still join its lines."""
    records = logged(ShadowConfig(log=Path("unused")))
    assert [r["text_sha256"] for r in records] == [text_digest(t) for t in ("a private query", "b", "a private query")]
    assert records[0]["text_sha256"] == hashlib.sha256(b"a private query").hexdigest()[:16]
    assert all("text" not in r for r in records)
    assert "a private query" not in json.dumps(records)


def test_the_comparison_log_writes_texts_only_when_asked_to():
    records = logged(ShadowConfig(log=Path("unused"), log_texts=True))
    assert [r["text"] for r in records] == ["a private query", "b", "a private query"]
    assert records[1]["text_sha256"] == text_digest("b")
