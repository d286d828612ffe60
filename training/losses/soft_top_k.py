"""SoftTop-k (DEXML, Gupta et al. 2024, eq. 6–7): a loss that is zero once every positive is
among the top k scores of the pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.losses._masking import mean_over_positives, positive_weights

BISECTION_STEPS = 40  # halves the threshold's bracket (width ≈ score range + 60/α) to far below float32 noise


class SoftTopKLoss(torch.nn.Module):
    """Negative log-likelihood of each positive under a differentiable top-k filter:

        z_ij = σ(α·(s_ij + t_i))   with t_i such that Σ_j z_ij = k            (the SoftTop-k operator)
        ℓ(x_i) = −(1/|P_i|) Σ_{p∈P_i} log z_ip                                 (eq. 6)

    ``z`` is near 1 for the k largest scores of the row and near 0 for the rest, so the loss
    vanishes once every positive is in the top k and otherwise pushes the positives up and the
    scores that displace them down. The threshold ``t_i`` has no closed form: it is found by
    bisection (Σ_j σ(α(s_j + t)) grows with t), and its gradient comes from the implicit
    function theorem, ∂t/∂s_j = −σ'_j / Σ_l σ'_l (eq. 7), not from the bisection steps.

    Deviation from the paper: eq. 6 divides by the label count L; here the sum is averaged over
    the query's in-pool positives, as the other losses of this package are, so its scale does
    not depend on the pool size. Ignored entries take no part in the top k. A row with at most
    k usable entries puts all of them in the top k (loss 0).

    Args:
        k: the size of the top set the positives should be in.
        alpha: α, the sharpness of the sigmoid (larger is closer to the hard top k).
    Args (forward):
        scores: [Q, P] logits.
        positives: [Q, P] bool, or float target weights (the mean over P is then weighted).
        ignore: [Q, P] bool, entries left out.
    Returns:
        the mean of ℓ over the queries that have an in-pool positive.
    """

    def __init__(self, k: int = 5, alpha: float = 1.0):
        super().__init__()
        if k < 1 or alpha <= 0:
            raise ValueError("SoftTop-k needs k >= 1 and alpha > 0")
        self.k = k
        self.alpha = alpha

    def threshold(self, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """t_i with Σ_j σ(α(s_ij + t_i)) = min(k, kept entries) over the kept entries, as a
        function of ``scores`` whose value is the bisection's and whose gradient is eq. 7."""
        a = self.alpha
        with torch.no_grad():
            target = keep.sum(dim=1).clamp(max=self.k).to(scores.dtype)
            kept_any = keep.any(dim=1)  # a row with nothing kept gets a finite bracket (and no loss)
            low_score = torch.where(kept_any, scores.masked_fill(~keep, float("inf")).amin(dim=1), 0.0)
            high_score = torch.where(kept_any, scores.masked_fill(~keep, float("-inf")).amax(dim=1), 0.0)
            margin = 30.0 / a  # σ(±30) is 0 or 1 to float32: the bracket holds the root
            low, high = -high_score - margin, -low_score + margin
            for _ in range(BISECTION_STEPS):
                middle = (low + high) / 2
                total = (torch.sigmoid(a * (scores + middle[:, None])) * keep).sum(dim=1)
                below = total < target
                low, high = torch.where(below, middle, low), torch.where(below, high, middle)
            t = (low + high) / 2
            slope = a * torch.sigmoid(a * (scores + t[:, None])) * torch.sigmoid(-a * (scores + t[:, None])) * keep
            weights = slope / slope.sum(dim=1, keepdim=True).clamp(min=1e-30)
        # value t, gradient −σ'_j/Σσ' with respect to each kept score (the implicit derivative)
        return t - (weights * (scores - scores.detach())).sum(dim=1)

    def forward(self, scores: torch.Tensor, positives: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        weights = positive_weights(positives, ignore)
        keep = ~ignore
        finite = scores.masked_fill(~keep, 0.0)  # ignored entries: any finite value, masked everywhere
        t = self.threshold(finite, keep)
        log_z = F.logsigmoid(self.alpha * (finite + t[:, None]))
        return mean_over_positives((-log_z).masked_fill(weights == 0, 0.0), weights)
