"""RAE-XMC's training loss (Chien et al., eq. 10): the decoupled softmax over a knowledge memory
of labels *and* in-batch instances."""

from __future__ import annotations

import torch

from training.losses.decoupled_softmax import DecoupledSoftmaxLoss


class RaeContrastiveLoss(torch.nn.Module):
    """Decoupled softmax whose negatives also include the in-batch instances that share no label
    with the query:

        J(x, y) = −Σ_ℓ y_ℓ log  e^{s(x,ℓ)/τ} / ( e^{s(x,ℓ)/τ} + Σ_{ℓ'∉P(y)} e^{s(x,ℓ')/τ}
                                                 + Σ_{x'∈Q(y)} e^{s(x,x')/τ} )

    ``Q(y)`` = in-batch instances with no label in common with ``x``. Instances that share a
    label are neither pulled nor pushed, which shapes the query space for the instance half of
    the RAE memory (its keys are training instances encoded by the same map).

    Args (forward):
        label_scores: [Q, P] query × pool-label logits.
        positives: [Q, P] bool.
        ignore: [Q, P] bool.
        instance_scores: [Q, Q] query × query logits (same temperature).
        related: [Q, Q] bool, the two instances share at least one label (over all their
            labels, not only the in-pool ones); the diagonal is ignored.
    Returns:
        the mean of J / |P| over the queries with an in-pool positive.
    """

    def __init__(self):
        super().__init__()
        self.decoupled = DecoupledSoftmaxLoss()

    def forward(
        self,
        label_scores: torch.Tensor,
        positives: torch.Tensor,
        ignore: torch.Tensor,
        instance_scores: torch.Tensor,
        related: torch.Tensor,
    ) -> torch.Tensor:
        unrelated = ~related
        unrelated.fill_diagonal_(False)
        scores = torch.cat([label_scores, instance_scores], dim=1)
        pos = torch.cat([positives, positives.new_zeros(unrelated.shape)], dim=1)
        ign = torch.cat([ignore, ~unrelated], dim=1)
        return self.decoupled(scores, pos, ign)
