"""Multi-positive softmax (SupCon, Khosla et al. 2020): the PAL-N multi-class loss in its
pick-some-labels form (UniDEC §3.1)."""

from __future__ import annotations

import torch

from training.losses._masking import masked_logsumexp, mean_over_positives, positive_weights


class MultiPositiveSoftmaxLoss(torch.nn.Module):
    """Softmax over the whole in-batch label pool, averaged over the query's in-pool positives:

        ℒ_PSL(x) = −(1/|P_i^B|) Σ_{p∈P_i^B} log  e^{s(x,p)} / Σ_{l∈L_B} e^{s(x,l)}

    ``L_B`` is the batch label pool (sampled positives ∪ mined hard negatives) and
    ``P_i^B = P_i ∩ L_B`` every in-pool positive of the query (UniDEC eq. 2 with ℓ_MC the
    softmax cross-entropy). The other positives stay in the denominator, so the loss is smallest
    when the mass is spread evenly over them.

    Args (forward):
        scores: [Q, P] logits.
        positives: [Q, P] bool, or float target weights (the sum over P is then weighted).
        ignore: [Q, P] bool, entries left out of the denominator.
    Returns:
        the mean of ℒ over the queries that have an in-pool positive.
    """

    def forward(self, scores: torch.Tensor, positives: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        weights = positive_weights(positives, ignore)
        lse = masked_logsumexp(scores, ~ignore).unsqueeze(1)
        per_entry = (lse - scores).masked_fill(weights == 0, 0.0)
        return mean_over_positives(per_entry, weights)
