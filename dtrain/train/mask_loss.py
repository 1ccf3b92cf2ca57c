"""The per-pixel loss of TrainConfig.mask_loss (dtrain/models/mask_head.py draws the map).

The target of each cell of the head's map is whether any pixel it covers is marked: a
max-pool of the mask, so a crack a pixel wide still lights the cells it crosses (an
average would leave it at a few percent, below what the loss notices). Photos whose mask
is UNKNOWN (defective, none given) add nothing; the loss is the mean over the photos
that have one, each photo the mean over its cells.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtrain.data.mask_targets import MARKED, UNKNOWN


def split_mask(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [B, 4, H, W] -> the pictures [B, 3, H, W] and the masks [B, 1, H, W]."""
    return batch[:, :3], batch[:, 3:]


def mask_loss(logits: torch.Tensor, masks: torch.Tensor, lam: float | None = None,
              perm: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy of mask logits [B, 1, h, w] against uint8 masks [B, 1, H, W].
    With mixup (`lam`, `perm`), the target is the same blend of the two photos' masks, and
    a pair counts only when both have one."""
    known = (masks != UNKNOWN).flatten(1).all(1)
    target = F.adaptive_max_pool2d((masks == MARKED).float(), logits.shape[-2:])
    if perm is not None:
        target = lam * target + (1 - lam) * target[perm]
        known = known & known[perm]
    per_photo = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none").mean(dim=(1, 2, 3))
    # Summed with zero weights rather than indexed: every rank's graph then reaches the
    # head whatever its batch holds, as DDP's all-reduce needs.
    return (per_photo * known).sum() / known.sum().clamp_min(1)
