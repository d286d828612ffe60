"""Gandalf (Kharbanda, "Compute Efficient XMC", ch. 1, eq. 1.4–1.6): label texts posed as extra
training queries, whose soft targets are the labels that co-occur with them.

    Ĝ = YᵀY                                    co-occurrence counts over the training instances
    y^G_ji = Ĝ_ij / Ĝ_jj   if Ĝ_ij / Ĝ_jj > δ, else 0    target i of the point made of label j's text

i.e. the text of label j should predict label i as often as label i accompanies label j. Short-
text XMC makes this work: a label's text is a query of the same kind as the instances' (a
package name and description here).

One deviation: the point's own label (Ĝ_jj / Ĝ_jj = 1, the thesis's self-annotation) is not a
target but the point's own item, neither positive nor negative, the rule this project applies to
every instance that is itself a label (the filter file's same-item pairs): the point's text *is*
the label's text. A label that is never positive, or that co-occurs with nothing above δ, gives
no point.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp


@dataclass
class LabelPoints:
    """Label texts as training queries.

    Attributes:
        labels: [m] label id of each point (its text is that label's text).
        targets: [m, L] CSR soft targets y^G of each point, the own label left out.
    """

    labels: np.ndarray
    targets: sp.csr_matrix

    def __len__(self) -> int:
        return len(self.labels)


def label_points(Y: sp.csr_matrix, threshold: float) -> LabelPoints:
    """The Gandalf points of the training label matrix ``Y`` (n × L) at δ = ``threshold``."""
    binary = (Y > 0).astype(np.float32).tocsr()
    cooccurrence = (binary.T @ binary).tocsr()  # symmetric: row j holds Ĝ_ji = Ĝ_ij
    frequency = cooccurrence.diagonal()
    ratios = (sp.diags(1.0 / np.maximum(frequency, 1.0)) @ cooccurrence).tocoo()
    # above δ, and not the own label (the point's own item)
    keep = (ratios.data > threshold) & (ratios.row != ratios.col)
    shape = cooccurrence.shape
    kept = sp.csr_matrix((ratios.data[keep], (ratios.row[keep], ratios.col[keep])), shape=shape, dtype=np.float32)
    labels = np.flatnonzero(np.diff(kept.indptr) > 0)
    return LabelPoints(labels=labels, targets=kept[labels].tocsr())
