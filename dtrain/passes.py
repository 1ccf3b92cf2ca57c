"""How many pictures one forward pass holds: one rule for evaluation (torch) and the
torch-free inspection runtime.

A model scored on its symmetries (model.views, dtrain/models/views.py) runs every view of
every image of a batch as one picture of a single pass, so a batch of 32 images on 8
views is a pass of 256. Measured on the plant profile's 320 px pictures (session 31-32,
BENCHMARKS.md): evaluation's passes of 2048 pictures peaked at 16.9 GB and `dtrain
inspect`'s of 256 at 3.4 GB, where passes of 16 took 2.0 and 0.3 GB; memory grows with
the side squared, so 512 px parts would need 2.6 times as much. On a CPU small passes are
also no slower per picture (the activations stay in cache). A GPU wants larger passes;
256 bounds its memory too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

CPU_PASS, GPU_PASS = 16, 256


def images_per_pass(views: int, gpu: bool) -> int:
    """Images per forward pass for a model that scores each on `views` pictures."""
    return max(1, (GPU_PASS if gpu else CPU_PASS) // max(1, views))


def in_passes(run: Callable[[np.ndarray], np.ndarray], per_pass: int) -> Callable[[np.ndarray], np.ndarray]:
    """`run` over a batch of any size, `per_pass` images at a time, the outputs concatenated in order."""

    def sliced(images: np.ndarray) -> np.ndarray:
        if len(images) <= per_pass:
            return run(images)
        return np.concatenate([run(images[i : i + per_pass]) for i in range(0, len(images), per_pass)])

    return sliced
