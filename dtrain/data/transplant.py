"""Defects moved onto defect-free parts while training (DataConfig.transplant).

Why: a plant's set holds thousands of good parts and a few dozen photos of each defect,
and a from-scratch network learns a defect from how it differs from the surface around
it. With a mask, a defect can be lifted off its photo as that difference and laid onto
another part: each defective photo then shows its defect on hundreds of surfaces,
finishes and places instead of one, which is what a network needs to tell a faint defect
from the texture it sits on. ("Copy-paste" augmentation, as used for few-shot defect
sets; here the defect is moved as a change of the surface, not as pixels with its own
background, so a faint defect stays faint.)

How (`Transplants`):
- a donor is a defective training photo whose mask marks pixels (UNKNOWN masks give none);
- its defect is `photo - background` over the mask widened by DILATE pixels, where the
  background is the photo's unmasked pixels spread into the mask by a normalised Gaussian
  blur (sigma: the input's side / BLUR_SHARE, wider than a scratch or a pit, narrower than
  a part's shading), the edge feathered; kept as the crop around the mask (int16), per
  process, on first use;
- a host drawn by the sampler receives one, with probability `share`: a donor drawn
  uniformly, the crop turned and flipped as the augmentation turns parts, laid
  at a uniformly random place where it fits, its change scaled by a strength drawn from
  [min_strength, 1] (DataConfig.transplant_min_strength), clipped to 0..255. A grey picture receives the
  defect's grey level (a monochrome camera sees no tint). Its label becomes the donor's
  class and its mask channel the donor's widened mask at that place.
- the hosts: the defect-free photos where the set has a defect-free class. Where it has
  none (a set of defect types only), the donors themselves, each with its own defects
  taken off first (photo - its lifted change: the background estimate inside the widened
  mask), so the part shows only the laid defect and the label stays true. The same
  surfaces and finishes then carry every type instead of one: the network is taught the
  defect's shape, not which part or finish a type happened to be photographed on.

Draws from torch's RNG only, so a caller that seeds torch per sample
(dtrain.train.loaders.SeededSamples) gets the same transplants on a resumed run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dtrain.data.mask_targets import MARKED
from dtrain.data.transforms import LUMA

# The background's blur: sigma = the input's shorter side / BLUR_SHARE (10 px at 160 px).
BLUR_SHARE = 16
# The mask is widened by this many pixels before the background is estimated: a defect's
# own faint rim, outside what the mask marks, must not leak into the background.
DILATE = 2

Loader = Callable[[int], torch.Tensor | None]  # index -> uint8 [4, H, W] (photo + mask) or None


Lifted = tuple[torch.Tensor, torch.Tensor, tuple[int, int]]


def lift(pixels: torch.Tensor) -> Lifted | None:
    """uint8 [4, H, W] (a defective photo and its mask) -> (int16 [3, h, w] the defect as a
    change of the surface, uint8 [1, h, w] its widened mask, (row, column) of the crop in the
    photo), cropped to the widened mask's box; None: the mask marks nothing (or is UNKNOWN)."""
    marked = (pixels[3:4] == MARKED).to(torch.float32)[None]  # an UNKNOWN mask (127) marks nothing
    if not marked.any():
        return None
    photo = pixels[:3].to(torch.float32)[None]
    wide = F.max_pool2d(marked, 2 * DILATE + 1, 1, DILATE)
    keep = 1 - wide
    sigma = max(1.0, min(pixels.shape[-2:]) / BLUR_SHARE)
    background = _blur(photo * keep, sigma) / _blur(keep, sigma).clamp_min(1e-3)
    # Soft edge, inside the widened mask: what is laid elsewhere is exactly the widened mask.
    feather = _blur(F.max_pool2d(marked, 3, 1, 1), 0.7).clamp_(0, 1) * wide
    change = ((photo - background) * feather)[0].round_().to(torch.int16)
    rows = torch.nonzero(wide[0, 0].any(1)).flatten()
    cols = torch.nonzero(wide[0, 0].any(0)).flatten()
    box = (slice(None), slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1))
    return change[box].contiguous(), (wide[0] > 0).to(torch.uint8).mul_(MARKED)[box].contiguous(), (box[1].start, box[2].start)


