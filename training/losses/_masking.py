"""Shared helpers of the losses: the usable positives, masked log-sum-exp and the per-query mean
over positives."""

from __future__ import annotations

import torch


def usable_positives(positives: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
    """The positives that are not ignored. An entry marked both (a query's own item that is also
    one of its targets) is neither: left in as a positive while out of the softmax denominator,
    its term log Σ − s would fall without bound as s grows."""
    return positives & ~ignore


def masked_logsumexp(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Row-wise log Σ exp(scores) over the ``keep`` entries; −inf for a row that keeps none."""
    return torch.logsumexp(scores.masked_fill(~keep, float("-inf")), dim=1)


def mean_over_positives(per_entry: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """(1/|P_i|) Σ_{p∈P_i} per_entry[i, p], averaged over the rows that have a positive."""
    counts = positives.sum(dim=1)
    rows = counts > 0
    if not rows.any():
        return per_entry.sum() * 0.0  # keeps the graph (and the device) for a batch with no positive
    per_row = (per_entry * positives).sum(dim=1)[rows] / counts[rows]
    return per_row.mean()
