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


# ----------------------------------------------------------------- SoftTop-k (DEXML eq. 6–7)
def soft_top_k_by_hand(scores: list[float], positives: list[int], k: int, alpha: float) -> float:
    """eq. 6 with the threshold t solved by scipy's root finder instead of the loss's bisection."""
    from scipy.optimize import brentq

    def sigmoid(x):
        return 1.0 / (1.0 + math.exp(-x))

    t = brentq(lambda t: sum(sigmoid(alpha * (s + t)) for s in scores) - k, -100, 100, xtol=1e-12)
    return sum(-math.log(sigmoid(alpha * (scores[p] + t))) for p in positives) / len(positives)


def test_soft_top_k_by_hand_with_an_ignored_label():
    from training.losses import SoftTopKLoss

    # the ignored label (score 3.0) takes no part: the top 2 of the other three
    expected = soft_top_k_by_hand([2.0, 1.0, 0.5], [0, 1], k=2, alpha=2.0)
    assert SoftTopKLoss(k=2, alpha=2.0)(SCORES, POS, IGN).item() == pytest.approx(expected, rel=1e-4)


def test_soft_top_k_threshold_keeps_k_in_the_top_and_is_zero_when_the_positives_are_there():
    from training.losses import SoftTopKLoss

    torch.manual_seed(0)
    scores = torch.randn(8, 50) * 5
    ignore = torch.rand(8, 50) < 0.1
    loss = SoftTopKLoss(k=5, alpha=3.0)
    t = loss.threshold(scores.masked_fill(ignore, 0.0), ~ignore)
    total = (torch.sigmoid(3.0 * (scores + t[:, None])) * ~ignore).sum(dim=1)
    assert torch.allclose(total, torch.full((8,), 5.0), atol=1e-3)
    # positives far above the rest: ~0; a positive far below the top 5: large
    top = torch.zeros(1, 50, dtype=torch.bool)
    top[0, :3] = True
    clear = torch.cat([torch.full((1, 3), 20.0), torch.zeros(1, 47)], dim=1)
    nothing_ignored = torch.zeros(1, 50, dtype=torch.bool)
    assert loss(clear, top, nothing_ignored).item() < 1e-6
    buried = clear.clone()
    buried[0, 2] = -20.0
    assert loss(buried, top, nothing_ignored).item() > 10


def test_soft_top_k_gradient_is_the_implicit_one_of_eq_7():
    from training.losses import SoftTopKLoss

    torch.manual_seed(1)
    scores = (torch.randn(3, 12) * 2).double().requires_grad_(True)
    positives = torch.rand(3, 12) < 0.3
    positives[:, 0] = True
    ignore = torch.zeros(3, 12, dtype=torch.bool)
    ignore[1, 5] = True
    positives[1, 5] = False
    loss = SoftTopKLoss(k=4, alpha=1.5)
    loss(scores, positives, ignore).backward()
    step = 1e-3
    numeric = torch.zeros_like(scores)
    with torch.no_grad():
        for index in range(scores.numel()):
            bump = torch.zeros(scores.numel(), dtype=scores.dtype)
            bump[index] = step
            bump = bump.view_as(scores)
            up, down = loss(scores + bump, positives, ignore), loss(scores - bump, positives, ignore)
            numeric.view(-1)[index] = (up - down) / (2 * step)
    assert torch.allclose(scores.grad, numeric, atol=2e-4, rtol=1e-2)
    assert scores.grad[1, 5] == 0  # an ignored entry gets no gradient


def test_soft_top_k_rows_without_anything_kept_stay_finite():
    from training.losses import SoftTopKLoss

    scores = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    positives = torch.tensor([[True, False, False], [False, False, False]])
    ignore = torch.tensor([[False, False, False], [True, True, True]])
    value = SoftTopKLoss(k=1)(scores, positives, ignore)
    value.backward()
    assert math.isfinite(value.item()) and torch.isfinite(scores.grad).all()


WEIGHABLE = [DecoupledSoftmaxLoss(), MultiPositiveSoftmaxLoss(), BinaryCrossEntropyLoss()]


@pytest.mark.parametrize("loss", WEIGHABLE, ids=lambda x: type(x).__name__)
def test_weights_of_one_are_the_bool_mask_and_soft_weights_weigh_the_mean(loss):
    assert loss(SCORES, POS.float(), IGN).item() == pytest.approx(loss(SCORES, POS, IGN).item(), rel=1e-7)
    soft = torch.tensor([[1.0, 0.25, 0.0, 0.0]])
    if isinstance(loss, DecoupledSoftmaxLoss):  # Gandalf's soft targets: a weighted mean over P
        expected = (1.0 * (lse(2.0, 0.5) - 2.0) + 0.25 * (lse(1.0, 0.5) - 1.0)) / 1.25
        assert loss(SCORES, soft, IGN).item() == pytest.approx(expected, rel=1e-6)


def test_rae_loss_takes_soft_weights():
    related = torch.tensor([[True]])
    instance_scores = torch.tensor([[0.0]])
    soft = torch.tensor([[1.0, 0.25, 0.0, 0.0]])
    value = RaeContrastiveLoss()(SCORES, soft, IGN, instance_scores, related)
    assert value.item() == pytest.approx(DecoupledSoftmaxLoss()(SCORES, soft, IGN).item(), rel=1e-6)
