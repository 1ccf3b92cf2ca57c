"""Image preparation shared by training, evaluation and inference.

Images travel as uint8 tensors [3, S, S] from disk to the training device: they are
4x smaller than float32 in worker-to-main transfers and pinned copies, and the float
conversion + normalisation (`normalize_batch`) runs once per batch on the device.

The one resize rule (`resize_uint8`: squash to S x S, or to H x W with the long side
across, antialiased) is used by the datasets and by `preprocess_image`, so a served model
sees exactly what it was trained on. Squashing instead of cropping keeps a defect near the
border in the picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from dtrain.data.config import Size, as_hw
from dtrain.data.decode import FULL_BITS, decode, decode_oriented, read_file

# ImageNet statistics: a `pretrained: PATH` ResNet expects them, and for random init
# any fixed affine map is as good as another. Stored in every checkpoint.
MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


def decode_bytes(data: bytes | bytearray | memoryview, sample_bits: int = FULL_BITS) -> torch.Tensor:
    """Encoded image -> uint8 [3, H, W] by dtrain's one decoder (dtrain.data.decode):
    raises ImageRefused (a ValueError) for an animated, unsupported or damaged file.
    `sample_bits`: DataConfig.sample_bits."""
    return decode(bytes(data), sample_bits=sample_bits)


def decode_uint8(data: torch.Tensor, sample_bits: int = FULL_BITS) -> torch.Tensor:
    """The same, for encoded bytes in a uint8 1-D tensor."""
    return decode(data.numpy().tobytes(), sample_bits=sample_bits)


def read_image(path: str | Path, sample_bits: int = FULL_BITS) -> torch.Tensor:
    """One file -> uint8 [3, H, W]; raises OSError when the file cannot be read and
    ImageRefused (a ValueError) when it is not an image dtrain decodes."""
    return decode(read_file(path), sample_bits=sample_bits)  # a file too large for any image: refused unread


def read_image_oriented(path: str | Path, sample_bits: int = FULL_BITS) -> tuple[torch.Tensor, int]:
    """`read_image`, and the EXIF orientation its decode applied (1: none)."""
    return decode_oriented(read_file(path), sample_bits=sample_bits)


def resize_uint8(img: torch.Tensor, size: Size) -> torch.Tensor:
    """uint8 [C, h, w] -> [C, H, W] for `size` (H, W) or a square side. Into a wide input
    (W > H) a picture standing upright (h > w) is first turned a quarter, counter-clockwise
    (as PIL's ROTATE_90: the runtime's dtrain.serve.images.resize does the same), so the
    long sides meet instead of being squashed across."""
    h, w = as_hw(size)
    if w > h and img.shape[-2] > img.shape[-1]:
        img = torch.rot90(img, 1, dims=(-2, -1))
    if tuple(img.shape[-2:]) == (h, w):
        return img
    return F.resize(img, [h, w], antialias=True)


def preprocess_image(image: Any, size: Size, sample_bits: int = FULL_BITS) -> torch.Tensor:
    """PIL image, array/tensor (HWC or CHW, grey or RGB), encoded bytes or a path ->
    uint8 [3, H, W] (`size`: a side or (H, W)), prepared exactly like the training images
    (minus augmentation); `sample_bits` applies to encoded 16-bit images."""
    if isinstance(image, (str, Path)):
        img = read_image(image, sample_bits)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        img = decode_bytes(image, sample_bits)
    elif isinstance(image, torch.Tensor):
        img = _as_chw_uint8(image)
    elif hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image
        img = F.pil_to_tensor(image.convert("RGB"))
    else:
        import numpy as np

        img = _as_chw_uint8(torch.from_numpy(np.array(image, copy=True)))
    return resize_uint8(img, size).contiguous()


def _as_chw_uint8(t: torch.Tensor) -> torch.Tensor:
    if t.ndim == 2:
        t = t.unsqueeze(0)
    if t.ndim != 3:
        raise ValueError(f"expected an image with 2 or 3 dimensions, got shape {tuple(t.shape)}")
    if t.shape[0] not in (1, 3, 4) and t.shape[-1] in (1, 3, 4):
        t = t.permute(2, 0, 1)  # HWC -> CHW
    if t.dtype != torch.uint8:
        if t.is_floating_point():
            t = (t.clamp(0, 1) * 255).round()
        t = t.to(torch.uint8)
    if t.shape[0] == 1:
        t = t.expand(3, -1, -1)
    elif t.shape[0] == 4:
        t = t[:3]
    return t


def normalize_batch(
    images: torch.Tensor, channels_last: bool = False, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 [B, 3, S, S] (on any device) -> normalised float [B, 3, S, S].

    One fused pass: (x - 255*mean) * (1 / (255*std)).
    """
    mean = torch.tensor(MEAN, device=images.device, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    inv_std = 1.0 / (torch.tensor(STD, device=images.device, dtype=torch.float32).view(1, 3, 1, 1) * 255.0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(images.shape, dtype=torch.float32, device=images.device, memory_format=fmt)
    torch.sub(images, mean, out=out)
    out.mul_(inv_std)
    return out if dtype == torch.float32 else out.to(dtype)


# ITU-R 601 luma weights of R, G, B: a picture's grey level (also dtrain/data/transplant.py).
LUMA = (0.299, 0.587, 0.114)


class InspectionAugment(v2.Transform):
    """Inspection-safe augmentation of uint8 images, as one v2 transform (a v2.Compose
    of flips, rotation and ColorJitter costs 3-4x more per sample, measured):

    - geometry: a uniformly random element of the square's symmetry group (rotation by
      k * 90 degrees, optionally mirrored). Parts have no canonical orientation, and
      unlike free rotation or crops it needs no interpolation and never cuts a defect off.
      A picture that is not square gets the rectangle's (flips and the half turn): a
      quarter turn would change its shape, and a batch holds one shape;
    - brightness and contrast factors in [1 - b, 1 + b] and [1 - c, 1 + c], contrast
      around the mean grey level (as v2.ColorJitter, within 2 grey levels). Hue and
      saturation stay untouched: a stain keeps its colour;
    - optionally (`shift` > 0) a translation by up to `shift` of the side in x and y,
      the uncovered border filled by mirroring the picture's own edge. A defect may sit
      anywhere on a part, so a shifted part keeps its label; on a small training set it is
      the augmentation that keeps the network from memorising where each defect lies.
      Mirroring (not a wrap-around or a constant) leaves no straight seam that could read
      as a scratch. The price: a shift of an eighth pushes up to the outer eighth of the
      picture out on one side, so a defect lying wholly in that strip is lost for that
      one draw (the next draw of the same image shifts another way).

    Draws from torch's RNG only (one call), so a caller that seeds torch per sample
    (dtrain.train.loaders.SeededSamples) gets reproducible augmentation.
    """

    _GREY = LUMA
    _transformed_types = (torch.Tensor,)  # plain tensors and tv_tensors.Image

    def __init__(self, brightness: float = 0.1, contrast: float = 0.1, shift: float = 0.0) -> None:
        super().__init__()
        if not 0 <= shift < 0.5:
            raise ValueError(f"shift must be in [0, 0.5), got {shift}")
        self.brightness, self.contrast, self.shift = brightness, contrast, shift

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        # Without a shift, exactly the 4 draws of old: seeded runs augment as they did.
        r = torch.rand(6 if self.shift else 4).tolist()
        r_rot, r_flip, r_b, r_c = r[:4]
        return {
            "k": int(r_rot * 4),
            "flip": r_flip < 0.5,
            "fb": 1 + (2 * r_b - 1) * self.brightness,
            "fc": 1 + (2 * r_c - 1) * self.contrast,
            "dxy": [2 * t - 1 for t in r[4:]],  # each in [-1, 1): a share of the largest shift
        }

    def transform(self, inpt: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        img = inpt.flip(-1) if params["flip"] else inpt
        k = params["k"] if inpt.shape[-2] == inpt.shape[-1] else params["k"] & 2  # odd turns -> none or a half
        if k:
            img = torch.rot90(img, k, dims=(-2, -1))
        fb, fc = params["fb"], params["fc"]
        x = img.to(torch.float32)
        # A fourth channel is the photo's defect mask (dtrain/data/mask_targets.py): it takes
        # the geometry, not the light.
        colour = x.narrow(-3, 0, 3)
        grey = sum(w * m for w, m in zip(self._GREY, colour.mean(dim=(-2, -1)).tolist()))
        # + 0.5 then truncation in the cast = rounding, for the non-negative values left.
        colour.mul_(fb * fc).add_((1 - fc) * fb * grey + 0.5)
        if params.get("dxy"):
            x = _shift(x, self.shift, *params["dxy"])
        return x.clamp_(0, 255).to(torch.uint8)


def _shift(x: torch.Tensor, shift: float, fx: float, fy: float) -> torch.Tensor:
    """float [..., H, W] moved by fx * shift * W and fy * shift * H pixels (fx, fy in [-1, 1]),
    the uncovered border mirrored from the picture's edge; same shape out."""
    h, w = x.shape[-2:]
    px, py = min(int(shift * w), w - 1), min(int(shift * h), h - 1)
    dx, dy = round(fx * px), round(fy * py)
    if not (dx or dy):
        return x
    padded = torch.nn.functional.pad(x, (px, px, py, py), mode="reflect")  # [C, H, W] or [B, C, H, W]
    return padded[..., py - dy: py - dy + h, px - dx: px - dx + w]


def train_augmentation(shift: float = 0.0) -> InspectionAugment:
    return InspectionAugment(brightness=0.1, contrast=0.1, shift=shift)
