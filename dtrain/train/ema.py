"""An exponential moving average of the weights (TrainConfig.ema_decay).

Why: the last step's weights carry the last few batches' noise, and a threshold set far
in a score tail (the faintest defects, the OK parts that look most like one) moves
with that noise. An average over the last stretch of training sits nearer the middle
of the basin the optimiser was wandering in, for no inference cost: the averaged
weights are an ordinary model. Detector trainers (YOLO's ModelEMA, timm's ModelEmaV2)
keep one for the same reason.

The decay ramps in as min(decay, (1 + n) / (10 + n)) after n updates (as TensorFlow's
ExponentialMovingAverage with num_updates): early on the average forgets the random
initialisation quickly, and for a run much shorter than 1 / (1 - decay) steps it spans
roughly the last tenth of the steps taken, whatever the run's length.

Every floating-point entry of the state dict is averaged, BatchNorm's running statistics
included, so the averaged model is consistent with itself; integer entries (BatchNorm's
batch counter) are copied. Under DDP every rank holds the same weights after each step,
so every rank's average is the same and none is communicated.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def ramped_decay(decay: float, updates: int) -> float:
    """The decay applied at update number `updates` (1-based)."""
    return min(decay, (1 + updates) / (10 + updates))


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        # Pairs fixed once: the state dicts of both modules share tensor identity with
        # the parameters and buffers, so the in-place updates below reach the modules.
        live, avg = model.state_dict(keep_vars=True), self.module.state_dict(keep_vars=True)
        self._float = [(avg[k].data, v.data) for k, v in live.items() if v.is_floating_point()]
        self._other = [(avg[k].data, v.data) for k, v in live.items() if not v.is_floating_point()]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        d = ramped_decay(self.decay, self.updates)
        if self._float:
            averaged, live = zip(*self._float)
            # avg = d * avg + (1 - d) * live, i.e. avg += (1 - d) * (live - avg)
            torch._foreach_lerp_(list(averaged), list(live), 1.0 - d)
        for averaged, live in self._other:
            averaged.copy_(live)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load(self, weights: dict[str, torch.Tensor], updates: int) -> None:
        self.module.load_state_dict(weights)
        self.updates = updates
