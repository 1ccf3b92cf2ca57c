"""Two model options for surface images: per-image input standardisation and avg+max pooling.

Both are applied to any ResNet by `build_model` without renaming a parameter, so
checkpoints, `pretrained:` files and the classifier-head prefix ("fc.") are unaffected:

- per-image standardisation swaps the class of the network's first convolution for a
  subclass that first standardises each image (over all its pixels and channels). Parts
  are photographed under drifting light, on finishes of every shade; a defect is a local
  departure from the part's own surface, and taking each picture's own level and contrast
  out leaves that departure as the signal (on the plant profile a from-scratch network
  otherwise spent its whole budget on the finishes: validation AUROC 0.51 -> 0.83 at 300
  steps, BENCHMARKS.md "Recipe"). Colour ratios survive: one mean and one scale per image.
- avg+max pooling concatenates the last feature map's mean and maximum. A defect is
  local: its evidence is "anywhere in the picture", which the mean dilutes by the share of
  the area it covers and the max keeps (multiple-instance reasoning over positions, what
  tiles at native resolution scored by their worst tile do, in one pass).

Both live inside the network, so evaluation, export (ONNX) and the torch-free runtime
get them without a preprocessing change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Floor of the per-image scale, in units of the normalised input (~1/50 of a typical
# image's spread): a blank, perfectly flat image is not blown up to noise.
MIN_SCALE = 1e-2


class PerImageStandardizedConv2d(nn.Conv2d):
    """A Conv2d that standardises each input image before convolving (same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever autocast runs: a bf16 variance over 200k pixels loses digits.
        xf = x.float()
        # E[x^2] - E[x]^2 rather than Tensor.std: two ReduceMeans in ONNX, where std's
        # exported Shape/Concat/Expand stopped ONNX Runtime's int8 shape inference. The
        # inputs are normalised (|x| of a few units), so fp32 keeps the difference exact enough.
        mean = xf.mean(dim=(1, 2, 3), keepdim=True)
        std = ((xf * xf).mean(dim=(1, 2, 3), keepdim=True) - mean * mean).clamp_min(0).sqrt()
        return super().forward(((xf - mean) / (std + MIN_SCALE)).to(x.dtype))


class AvgMaxPool(nn.Module):
    """[B, C, H, W] -> [B, 2C, 1, 1]: the mean and the maximum of every channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pooling windows the size of the map rather than reductions: they export to ONNX
        # AveragePool/MaxPool with static shapes (an export has a fixed input side), which
        # ONNX Runtime's int8 quantiser can follow; its shape inference stopped at a Concat
        # fed by ReduceMean/ReduceMax.
        window = tuple(x.shape[-2:])
        return torch.cat([F.avg_pool2d(x, window), F.max_pool2d(x, window)], dim=1)


def standardize_inputs(model: nn.Module) -> None:
    """Make the first convolution standardise each image (in place, parameters unchanged)."""
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    first.__class__ = PerImageStandardizedConv2d


def avg_max_head(model: nn.Module) -> None:
    """Replace the global average pool by avg+max and widen the `fc` head to match (a new
    random head: a `pretrained:` head of the old width is skipped as for another class count)."""
    name = "avgpool" if hasattr(model, "avgpool") else "pool"
    setattr(model, name, AvgMaxPool())
    old = model.fc
    model.fc = nn.Linear(old.in_features * 2, old.out_features)
