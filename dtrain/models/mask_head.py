"""Pixel supervision while training: a small head that draws each photo's defect mask from
the classifier's own inner features (TrainConfig.mask_loss).

A photo's label says "somewhere in these pixels is a scratch"; a mask says where. With a
few dozen defective photos, or defects a few pixels wide on a large part, the label alone
leaves the network to discover which of the pixels differ, and it learns the bold defects
first and the faint ones last, if at all. Many published defect sets ship a mask per photo
(the magnetic tiles, KolektorSDD/SDD2, DAGM, Severstal), and training a classifier
together with a segmentation of its defects ("mixed supervision") is how those sets are
learned from few images. Here the mask is an auxiliary target only:

- the head reads the output of the network's third stage (1/8 to 1/16 of the input side,
  fine enough to place a defect, coarse enough to be cheap) through a forward hook, so
  the classifier's modules, parameter names and forward stay as they are;
- a checkpoint's "model" holds exactly the classifier's weights; the head's own go to
  "mask_head", for resume and for inference;
- at inference the classifier decides; with model.score_with_mask and a defect-free
  class, P(defect) pools it with the head's most defective cell
  (dtrain/models/defect_score.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from dtrain.errors import ConfigError

# The stage whose output the head reads (0-based): the third of four.
TAP_STAGE = 2


class MaskHead(nn.Module):
    """Feature map [B, C, h, w] -> mask logits [B, 1, h, w]: one 3x3 convolution to mix
    neighbouring positions (a defect's evidence spans cells), then a 1x1 to one logit."""

    def __init__(self, channels: int, norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.mix = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), norm_layer(channels),
                                 nn.ReLU(inplace=True))
        self.out = nn.Conv2d(channels, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mix(x))


def tap(model: nn.Module) -> tuple[nn.Module, int]:
    """The residual block that ends the network's TAP_STAGE-th stage, and its output channels.
    Stages are runs of blocks with the same output width (torchvision's layer1..4, the small
    ResNet's blocks), so any ResNet built by build_model is found the same way."""
    blocks = [m for m in model.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    widths: list[int] = []
    last: dict[int, nn.Module] = {}
    for block in blocks:
        out = _out_channels(block)
        if out not in last:
            widths.append(out)
        last[out] = block
    if len(widths) <= TAP_STAGE:
        raise ConfigError(f"mask_loss needs a network with at least {TAP_STAGE + 1} stages of residual blocks",
                          "use a ResNet (model.arch), or set mask_loss: null")
    width = widths[TAP_STAGE]
    return last[width], width


def _out_channels(block: nn.Module) -> int:
    conv = block.conv3 if isinstance(block, Bottleneck) else block.conv2
    return conv.out_channels


class WithMaskHead(nn.Module):
    """What the training loop calls when mask_loss is on: x -> (class logits, mask logits).
    DDP wraps this, so both outputs' gradients are all-reduced in the same step."""

    def __init__(self, net: nn.Module, head: MaskHead, at: nn.Module) -> None:
        super().__init__()
        self.net, self.head = net, head
        self._feature: torch.Tensor | None = None
        # The hook stays on the classifier's module; outside this wrapper's forward (the
        # loop's validation calls the classifier directly) what it keeps is dropped below.
        at.register_forward_hook(self._keep)

    def _keep(self, _module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        self._feature = output

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._feature = None
        logits = self.net(x)
        feature, self._feature = self._feature, None
        return logits, self.head(feature)


def with_mask_head(net: nn.Module, norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d) -> WithMaskHead:
    at, channels = tap(net)
    return WithMaskHead(net, MaskHead(channels, norm_layer), at)
