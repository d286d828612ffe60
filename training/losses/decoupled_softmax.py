"""Decoupled softmax (DEXML, Gupta et al. 2024, eq. 5), the loss UniDEC's PSL reduction uses."""

from __future__ import annotations

import torch

from training.losses._masking import masked_logsumexp, mean_over_positives, positive_weights


class DecoupledSoftmaxLoss(torch.nn.Module):
    """Each positive competes only with the negatives, never with the query's other positives:

        ℓ(x) = −(1/|P|) Σ_{p∈P} log  e^{s(x,p)} / ( e^{s(x,p)} + Σ_{n∉P} e^{s(x,n)} )

    where ``s`` are the logits (cosine/τ for the dual encoder, ⟨g2(Φ(x)), Ψ_l⟩ for the
    classifier), P the query's in-pool positives and n its in-pool negatives. Unlike the plain
    multi-positive softmax, a query with many positives is not penalised for spreading its mass
    over them, which is what makes it suit multi-label data.

    Args (forward):
        scores: [Q, P] logits.
        positives: [Q, P] bool, or float target weights (the sum over P is then weighted).
        ignore: [Q, P] bool, entries that are neither positive nor negative.
    Returns:
        the mean of ℓ over the queries that have an in-pool positive.
    """

    def forward(self, scores: torch.Tensor, positives: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        weights = positive_weights(positives, ignore)
        positives = weights > 0
        negatives = ~positives & ~ignore
        neg_lse = masked_logsumexp(scores, negatives).unsqueeze(1)
        per_entry = torch.logaddexp(scores, neg_lse) - scores
        return mean_over_positives(per_entry.masked_fill(~positives, 0.0), weights)
