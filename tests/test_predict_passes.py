"""Scoring runs its forward passes in small slices of the loader's batch: a batch of 256
images on 8 views was one pass of 2048 pictures (16.9 GB at 320 px), now passes of 16."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from dtrain.evaluation.predict import predict_split
from dtrain.passes import CPU_PASS
from dtrain.models.views import ViewAverage


class _Images(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, 12, 12), dtype=torch.uint8, generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], i % 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()


def test_passes_hold_at_most_cpu_pass_pictures_and_score_as_one_pass():
    net = _net()
    seen: list[int] = []
    net.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    model = ViewAverage(net, 8).eval()
    data = _Images(37)
    got = predict_split(model, data, mean=[0.5] * 3, std=[0.25] * 3, batch_size=256, num_workers=0)
    assert max(seen) <= CPU_PASS and sum(seen) == 37 * 8  # every view of every image, in slices
    with torch.no_grad():  # the same images in one pass, as before
        x = (data.images.float() - 127.5) / 63.75
        whole = torch.softmax(model(x.contiguous(memory_format=torch.channels_last)), 1).numpy()
    assert abs(got.probs - whole).max() < 1e-5 and got.targets.tolist() == [i % 3 for i in range(37)]


def test_a_single_view_model_takes_cpu_pass_images_a_pass():
    net = _net()
    seen: list[int] = []
    net.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    predict_split(net, _Images(40), mean=[0.5] * 3, std=[0.25] * 3, batch_size=256, num_workers=0)
    assert seen == [CPU_PASS, CPU_PASS, 40 - 2 * CPU_PASS]
