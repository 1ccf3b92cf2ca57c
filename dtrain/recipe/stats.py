"""What the recipe looks at in a labelled image set: classes, counts, image sizes, grey or colour.

Reads the folder listing (dtrain.data.layouts) and the headers of a fixed, evenly
spaced sample of the training images; no training image is decoded in full except
for the colour check of that sample.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dtrain.data.config import DataConfig
from dtrain.errors import DtrainError

# Images whose headers (and a thumbnail) are read: enough for a median side and a grey share.
SAMPLE = 200
# A colour image whose channels differ by at most this many grey levels everywhere is grey
# (JPEG and PNG writers often store grey photos as RGB).
GREY_TOLERANCE = 3


@dataclass(frozen=True)
class DataStats:
    classes: list[str]
    negative_class: str | None  # resolved: the defect-free class found, or None
    train_counts: dict[str, int]
    val_counts: dict[str, int]
    short_sides: list[int]  # of the sampled training images
    aspect_ratios: list[float]  # long side / short side, sampled
    grey_share: float  # sampled images that are grey

    @property
    def n_train(self) -> int:
        return sum(self.train_counts.values())

    @property
    def n_val(self) -> int:
        return sum(self.val_counts.values())

    @property
    def median_side(self) -> int:
        return int(statistics.median(self.short_sides))


def detect_layout(root: Path) -> str:
    """imagefolder (ROOT/{train,val,test}/<class>) or mvtec (ROOT/[category/]{train,test}/<class>)."""
    if not root.is_dir():
        raise DtrainError(f"data directory not found: {root}", "pass --data the folder that holds train/ (and val/, test/)")
    if (root / "train").is_dir() and (root / "val").is_dir():
        return "imagefolder"
    if (root / "train" / "good").is_dir() or any((d / "train" / "good").is_dir() for d in root.iterdir() if d.is_dir()):
        return "mvtec"
    raise DtrainError(
        f"{root} is neither ImageFolder (train/ and val/ with one folder per class) nor MVTec-AD (train/good)",
        "lay the images out as ROOT/{train,val,test}/<class>/*.png",
    )


def gather(cfg: DataConfig, sample: int = SAMPLE) -> DataStats:
    from dtrain.data.layouts import scan

    if "://" in cfg.root or cfg.layout == "shards":
        raise DtrainError("the recipe reads a local folder of images", "pass --data a local ImageFolder or MVTec directory")
    train = scan(cfg, cfg.train_split)
    val = scan(cfg, cfg.val_split) if cfg.val_split else None
    if not train.paths:
        raise DtrainError(f"no training images under {cfg.root}", "put each class's images in ROOT/train/<class>/")
    step = max(1, len(train.paths) // sample)
    sides, aspects, grey = [], [], 0
    for path in train.paths[::step][:sample]:
        w, h, is_grey = _look(path)
        sides.append(min(w, h))
        aspects.append(max(w, h) / max(min(w, h), 1))
        grey += is_grey
    return DataStats(
        classes=train.classes,
        negative_class=None if train.negative_index is None else train.classes[train.negative_index],
        train_counts=_counts(train),
        val_counts=_counts(val) if val else {},
        short_sides=sides,
        aspect_ratios=aspects,
        grey_share=grey / len(sides),
    )


def _counts(listing) -> dict[str, int]:
    found = Counter(listing.targets)
    return {name: found.get(i, 0) for i, name in enumerate(listing.classes)}


def _look(path: str) -> tuple[int, int, bool]:
    """(width, height, grey) of one image; grey from the mode, or from a thumbnail's channels."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        w, h = im.size
        if im.mode in ("1", "L", "LA", "I", "I;16", "F"):
            return w, h, True
        im.draft("RGB", (64, 64))  # JPEG: decode at a fraction of the size
        thumb = np.asarray(im.convert("RGB").resize((64, 64)), dtype=np.int16)
    spread = thumb.max(axis=2) - thumb.min(axis=2)
    return w, h, bool(spread.max() <= GREY_TOLERANCE)