def take_off(pixels: torch.Tensor, lifted: Lifted) -> torch.Tensor:
    """uint8 [4, H, W] a defective photo + its own lifted defect -> the photo without it
    (the background estimate inside the widened mask), its mask channel cleared."""
    change, _, (y0, x0) = lifted
    out = pixels.clone()
    window = (slice(None), slice(y0, y0 + change.shape[-2]), slice(x0, x0 + change.shape[-1]))
    out[:3][window] = (out[:3][window].to(torch.int16) - change).clamp_(0, 255).to(torch.uint8)
    out[3:4].zero_()
    return out


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian of [1, C, H, W], the border mirrored (reflect needs pad < side)."""
    r = int(3 * sigma)
    t = torch.arange(-r, r + 1, dtype=torch.float32)
    k = torch.exp(-t * t / (2 * sigma * sigma))
    k = k / k.sum()
    c, (h, w) = x.shape[1], x.shape[-2:]
    for dim, size in ((-1, w), (-2, h)):
        pad = min(r, size - 1)
        shape = (1, 1, 1, -1) if dim == -1 else (1, 1, -1, 1)
        kernel = k[r - pad: r + pad + 1].view(shape)
        kernel = (kernel / kernel.sum()).expand(c, *kernel.shape[1:]).contiguous()
        padding = (pad, pad, 0, 0) if dim == -1 else (0, 0, pad, pad)
        x = F.conv2d(F.pad(x, padding, mode="reflect") if pad else x, kernel, groups=c)
    return x


def lay(pixels: torch.Tensor, change: torch.Tensor, mask: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
    """uint8 [4, H, W] defect-free photo + a lifted defect -> the photo with it, at a random
    turn and place (torch's RNG), its change scaled by `strength`. The photo's own mask
    channel is replaced by the defect's (a fainter defect is still all there)."""
    if strength != 1.0:
        change = (change.to(torch.float32) * strength).round_().to(torch.int16)
    k, flip = (int(v) for v in torch.randint(0, 4, (2,)))
    change, mask = (t.flip(-1) if flip & 1 else t for t in (change, mask))
    h, w = pixels.shape[-2:]
    if k & 1 and (change.shape[-1] > h or change.shape[-2] > w):
        k &= 2  # a quarter turn would not fit a rectangle's short side
    if k:
        change, mask = torch.rot90(change, k, (-2, -1)), torch.rot90(mask, k, (-2, -1))
    ch, cw = min(change.shape[-2], h), min(change.shape[-1], w)
    change, mask = change[:, :ch, :cw], mask[:, :ch, :cw]
    y0 = int(torch.randint(0, h - ch + 1, ()))
    x0 = int(torch.randint(0, w - cw + 1, ()))
    out = pixels.clone()
    photo = out[:3]
    if torch.equal(photo[0], photo[1]) and torch.equal(photo[1], photo[2]):
        # A grey part: the defect's grey level in all three channels.
        grey = sum(wt * c.to(torch.float32) for wt, c in zip(LUMA, change)).round_().to(torch.int16)
        change = grey.expand(3, -1, -1)
    window = (slice(None), slice(y0, y0 + ch), slice(x0, x0 + cw))
    photo[window] = (photo[window].to(torch.int16) + change).clamp_(0, 255).to(torch.uint8)
    out[3:4].zero_()
    out[3:4][window] = mask
    return out


class Transplants:
    """Per dataset (and per worker process: each fills its own crops as it meets donors)."""

    def __init__(self, share: float, donors: list[int], targets: list[int], load: Loader,
                 negative_index: int | None, min_strength: float = 1.0) -> None:
        self.share, self.donors, self.targets, self._load = share, donors, targets, load
        self.min_strength = min_strength
        self.negative_index = negative_index  # None: the donors are the hosts (take_off first)
        self._donor_set = set(donors)
        self._lifted: dict[int, Lifted | None] = {}

    def __call__(self, pixels: torch.Tensor, index: int) -> tuple[torch.Tensor, int]:
        """Draw `index` (its pixels) -> itself and its label, or (with probability `share`,
        where it is a host) a donor's defect on it and the donor's class."""
        target = self.targets[index]
        if self.negative_index is not None:
            host = target == self.negative_index
        else:
            host = index in self._donor_set
        if not host or not self.donors or float(torch.rand(())) >= self.share:
            return pixels, target
        j = self.donors[int(torch.randint(0, len(self.donors), ()))]
        lifted = self._lift(j)
        if lifted is None:
            return pixels, target
        if self.negative_index is None:
            own = self._lift(index, pixels)
            if own is None:
                return pixels, target
            pixels = take_off(pixels, own)
        strength = 1.0
        if self.min_strength < 1.0:  # no draw at 1: the stream, and so the run, as before the option
            strength = self.min_strength + (1.0 - self.min_strength) * float(torch.rand(()))
        return lay(pixels, lifted[0], lifted[1], strength), self.targets[j]

    def _lift(self, j: int, pixels: torch.Tensor | None = None) -> Lifted | None:
        """Photo `j`'s lifted defect, lifted on first use (from `pixels`, its own, when the
        caller already holds them: a host's photo is not read twice)."""
        if j not in self._lifted:
            donor = self._load(j) if pixels is None else pixels
            self._lifted[j] = None if donor is None else lift(donor)
        return self._lifted[j]
