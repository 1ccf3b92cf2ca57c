"""Learning rate: linear warmup, then cosine decay to lr * min_lr_ratio at the last step."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """The LR multiplier for optimizer step `step` (0-based)."""
    warmup = min(warmup_steps, max(total_steps - 1, 0))
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """`warmup_cosine` as a LambdaLR multiplier whose `total_steps` may be lowered mid-run:
    a time budget (train/deadline.py) then ends the decay on the last epoch it affords
    instead of stopping with the learning rate still high."""

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float) -> None:
        self.total_steps, self.warmup_steps, self.min_ratio = total_steps, warmup_steps, min_ratio

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, self.total_steps, self.warmup_steps, self.min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(total_steps, warmup_steps, min_ratio))


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float, momentum: float) -> torch.optim.Optimizer:
    # Norm weights and biases are not decayed: shrinking them only fights the norm layers.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    keep = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    params = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    builders = {
        "adamw": lambda: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
        "sgd": lambda: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=momentum > 0),
    }
    return builders[name]()
