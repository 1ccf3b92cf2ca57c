"""Where a photo's ground truth lies in a tree beside the photos' own: a mask image or a box
file named as the photo, in a ground-truth folder (masks.MASK_DIRS) that is a sibling of one
of the photo's ancestors, at the same relative path below it (MVTec-AD's `test/crack/000.png`
-> `ground_truth/crack/000_mask.png`; VisA's `Data/Images/Anomaly/000.JPG` ->
`Data/Masks/Anomaly/000.png`; YOLO's `images/train/x.jpg` -> `labels/train/x.txt`) or, for
box files, flat at its top (NEU-DET's one `annotations/` for every class folder) or beside
the photo; else the photo's entry in a COCO file of one of those folders (dtrain.data.coco).

Torch-free: the data layouts label photos by these files (dtrain/data/layouts.py, masklabels)
before any training process starts; dtrain/data/mask_targets.py reads them as masks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from dtrain.data import boxes, coco
from dtrain.data.masks import IMAGE_EXTENSIONS, MASK_DIRS, MASK_SUFFIXES

# How far above a photo a mirrored ground-truth tree may branch off: MVTec's photo sits two
# folders below it (test/crack/), VisA's three (Images/Anomaly/ under Data/).
MIRROR_DEPTH = 3


class Trees:
    """Ground-truth trees that mirror the photos' tree, each folder listed once."""

    extensions = IMAGE_EXTENSIONS
    # Also a ground-truth folder's own files, whatever sub-folders the photo sits in.
    flat = False

    def __init__(self) -> None:
        self._siblings: dict[Path, list[Path]] = {}
        self._masks: dict[Path, dict[str, Path]] = {}

    def mask_of(self, photo: Path) -> str | None:
        """The mask of `photo` in a ground-truth tree beside one of its ancestors (a folder
        named as MASK_DIRS, a sibling of that ancestor), at the same relative path (or, with
        `flat`, at its top), named by the photo's stem with or without a mask suffix."""
        stems = stems_of(photo)
        for branch in branches(photo):
            relative = photo.parent.relative_to(branch)
            for truth in self.truth_beside(branch):
                hit = self.named(truth / relative, stems) or (self.named(truth, stems) if self.flat else None)
                if hit is not None:
                    return hit
        return None

    def truth_beside(self, folder: Path) -> list[Path]:
        if folder not in self._siblings:
            self._siblings[folder] = [p for p in _entries(folder.parent)
                                      if p.name.lower() in MASK_DIRS and p != folder and p.is_dir()]
        return self._siblings[folder]

    def named(self, folder: Path, stems: list[str]) -> str | None:
        """The first of `stems` that `folder` holds a candidate of."""
        masks = self.masks_in(folder)
        return next((str(masks[n]) for n in stems if n in masks), None)

    def masks_in(self, folder: Path) -> dict[str, Path]:
        if folder not in self._masks:
            self._masks[folder] = {p.stem.lower(): p for p in _entries(folder)
                                   if p.suffix.lower() in self.extensions and self.usable(p)}
        return self._masks[folder]

    def usable(self, path: Path) -> bool:
        return True


class BoxTrees(Trees):
    """Box files instead of mask images: also beside the photo, and flat in a ground-truth
    folder whose photos sit in class folders (NEU-DET keeps one annotations/ for all classes)."""

    extensions = frozenset(boxes.BOX_EXTENSIONS)
    flat = True

    def __init__(self) -> None:
        super().__init__()
        self._coco: dict[Path, list[Path]] = {}

    def mask_of(self, photo: Path) -> str | None:
        # with a mask suffix too: a k-fold run links a photo's box file as `<stem>_mask.xml` (recipe/folds.py)
        return self.named(photo.parent, stems_of(photo)) or super().mask_of(photo) or self.coco_entry(photo)

    def coco_entry(self, photo: Path) -> str | None:
        """The photo's entry (coco.find's ref) in a COCO file in its folder or an ancestor's
        (Roboflow's train/_annotations.coco.json, Label Studio's result.json beside images/),
        or in a ground-truth folder beside one (CVAT's annotations/instances_default.json)."""
        for branch in branches(photo):
            for folder in (branch, *self.truth_beside(branch)):
                for listing in self.coco_files(folder):
                    if (ref := coco.find(photo, listing)) is not None:
                        return ref
        return None

    def coco_files(self, folder: Path) -> list[Path]:
        if folder not in self._coco:
            self._coco[folder] = [p for p in _entries(folder)
                                  if p.suffix.lower() == ".json" and coco.read_index(p) is not None]
        return self._coco[folder]

    def usable(self, path: Path) -> bool:
        # A .txt of notes beside a photo is not a box file: only what parses counts.
        return boxes.readable(path)


def branches(photo: Path) -> Iterator[Path]:
    """The photo's folder and its ancestors, MIRROR_DEPTH of them at most: where a ground-truth
    tree may branch off."""
    branch = photo.parent
    for _ in range(MIRROR_DEPTH):
        yield branch
        if branch.parent == branch:
            return
        branch = branch.parent


def stems_of(photo: Path) -> list[str]:
    """The stems a mask of `photo` may have: its own, or it plus a mask suffix."""
    stem = photo.stem.lower()
    return [stem + suffix for suffix in ("", *MASK_SUFFIXES)]


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(Path(e.path) for e in os.scandir(folder))
    except OSError:  # not there, or not a folder
        return []
