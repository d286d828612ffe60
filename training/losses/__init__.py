"""Multi-label contrastive losses over a batch's query x label-pool score matrix, one per file.

Every loss takes ``scores`` ([Q, P] logits, temperature already applied), ``positives`` ([Q, P]
bool: the label is a positive of the query) and ``ignore`` ([Q, P] bool: neither positive nor
negative, e.g. the query's own item among the labels), and returns a scalar. Applied to the
transposed matrices they give the symmetric label→query direction (UniDEC §3.2, "dual loss").
"""

from training.losses.bce import BinaryCrossEntropyLoss
from training.losses.decoupled_softmax import DecoupledSoftmaxLoss
from training.losses.infonce import InfoNCELoss
from training.losses.multi_positive_softmax import MultiPositiveSoftmaxLoss
from training.losses.rae_contrastive import RaeContrastiveLoss
from training.losses.soft_top_k import SoftTopKLoss

LOSSES = {
    "decoupled_softmax": DecoupledSoftmaxLoss,
    "multi_positive_softmax": MultiPositiveSoftmaxLoss,
    "infonce": InfoNCELoss,
    "bce": BinaryCrossEntropyLoss,
    "soft_top_k": SoftTopKLoss,  # takes k and alpha (TrainParams.soft_top_k, soft_top_k_alpha)
}

__all__ = [
    "LOSSES",
    "BinaryCrossEntropyLoss",
    "DecoupledSoftmaxLoss",
    "InfoNCELoss",
    "MultiPositiveSoftmaxLoss",
    "RaeContrastiveLoss",
    "SoftTopKLoss",
]
