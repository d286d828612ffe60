"""service.rollout.shadow_child: copies gathered into calls (same k and ef, up to the batch's
texts) and each call's answers split back to its copies."""

from collections import deque

from service.rollout.shadow_child import split_answers, take_batch
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
