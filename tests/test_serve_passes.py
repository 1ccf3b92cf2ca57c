"""The inspection runtime runs a batch in passes of at most CPU_PASS (GPU_PASS) pictures,
each part's views counted: `dtrain inspect`'s batches of 32 parts on 8 views were single
passes of 256 pictures (3.4 GB at 320 px). A batch's outputs come back whole and in order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dtrain.passes import CPU_PASS, GPU_PASS, images_per_pass
from dtrain.serve.backends import Backend


class _Counting(Backend):
    """A backend whose 'network' returns each image's first two bytes, and counts its passes."""

    name, network, summary = "counting", "none", "test"

    def __init__(self, gpu: bool) -> None:
        self.gpu, self.seen = gpu, []

    def on_gpu(self) -> bool:
        return self.gpu

    def load(self, path: Path):
        def run(images: np.ndarray) -> np.ndarray:
            self.seen.append(len(images))
            return images.reshape(len(images), -1)[:, :2].astype(np.float32)

        return run


def _parts(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, 3, 4, 4), dtype=np.uint8)


def test_eight_view_parts_go_two_a_pass_on_a_cpu_and_come_back_in_order():
    backend, parts = _Counting(gpu=False), _parts(37)
    out = backend.runner(Path("m"), views=8)(parts)
    assert backend.seen == [2] * 18 + [1] and max(backend.seen) * 8 <= CPU_PASS
    assert np.array_equal(out, parts.reshape(37, -1)[:, :2])


def test_a_gpu_takes_larger_passes_and_a_small_batch_is_one_pass():
    backend = _Counting(gpu=True)
    run = backend.runner(Path("m"), views=8)
    run(_parts(70))
    run(_parts(5))
    assert backend.seen == [32, 32, 6, 5] and 32 * 8 == GPU_PASS


def test_images_per_pass_never_drops_below_one_image():
    assert images_per_pass(1, gpu=False) == CPU_PASS
    assert images_per_pass(64, gpu=False) == 1 and images_per_pass(0, gpu=True) == GPU_PASS
