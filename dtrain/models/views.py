"""Scoring an image on several of its symmetries (test-time augmentation), inside the network.

Why: the inspection threshold sits deep in the tail of P(defect), where it is set by the
faintest defects and costs the highest-scoring good parts. One view's score there is
noisy: a faint dent seen in one orientation scores 0.01, turned a quarter it scores 0.3.
The training augmentation (dtrain/data/transforms.py) draws all 8 symmetries of the square
(flips and quarter turns), so the network is trained to treat them alike; averaging its
class probabilities over them is an ensemble that costs no training. Measured on the
quickstart's two runs that missed the accuracy target (BENCHMARKS.md, "Session 12"): 8
views moved accuracy at the bound95 threshold from 96.8 % to 98.5 % and 97.3 %.

The average is of probabilities, returned as their logarithm (a log-sum-exp), so every
consumer that applies a softmax to the network's output (evaluation, export, the runtime)
reads the averaged probabilities unchanged. The views go through the network as one batch (8x the
images, one call), and the module exports to ONNX and torch.export like the network: a
flip is a reversed slice, a quarter turn a transpose plus a flip.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VIEW_COUNTS = (1, 2, 4, 8)  # ModelConfig.views: the first n of the order below


def _check(n: int) -> None:
    if n not in VIEW_COUNTS:
        raise ValueError(f"views must be one of {VIEW_COUNTS}, got {n}")


def views(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The first `n` of the square's 8 symmetries of a [B, C, H, W] batch: identity,
    left-right flip, up-down flip, half turn, then the same four of the transposed image.
    A rectangle (H != W, DataConfig.image_width) has only the first 4: a transpose would
    change its shape (TrainConfig refuses more views for one)."""
    _check(n)
    if n > 4 and x.shape[2] != x.shape[3]:
        raise ValueError(f"{n} views need a square input, got {x.shape[2]} x {x.shape[3]}: at most 4 for a rectangle")
    t = x.transpose(2, 3)
    out = [x, x.flip(3), x.flip(2), x.flip(2, 3), t, t.flip(3), t.flip(2), t.flip(2, 3)]
    return out[:n]


class ViewAverage(nn.Module):
    """`net` scored on `n` views of each image: log of the mean of the views' softmax."""

    def __init__(self, net: nn.Module, n: int) -> None:
        super().__init__()
        _check(n)
        self.net, self.n = net, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        logits = self.net(torch.cat(views(x, self.n), dim=0).contiguous(memory_format=torch.channels_last))
        # log(mean of softmax) in the log domain: finite where a probability underflows, and
        # no dtype cast, which torch.export records as an assertion that then fails when the
        # torch-bf16 backend runs the program under autocast (found exporting a recipe model).
        log_p = F.log_softmax(logits, dim=1).reshape(self.n, b, -1)
        return torch.logsumexp(log_p, dim=0) - math.log(self.n)


def with_views(net: nn.Module, n: int) -> nn.Module:
    """`net` itself for one view; else its view average."""
    return net if n == 1 else ViewAverage(net, n)
