"""A ResNet for small inspection crops (32-128 px).

torchvision's ResNets were shaped for 224 px photos: a 7x7 stride-2 stem and a max-pool
shrink a 64 px crop to 16x16 before the first block, so a crack half a pixel wide is
averaged away before any block can see it, and the last stage runs on 2x2 maps with 8 M
of the 11 M parameters. This one keeps twice the resolution at every stage (a full-resolution
3x3 stem, then one max-pool) at a quarter of the width: about the same multiply-adds as ResNet-18
at the same input size, a quarter of the parameters (so a quarter of the bytes DDP
all-reduces every step), and ~1.5x its training speed on one CPU thread at 64 px
(BENCHMARKS.md, "Quickstart").

`stem_stride=2` is for pictures larger than the crop the body can afford: at twice the side,
a stride-2 first convolution gives the blocks the maps they would get from a resize to half
the side, at about the same cost (the stem is a few percent of the multiply-adds), but it
learns that downscale from native pixels. A fixed resize averages a line one or two pixels
wide into its surroundings and halves its contrast; 32 learned filters can keep it as
edge responses.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torchvision.models.resnet import BasicBlock


class SmallResNet(nn.Module):
    def __init__(
        self,
        num_classes: int,
        width: int = 32,
        blocks: tuple[int, ...] = (2, 2, 2, 2),
        norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d,
        stem_stride: int = 1,
    ) -> None:
        super().__init__()
        # Full resolution for the first convolution, then a max-pool: a dark pit or a crack
        # a pixel wide fires a few units, and the max keeps them where a strided convolution
        # would average them with the texture around (measured: it learns ~2x faster here).
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=stem_stride, padding=1, bias=False), norm_layer(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers: list[nn.Module] = []
        channels = width
        for stage, count in enumerate(blocks):
            out = width * 2**stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                down = None
                if stride != 1 or channels != out:
                    down = nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False), norm_layer(out))
                layers.append(BasicBlock(channels, out, stride, down, norm_layer=norm_layer))
                channels = out
        self.blocks = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)  # "fc": the head prefix load_weights knows
        # As torchvision's ResNets. Not zero-initialising the blocks' last norms
        # (zero_init_residual): here that made the first 25 steps learn half as fast.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(self.pool(x).flatten(1))


def small_resnet(
    *, weights: None = None, num_classes: int, norm_layer: Callable[[int], nn.Module], stem_stride: int = 1
) -> nn.Module:
    """Builder with torchvision's signature, so it sits in the same ARCHS table (`weights`
    is always None there: nothing is downloaded; `pretrained: PATH` loads local weights)."""
    return SmallResNet(num_classes, norm_layer=norm_layer, stem_stride=stem_stride)
