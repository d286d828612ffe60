"""InfoNCE (van den Oord et al. 2018; DPR's in-batch loss): one positive per query."""

from __future__ import annotations

import torch

from training.losses._masking import masked_logsumexp, positive_weights


class InfoNCELoss(torch.nn.Module):
    """Softmax cross-entropy with a single positive per query:

        ℓ(x) = −log  e^{s(x,p₁)} / Σ_{l∈L_B} e^{s(x,l)}

    ``p₁`` is one of the query's in-pool positives drawn uniformly at random (torch's seeded
    generator; DPR's "one positive per question"); the query's other positives count as
    negatives, as in the single-label reduction that UniDEC's PSL replaces. Kept as the
    baseline of the loss ablation. (Not the first positive by column: the pool is sorted by
    label id, so that would always favour the lowest id.)

    Args (forward):
        scores: [Q, P] logits.
        positives: [Q, P] bool, or float target weights (the draw's probabilities).
        ignore: [Q, P] bool, entries left out of the denominator.
    Returns:
        the mean of ℓ over the queries that have an in-pool positive.
    """

    def forward(self, scores: torch.Tensor, positives: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        weights = positive_weights(positives, ignore)
        rows = (weights > 0).any(dim=1)
        if not rows.any():
            return scores.sum() * 0.0
        weights[~rows] = 1.0  # rows without a positive are dropped below; multinomial needs mass
        drawn = torch.multinomial(weights, 1)
        target = scores.gather(1, drawn).squeeze(1)
        lse = masked_logsumexp(scores, ~ignore)
        return (lse - target)[rows].mean()
