"""Binary cross-entropy over the label pool: the one-vs-all loss, UniDEC's auxiliary classifier
loss (§3.3, Table 3: "multi-class + BCE")."""

from __future__ import annotations

import torch


class BinaryCrossEntropyLoss(torch.nn.Module):
    """Independent sigmoid per (query, pool label):

        ℓ = −(1/|M|) Σ_{(i,l)∈M} [ y_il log σ(s_il) + (1 − y_il) log(1 − σ(s_il)) ]

    over the entries M that are not ignored. Calibrates each classifier score on its own, which
    the softmax losses (invariant to a per-query shift) do not.

    Args (forward):
        scores: [Q, P] logits.
        positives: [Q, P] bool (y), or float soft targets in [0, 1].
        ignore: [Q, P] bool, entries left out.
    Returns:
        the mean over the kept entries.
    """

    def forward(self, scores: torch.Tensor, positives: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
        keep = ~ignore
        per_entry = torch.nn.functional.binary_cross_entropy_with_logits(
            scores.float(), positives.float(), reduction="none"
        )
        return per_entry[keep].mean() if keep.any() else per_entry.sum() * 0.0
