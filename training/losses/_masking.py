"""Shared helpers of the losses: the usable positives, masked log-sum-exp and the per-query mean
over positives.

``positives`` is a bool mask, or a float tensor of target weights in (0, 1] (0: not a positive),
e.g. Gandalf's soft targets for label texts posed as queries; a bool mask is every weight 1."""

from __future__ import annotations

import torch


def usable_positives(positives: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
    """The positives (bool) that are not ignored. An entry marked both (a query's own item that is
    also one of its targets) is neither: left in as a positive while out of the softmax
    denominator, its term log Σ − s would fall without bound as s grows."""
    return (positives > 0) & ~ignore


def positive_weights(positives: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
    """The target weight of every usable positive (float; 0 elsewhere)."""
    return positives.float() * usable_positives(positives, ignore)


def masked_logsumexp(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Row-wise log Σ exp(scores) over the ``keep`` entries; −inf for a row that keeps none."""
    return torch.logsumexp(scores.masked_fill(~keep, float("-inf")), dim=1)


def mean_over_positives(per_entry: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_p w_ip·per_entry[i, p] / Σ_p w_ip, averaged over the rows that have a positive: the mean
    over P_i for bool ``weights``, the target-weighted mean for soft ones."""
    counts = weights.sum(dim=1)
    rows = counts > 0
    if not rows.any():
        return per_entry.sum() * 0.0  # keeps the graph (and the device) for a batch with no positive
    per_row = (per_entry * weights).sum(dim=1)[rows] / counts[rows]
    return per_row.mean()
