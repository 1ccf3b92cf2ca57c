"""Each training photo's defect mask, as a fourth channel beside its pixels (TrainConfig.mask_loss).

Which mask a photo gets (`mask_files`): the file that the data layer pairs with it
(dtrain/data/masks.py: beside it, in a ground-truth sub-folder, or in masks/ beside
images/), else one in a ground-truth tree that mirrors the photos' tree (`_Trees`:
MVTec-AD's `test/crack/000.png` -> `ground_truth/crack/000_mask.png`, VisA's
`Data/Images/Anomaly/000.JPG` -> `Data/Masks/Anomaly/000.png`), else a box file
(dtrain.data.boxes: Pascal VOC XML or YOLO text) beside the photo or in such a tree,
mirrored or flat (NEU-DET's `train/images/crazing/crazing_1.jpg` ->
`train/annotations/crazing_1.xml`; YOLO's `images/train/x.jpg` -> `labels/train/x.txt`),
its boxes filled in as the mask. A photo without one is
clear when it belongs to the defect-free class (MVTec's good parts have no mask) and
UNKNOWN otherwise: a defective photo someone did not mask
says nothing about where its defect is, and the loss leaves it out rather than teach
"nothing here".

How it travels (`with_mask`): as channel 3 of the uint8 picture, 0 or 255 per pixel
(UNKNOWN everywhere when there is none). So the decoded cache, the workers' collate and
the augmentation's flips, quarter turns and shifts carry it without a second code path;
the augmentation's brightness and contrast touch channels 0-2 only, and the training loop
splits it off before normalising.

A mask marks a pixel as masks.marks_pixels reads it (masks.mark_floor): any value above 0
in a lossless file (label images store classes as 1, 2, ...), from LOSSY_MARK up in a JPEG. It is
resized by the pictures' own rule (resize_uint8, so a picture turned to lie across is
turned with it); any share of a marked pixel stays marked, so a defect a pixel wide is
not lost to the downscale.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from dtrain.data import boxes
from dtrain.data.config import Size, as_hw
from dtrain.data.decode import upright
from dtrain.data.masks import CONTAINER_NAMES, MAX_MASK_PIXELS, mark_floor, masks_of_images
from dtrain.data.shapes import drawn_as_stored
from dtrain.data.transforms import resize_uint8
from dtrain.data.truth_trees import BoxTrees, Trees

UNKNOWN = 127  # the fill of a defective photo with no mask: never a value of a read mask (0 or 255)
MARKED = 255


def mask_files(paths: Sequence[str]) -> list[str | None]:
    """The mask file paired with each photo, or None. One scan per folder of photos (an
    `images/` folder's parent, so that its `masks/` sibling is seen)."""
    found: dict[str, str] = {}
    scanned: set[str] = set()
    for path in paths:
        folder = Path(path).parent
        if folder.name.lower() in CONTAINER_NAMES:
            folder = folder.parent
        key = os.path.realpath(folder)
        if key in scanned:
            continue
        scanned.add(key)
        _, _, pairs = masks_of_images(folder)
        found.update((os.path.realpath(p), str(m)) for p, m in pairs.items())
    trees, boxed = Trees(), BoxTrees()
    return [found.get(os.path.realpath(p)) or trees.mask_of(Path(p)) or boxed.mask_of(Path(p)) for p in paths]


def read_mask(path: str | Path, size: Size, native: tuple[int, int] | None = None, orientation: int = 1) -> torch.Tensor:
    """A mask file -> uint8 [1, H, W] of 0 / MARKED at the input size. A box file is
    filled in at `native`, its photo's own (height, width) as decoded, first (its boxes are
    shares of it; the caller has just decoded the photo). `orientation`: the EXIF orientation
    the photo's decode applied; a label drawn on the stored pixels is turned with them
    (dtrain.data.shapes). Raises OSError or ValueError when it cannot be read."""
    from PIL import Image

    if boxes.is_box_file(path):
        if native is None:
            raise ValueError(f"{Path(path).name} holds boxes: its photo's size is needed to fill them in")
        height, width = native
        if width * height > MAX_MASK_PIXELS:
            raise ValueError(f"{width} x {height} pixels: larger than a mask is read")
        shapes = boxes.read_shapes(path).seen_upright(orientation, native)
        return _at_size(boxes.rasterise(shapes, height, width).mul_(MARKED), size)
    floor = mark_floor(path)
    try:
        with Image.open(path) as img:
            if img.width * img.height > MAX_MASK_PIXELS:
                raise ValueError(f"{img.width} x {img.height} pixels: larger than a mask is read")
            # 16/32-bit grey is read as it is (Pillow's 8-bit conversion would clip it).
            values = np.asarray(img if img.mode.startswith("I") else img.convert("L"))
    except (OSError, ValueError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow fails on a damaged file however its reader does
        raise ValueError(f"not a readable mask ({type(exc).__name__}: {exc})") from None
    marked = torch.from_numpy(np.ascontiguousarray(values >= floor)).to(torch.uint8).mul_(MARKED)[None]
    if native is not None and drawn_as_stored((values.shape[1], values.shape[0]), orientation, native):
        marked = upright(marked, orientation)  # a mask made from the stored pixels (PIL's open does not turn)
    return _at_size(marked, size)


def _at_size(marked: torch.Tensor, size: Size) -> torch.Tensor:
    h, w = as_hw(size)
    if tuple(marked.shape[-2:]) == (h, w):
        return marked
    return resize_uint8(marked, (h, w)).gt_(0).mul_(MARKED)


def constant_mask(size: Size, value: int) -> torch.Tensor:
    return torch.full((1, *as_hw(size)), value, dtype=torch.uint8)


def with_mask(image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """uint8 [3, H, W] + [1, H, W] -> [4, H, W]. The mask was resized to the input size,
    which a picture turned by resize_uint8 also has."""
    return torch.cat([image, mask])
