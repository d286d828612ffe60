import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from training.batching import PslBatcher
from training.objective import BatchMasks, HeadOutputs, Objective, direction_weights, symmetric_loss
from training.train_params import TrainParams


def test_convex_form_is_lambda_times_q2l_plus_its_complement_times_l2q():
    a, b = torch.tensor(2.0), torch.tensor(5.0)
    assert symmetric_loss(a, b, 0.3, "convex").item() == pytest.approx(0.3 * 2.0 + 0.7 * 5.0)
    assert symmetric_loss(a, b, 0.3, "additive").item() == pytest.approx(2.0 + 0.3 * 5.0)
    assert direction_weights(0.3, "convex") == (0.3, pytest.approx(0.7))
    assert direction_weights(0.3, "additive") == (1.0, 0.3)
    with pytest.raises(ValueError, match="symmetric form"):
        direction_weights(0.3, "mean")


def test_the_default_form_is_the_additive_one_every_earlier_run_used():
    assert TrainParams().symmetric_form == "additive"


def random_batch(queries: int = 4, pool: int = 6, dim: int = 8, seed: int = 0) -> tuple[HeadOutputs, BatchMasks]:
    generator = torch.Generator().manual_seed(seed)

    def unit(rows: int) -> torch.Tensor:
        return F.normalize(torch.randn(rows, dim, generator=generator), dim=-1)

    out = HeadOutputs(unit(queries), unit(pool), torch.randn(queries, dim, generator=generator), unit(pool))
    positives = torch.zeros(queries, pool, dtype=torch.bool)
    positives[torch.arange(queries), torch.arange(queries)] = True  # query i's positive is label i
    positives[0, 4] = True
    ignore = torch.zeros_like(positives)
    ignore[1, 5] = True
    related = torch.eye(queries, dtype=torch.bool)
    return out, BatchMasks(positives, ignore, related)


WEIGHTS = {"lambda_mix": 0.7, "lambda_de_l2q": 0.4, "lambda_clf_l2q": 0.2, "rae_weight": 0.1, "bce_weight": 0.3}


@pytest.mark.parametrize("form", ["additive", "convex"])
def test_objective_weighs_every_term_as_documented(form):
    objective = Objective(TrainParams(symmetric_form=form, **WEIGHTS))
    total, parts = objective(*random_batch())
    assert set(parts) == {"de_q2l", "de_l2q", "clf_q2l", "clf_l2q", "clf_bce", "rae"}
    (dq, dl), (cq, cl) = direction_weights(0.4, form), direction_weights(0.2, form)
    de = dq * parts["de_q2l"] + dl * parts["de_l2q"] + 0.1 * parts["rae"]
    clf = cq * parts["clf_q2l"] + cl * parts["clf_l2q"] + 0.3 * parts["clf_bce"]
    assert total.item() == pytest.approx(0.7 * de + 0.3 * clf, rel=1e-6)


def test_terms_are_the_losses_of_the_scaled_logits():
    params = TrainParams(de_temperature=0.1, clf_temperature=2.0, clf_normalize=True, rae_weight=0.1)
    objective = Objective(params)
    out, masks = random_batch()
    _, parts = objective(out, masks)
    s_de = out.de_query @ out.de_label.T / 0.1
    s_clf = F.normalize(out.clf_query, dim=-1) @ F.normalize(out.label_table, dim=-1).T / 2.0
    assert parts["de_q2l"] == pytest.approx(objective.loss(s_de, masks.positives, masks.ignore).item())
    assert parts["de_l2q"] == pytest.approx(objective.loss(s_de.T, masks.positives.T, masks.ignore.T).item())
    assert parts["clf_q2l"] == pytest.approx(objective.loss(s_clf, masks.positives, masks.ignore).item())
    s_instances = out.de_query @ out.de_query.T / 0.1
    rae = objective.rae_loss(s_de, masks.positives, masks.ignore, s_instances, masks.related)
    assert parts["rae"] == pytest.approx(rae.item())


def test_a_direction_is_computed_only_when_it_has_weight():
    # additive λ_C = 0: no l→q term; convex λ_C = 0: the l→q term carries all of the CLF loss
    additive = Objective(TrainParams(lambda_clf_l2q=0.0, symmetric_form="additive"))
    convex = Objective(TrainParams(lambda_clf_l2q=0.0, symmetric_form="convex"))
    assert "clf_l2q" not in additive(*random_batch())[1]
    total, parts = convex(*random_batch())
    assert "clf_l2q" in parts
    de = 0.5 * parts["de_q2l"] + 0.5 * parts["de_l2q"]
    assert total.item() == pytest.approx(0.5 * de + 0.5 * parts["clf_l2q"], rel=1e-6)


def test_convex_weights_outside_zero_one_are_refused():
    with pytest.raises(ValueError, match="lambda_de_l2q"):
        TrainParams(symmetric_form="convex", lambda_de_l2q=1.5)
    assert TrainParams(symmetric_form="additive", lambda_de_l2q=1.5).lambda_de_l2q == 1.5


def test_an_instance_whose_only_target_is_its_own_label_adds_a_finite_zero_term():
    """The batcher drops an own label from the positives; a query left with none contributes
    nothing, and a batch made only of such queries (an empty pool) is a zero loss that still
    backpropagates."""
    Y = sp.csr_matrix(np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32))
    batcher = PslBatcher(Y, [set(), {1}], 2, 0, np.random.default_rng(0))
    objective = Objective(TrainParams(rae_weight=0.5, bce_weight=0.5, lambda_clf_l2q=0.5))
    for rows in (np.array([0, 1]), np.array([1])):
        batch = batcher.make(rows)
        de_query = torch.randn(len(rows), 4, requires_grad=True)
        out = HeadOutputs(
            de_query, torch.randn(len(batch.pool), 4), torch.randn(len(rows), 4), torch.randn(len(batch.pool), 4)
        )
        total, parts = objective(out, BatchMasks.from_batch(batch, "cpu"))
        assert torch.isfinite(total) and all(np.isfinite(v) for v in parts.values())
        total.backward()
    assert total.item() == 0.0


def test_soft_top_k_is_built_with_its_k_and_alpha_and_trains_both_directions():
    from training.losses import SoftTopKLoss

    objective = Objective(TrainParams(loss="soft_top_k", soft_top_k=3, soft_top_k_alpha=2.0))
    assert isinstance(objective.loss, SoftTopKLoss) and (objective.loss.k, objective.loss.alpha) == (3, 2.0)
    out, masks = random_batch()
    for tensor in (out.de_query, out.clf_query):
        tensor.requires_grad_(True)
    total, parts = objective(out, masks)
    total.backward()
    assert {"de_q2l", "de_l2q", "clf_q2l"} <= set(parts) and all(np.isfinite(list(parts.values())))
    assert out.de_query.grad.abs().sum() > 0 and out.clf_query.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="soft_top_k_alpha"):
        TrainParams(loss="soft_top_k", soft_top_k_alpha=0.0)
