import math

import pytest
import torch

from training.losses import (
    BinaryCrossEntropyLoss,
    DecoupledSoftmaxLoss,
    InfoNCELoss,
    MultiPositiveSoftmaxLoss,
    RaeContrastiveLoss,
)

# one query, pool of 4 labels: positives 0 and 1, label 3 ignored (the query's own item)
SCORES = torch.tensor([[2.0, 1.0, 0.5, 3.0]])
POS = torch.tensor([[True, True, False, False]])
IGN = torch.tensor([[False, False, False, True]])


def lse(*xs):
    return math.log(sum(math.exp(x) for x in xs))


def test_decoupled_softmax_by_hand():
    # each positive against the negatives only (label 2); the ignored label takes no part
    expected = ((lse(2.0, 0.5) - 2.0) + (lse(1.0, 0.5) - 1.0)) / 2
    assert DecoupledSoftmaxLoss()(SCORES, POS, IGN).item() == pytest.approx(expected, rel=1e-6)


def test_multi_positive_softmax_by_hand():
    denominator = lse(2.0, 1.0, 0.5)  # every non-ignored pool label, positives included
    expected = ((denominator - 2.0) + (denominator - 1.0)) / 2
    assert MultiPositiveSoftmaxLoss()(SCORES, POS, IGN).item() == pytest.approx(expected, rel=1e-6)


def test_infonce_takes_one_random_positive_per_query_not_the_lowest_column():
    by_target = {lse(2.0, 1.0, 0.5) - 2.0: 0, lse(2.0, 1.0, 0.5) - 1.0: 0}
    torch.manual_seed(0)
    for _ in range(200):
        value = InfoNCELoss()(SCORES, POS, IGN).item()
        match = [t for t in by_target if value == pytest.approx(t, rel=1e-6)]
        assert len(match) == 1  # always exactly one of the two single-positive losses
        by_target[match[0]] += 1
    assert min(by_target.values()) > 60  # both positives are drawn, about evenly


def test_bce_by_hand():
    def softplus(x):
        return math.log1p(math.exp(x))

    expected = (softplus(-2.0) + softplus(-1.0) + softplus(0.5)) / 3
    assert BinaryCrossEntropyLoss()(SCORES, POS, IGN).item() == pytest.approx(expected, rel=1e-6)


def test_rows_without_positives_are_left_out_and_an_empty_batch_is_zero():
    scores = torch.cat([SCORES, torch.tensor([[9.0, 9.0, 9.0, 9.0]])])
    pos = torch.cat([POS, torch.zeros(1, 4, dtype=torch.bool)])
    ign = torch.cat([IGN, torch.zeros(1, 4, dtype=torch.bool)])
    single = DecoupledSoftmaxLoss()(SCORES, POS, IGN)
    assert DecoupledSoftmaxLoss()(scores, pos, ign).item() == pytest.approx(single.item())
    empty = torch.zeros(2, 3, requires_grad=True)
    none = torch.zeros(2, 3, dtype=torch.bool)
    for loss in (DecoupledSoftmaxLoss(), MultiPositiveSoftmaxLoss(), InfoNCELoss()):
        value = loss(empty, none, none)
        assert value.item() == 0.0
        value.backward()  # still part of the graph


def test_decoupled_softmax_does_not_punish_many_positives():
    """Raising one positive's score never raises another positive's term (they never compete)."""
    scores = torch.tensor([[1.0, 1.0, 0.0]], requires_grad=True)
    pos = torch.tensor([[True, True, False]])
    ign = torch.zeros_like(pos)
    DecoupledSoftmaxLoss()(scores, pos, ign).backward()
    assert (scores.grad[0, :2] < 0).all() and scores.grad[0, 2] > 0
    scores.grad = None
    MultiPositiveSoftmaxLoss()(scores, pos, ign).backward()
    # in the multi-positive softmax two equal positives have zero net gradient between them
    assert scores.grad[0, 0].item() == pytest.approx(scores.grad[0, 1].item())


def test_rae_loss_adds_unrelated_instances_as_negatives():
    label_scores = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    positives = torch.tensor([[True, False], [False, True], [True, False]])
    ignore = torch.zeros_like(positives)
    instance_scores = torch.tensor([[5.0, 1.5, 0.7], [1.5, 5.0, 0.2], [0.7, 0.2, 5.0]])
    related = torch.tensor([[True, False, True], [False, True, False], [True, False, True]])
    got = RaeContrastiveLoss()(label_scores, positives, ignore, instance_scores, related).item()
    # query 0: positive label 0; negatives label 1 and instance 1 (unrelated); instance 2 shares a label
    q0 = lse(2.0, 0.0, 1.5) - 2.0
    q1 = lse(2.0, 0.0, 1.5, 0.2) - 2.0
    q2 = lse(1.0, 1.0, 0.2) - 1.0
    assert got == pytest.approx((q0 + q1 + q2) / 3, rel=1e-6)


@pytest.mark.parametrize(
    "loss", [DecoupledSoftmaxLoss(), MultiPositiveSoftmaxLoss(), InfoNCELoss()], ids=lambda loss: type(loss).__name__
)
def test_a_positive_that_is_also_ignored_counts_as_neither(loss):
    """Label 3 is the query's own item *and* marked positive: it must drop out of the loss, not
    stay a positive outside its own softmax denominator (a term that falls without bound)."""
    both = POS | IGN
    torch.manual_seed(0)
    expected = loss(SCORES, POS, IGN).item()
    for own_score in (3.0, 100.0):
        scores = SCORES.clone()
        scores[0, 3] = own_score
        torch.manual_seed(0)
        assert loss(scores, both, IGN).item() == pytest.approx(expected, rel=1e-6)
