"""P(defect) from both of a network's readings of a photo: the classifier's and the mask head's.

A network trained with TrainConfig.mask_loss has two answers to "is this part defective":
the classifier's, pooled over the whole picture, and the mask head's, a per-cell defect
map whose highest cell says how sure it is that some spot is a defect. They fail
differently. Pooling dilutes a faint defect a few cells wide among thousands of clean
ones; the map's peak is not diluted, but one bright speck of the finish can light a cell.
Mixed-supervision defect detectors decide on both for that reason (the classifier reads
the segmentation's output as well as the features). Here they are pooled as log-odds, the
mean of the classifier's logit of P(defect) and the peak cell's logit: an independent-ish
pair of estimates on the same scale, where one confident reading moves the verdict only
halfway. Measured with `dtrain eval` on four plant-profile models (BENCHMARKS.md,
session 29), the pooled score ranked defective above good parts better in all four
(AUROC); at the threshold set by the faintest validation defect it flagged fewer good
parts on two and more on two, so it is an option (model.score_with_mask), off by default.

The result is written back as class log-probabilities: the defect-free class gets
log(1 - P(defect)), each defect class its share of P(defect) in the classifier's
proportions. Every consumer that applies a softmax (evaluation, views, export, the
runtime) then reads the pooled P(defect) and the classifier's defect type unchanged, and
the module exports to ONNX and torch.export like the network (the mask head's tap is a
forward hook, which export traces through).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.models.mask_head import WithMaskHead


class PooledDefectScore(nn.Module):
    """x -> class log-probabilities with P(defect) = sigmoid(mean(classifier logit, peak mask logit))."""

    def __init__(self, scored: WithMaskHead, negative_index: int, num_classes: int) -> None:
        super().__init__()
        if not 0 <= negative_index < num_classes or num_classes < 2:
            raise ValueError(f"negative_index {negative_index} is not one of {num_classes} classes")
        self.scored, self.negative_index = scored, negative_index
        defects = [i for i in range(num_classes) if i != negative_index]
        self.register_buffer("defects", torch.tensor(defects, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, mask = self.scored(x)
        # No dtype casts: torch.export records one as an assertion that fails when the
        # torch-bf16 backend runs the program under autocast (as in views.py); autocast runs
        # log_softmax in fp32 and the sum below promotes the bf16 peak.
        log_p = F.log_softmax(logits, dim=1)
        n = self.negative_index
        log_ok = log_p[:, n]
        log_defect_types = log_p.index_select(1, self.defects)
        log_defect = torch.logsumexp(log_defect_types, dim=1)
        # Logit of the classifier's P(defect): log P(defect) - log P(ok), finite where either underflows.
        pooled = 0.5 * ((log_defect - log_ok) + mask.flatten(1).amax(dim=1))
        share = log_defect_types - log_defect[:, None]  # each defect class's part of P(defect)
        defect_types = _log_sigmoid(pooled)[:, None] + share
        ok = _log_sigmoid(-pooled)[:, None]
        return torch.cat([defect_types[:, :n], ok, defect_types[:, n:]], dim=1)


def _log_sigmoid(z: torch.Tensor) -> torch.Tensor:
    """log(sigmoid(z)), finite for every finite z. F.logsigmoid is exported to ONNX as
    Log(Sigmoid(z)): a part sure beyond ~88 log-odds gets log(0) = -inf, and where every
    view of it does, ONNX Runtime's log-sum-exp over the views returns NaN (seen on 4 of
    600 plant parts under int8)."""
    return torch.clamp(z, max=0.0) - torch.log1p(torch.exp(-torch.abs(z)))
