"""The training objective of UniDEC (Kharbanda et al., WWW 2025, §3.2–3.3) with the RAE-XMC
loss (Chien et al., eq. 10) as an option:

    ℒ = λ·(ℒ_D + w_RAE·ℒ_RAE) + (1−λ)·(ℒ_C + w_BCE·ℒ_BCE)

where each head's loss is symmetric over its two directions (query→label over the batch label
pool, label→query over the batch queries):

    additive (the default):  ℒ_D = ℒ_D,q→l + λ_D·ℒ_D,l→q
    convex (the paper's):    ℒ_D = λ_D·ℒ_D,q→l + (1−λ_D)·ℒ_D,l→q

and the same for ℒ_C with λ_C. The objective sees only a batch's head outputs and masks, so it
is tested, and can be swapped, without a model or data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from training.batching import Batch
from training.losses import LOSSES, BinaryCrossEntropyLoss, RaeContrastiveLoss, SoftTopKLoss
from training.train_params import TrainParams


def direction_weights(weight: float, form: str) -> tuple[float, float]:
    """The (q→l, l→q) weights of a head's symmetric loss for its ``weight`` λ_D or λ_C."""
    if form == "convex":
        return weight, 1.0 - weight
    if form == "additive":
        return 1.0, weight
    raise ValueError(f"symmetric form {form!r} is not additive or convex")


def symmetric_loss(q2l: torch.Tensor, l2q: torch.Tensor | float, weight: float, form: str) -> torch.Tensor:
    """``q2l + weight·l2q`` (additive) or ``weight·q2l + (1 − weight)·l2q`` (convex)."""
    if form == "additive":
        return q2l + weight * l2q  # written out, not through the weights: keeps old runs bit-exact
    to_labels, to_queries = direction_weights(weight, form)
    return to_labels * q2l + to_queries * l2q


def make_loss(params: TrainParams) -> torch.nn.Module:
    """The multi-class loss ``params.loss`` names, with its own parameters."""
    if params.loss == "soft_top_k":
        return SoftTopKLoss(params.soft_top_k, params.soft_top_k_alpha)
    return LOSSES[params.loss]()


@dataclass
class HeadOutputs:
    """One batch through both heads (float32).

    Attributes:
        de_query: N(g1(Φ(x))) of the queries, [Q, d_DE].
        de_label: N(g1(Φ(z_l))) of the pool labels' texts, [P, d_DE].
        clf_query: g2(Φ(x)) of the queries, [Q, d_CLF].
        label_table: Ψ rows of the pool labels, [P, d_CLF].
    """

    de_query: torch.Tensor
    de_label: torch.Tensor
    clf_query: torch.Tensor
    label_table: torch.Tensor


@dataclass
class BatchMasks:
    """A batch's masks as tensors; see :class:`training.batching.Batch`."""

    positives: torch.Tensor
    ignore: torch.Tensor
    related: torch.Tensor

    @classmethod
    def from_batch(cls, batch: Batch, device: torch.device | str) -> BatchMasks:
        def tensor(mask: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(mask).to(device)

        return cls(tensor(batch.positives), tensor(batch.ignore), tensor(batch.related))


class Objective:
    """ℒ of one batch, from the heads' outputs; every weight and temperature comes from ``params``."""

    def __init__(self, params: TrainParams):
        self.params = params
        self.loss = make_loss(params)
        self.bce = BinaryCrossEntropyLoss()
        self.rae_loss = RaeContrastiveLoss()

    def scores(self, out: HeadOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The DE logits cos/τ_D and the CLF logits ⟨g2(Φ(x)), Ψ_l⟩/τ_C (cosines with
        ``clf_normalize``, the form the service scores), both [Q, P]."""
        p = self.params
        clf_query, label_table = out.clf_query, out.label_table
        if p.clf_normalize:
            clf_query, label_table = F.normalize(clf_query, dim=-1), F.normalize(label_table, dim=-1)
        s_de = out.de_query @ out.de_label.T / p.de_temperature
        s_clf = clf_query @ label_table.T / p.clf_temperature
        return s_de, s_clf

    def parts(self, out: HeadOutputs, masks: BatchMasks) -> dict[str, torch.Tensor]:
        """Every loss term that has a non-zero weight (q→l of both heads always: they are logged)."""
        p = self.params
        s_de, s_clf = self.scores(out)
        positives, ignore = masks.positives, masks.ignore
        parts = {"de_q2l": self.loss(s_de, positives, ignore), "clf_q2l": self.loss(s_clf, positives, ignore)}
        if direction_weights(p.lambda_de_l2q, p.symmetric_form)[1]:
            parts["de_l2q"] = self.loss(s_de.T, positives.T, ignore.T)
        if direction_weights(p.lambda_clf_l2q, p.symmetric_form)[1]:
            parts["clf_l2q"] = self.loss(s_clf.T, positives.T, ignore.T)
        if p.bce_weight:
            parts["clf_bce"] = self.bce(s_clf, positives, ignore)
        if p.rae_weight:
            s_instances = out.de_query @ out.de_query.T / p.de_temperature
            parts["rae"] = self.rae_loss(s_de, positives, ignore, s_instances, masks.related)
        return parts

    def combine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """ℒ = λ·(ℒ_D + w_RAE·ℒ_RAE) + (1−λ)·(ℒ_C + w_BCE·ℒ_BCE) over the computed ``parts``."""
        p = self.params
        form = p.symmetric_form
        de_loss = symmetric_loss(parts["de_q2l"], parts.get("de_l2q", 0.0), p.lambda_de_l2q, form)
        de_loss = de_loss + p.rae_weight * parts.get("rae", 0.0)
        clf_loss = symmetric_loss(parts["clf_q2l"], parts.get("clf_l2q", 0.0), p.lambda_clf_l2q, form)
        clf_loss = clf_loss + p.bce_weight * parts.get("clf_bce", 0.0)
        return p.lambda_mix * de_loss + (1.0 - p.lambda_mix) * clf_loss

    def __call__(self, out: HeadOutputs, masks: BatchMasks) -> tuple[torch.Tensor, dict[str, float]]:
        """ℒ (to step on) and each computed term's value (to log)."""
        parts = self.parts(out, masks)
        return self.combine(parts), {name: float(value.detach()) for name, value in parts.items()}
