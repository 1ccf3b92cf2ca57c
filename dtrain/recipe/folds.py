"""k-fold over train + val, for a threshold that every labelled defect informs.

Why: the threshold keeps the miss rate's 95 % upper bound within target (bound95), and
that bound can reach 0.5 % only with >= 598 defective images (none missed). A plant's
validation split rarely holds so many: with ~80 its threshold rests on the faintest of
80 defects, and what it promises for new parts is a bound near 4 %. Training k models,
each blind to one fold, scores every defective image of train + val once as unseen
(out of fold, OOF); the threshold is then chosen on all of them.

The final model is trained on all of train + val with the fold models' recipe (same
epochs, no best-epoch pick, since nothing is held out), not an ensemble of the fold
models: the threshold is calibrated on single models' scores, and the mean of k scores
is distributed differently (tighter), so an ensemble would be deployed with a threshold
calibrated for something else; one model is also what export, inspect and serve take,
at one model's inference cost. The fold models learn from (k-1)/k of the images, the
final model from all: its defect scores are, if anything, better separated, so the
threshold errs on the safe side. This is the usual cross-validation assumption, stated.

Folds are written as folders of symbolic links (ImageFolder layout), so each fold is an
ordinary `dtrain train` run of an ordinary config.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.data import boxes, coco
from dtrain.data.decode import read_header
from dtrain.data.masks import MASK_SUFFIXES
from dtrain.evaluation.metrics import min_defective_for_target

# The suffix a mask's link takes beside its photo's link: one the data layer pairs by name.
MASK_LINK_SUFFIX = MASK_SUFFIXES[0]

# 5 folds: each fold model learns from 80 % of the labelled images, close to the final
# model's 100 %; more folds cost one training each and move that share little (90 % at 10).
MAX_FOLDS = 5
# Fewer folds when the rarest class is smaller than MAX_FOLDS (so that every held-out
# fold holds one of it), and never fewer than 4: the threshold transfer assumes that the
# fold models stand for the final one, and with 2 (each learning from half the images)
# they do not. Measured (BENCHMARKS.md, session 11, the 80-defect plant cut): the 2-fold
# models' faintest defect scored 0.00027, the final model's faintest test defect 0.013;
# the threshold that kept every fold-scored defect flagged 94 % of the out-of-fold good
# parts and every good test part. At 4 folds each learns from 75 %.
MIN_FOLDS = 4


@dataclass(frozen=True)
class FoldPlan:
    k: int  # 0: no k-fold, the threshold is chosen on the validation split
    reason: str


def plan_folds(
    val_defective: int, labelled: dict[str, int], negative_class: str | None, target_miss_rate: float
) -> FoldPlan:
    """How many folds (0 = none) from the defective images at hand; `labelled`: train + val counts per class."""
    if negative_class is None:
        return FoldPlan(0, "a classification task: no threshold to calibrate, so no k-fold")
    need = min_defective_for_target(target_miss_rate)
    if val_defective >= need:
        return FoldPlan(0, f"{val_defective} defective validation images (>= {need}, what 0 misses needs to show "
                           f"{target_miss_rate:.2%} at 95 % confidence): the threshold is chosen on validation, no k-fold")
    defects = {k: v for k, v in labelled.items() if k != negative_class and v > 0}
    rarest = min(defects.values()) if defects else 0
    k = max(MIN_FOLDS, min(MAX_FOLDS, rarest))
    return FoldPlan(k, (
        f"only {val_defective} defective validation images (< {need}): {k}-fold training over train + val scores "
        f"all {sum(defects.values())} labelled defective images with models that never saw them, and the threshold "
        f"is chosen on those out-of-fold scores; k = {MAX_FOLDS} (each fold model learns from "
        f"{(MAX_FOLDS - 1) / MAX_FOLDS:.0%} of the images, near the final model's 100 %), fewer when the rarest "
        f"defect class has fewer images than folds (here {rarest}), at least {MIN_FOLDS} (fold models that learn "
        f"from less do not stand for the final model); then one final model on all of train + val"
    ))


def assign_folds(targets: list[int], k: int, seed: int) -> list[int]:
    """Fold of every image: stratified (each class dealt round-robin after a seeded shuffle),
    the dealing carried on from class to class so that fold sizes differ by at most one."""
    by_class: dict[int, list[int]] = {}
    for i, t in enumerate(targets):
        by_class.setdefault(t, []).append(i)
    folds = [0] * len(targets)
    dealt = 0
    for cls in sorted(by_class):
        members = by_class[cls]
        random.Random(f"{seed}:{cls}").shuffle(members)  # str seeds hash deterministically
        for i in members:
            folds[i] = dealt % k
            dealt += 1
    return folds


def link_split(root: Path, split: str, classes: list[str], paths: list[str], targets: list[int],
               masks: Sequence[str | None] | None = None) -> None:
    """root/split/<class>/ with one symbolic link per image; every class gets its folder
    (empty or not), so the split lists the same classes as the source data. `masks`: each
    image's mask file (mask_targets.mask_files) or None, linked beside the image's link as
    `<its stem>_mask<ext>`, the name the data layer pairs (data/masks.py): the fold runs of a
    recipe with mask_loss learn from the same pixel labels as the final run. Without the
    links a fold's photos, found in a folder of links, had no mask. A photo's entry in a
    COCO file has no file to link: its boxes are written there as a YOLO text file."""
    for name in classes:
        (root / split / name).mkdir(parents=True, exist_ok=True)
    for n, (path, t) in enumerate(zip(paths, targets)):
        # Numbered: MVTec's train/good/000.png and test/good/000.png may meet in one folder.
        link = root / split / classes[t] / f"{n:06d}_{Path(path).name}"
        os.symlink(os.path.abspath(path), link)
        mask = masks[n] if masks is not None else None
        if mask is not None and coco.is_ref(mask):  # an entry of a COCO file: written out as the photo's own box file
            # YOLO states no frame: the shapes are written as seen on the upright photo.
            shapes = boxes.read_shapes(mask)
            try:
                header = read_header(Path(path).read_bytes())
                shapes = shapes.seen_upright(header.orientation, header.upright_hw)
            except (OSError, ValueError):  # an unreadable photo: the fold's dataset leaves it out anyway
                pass
            link.with_name(f"{link.stem}{MASK_LINK_SUFFIX}.txt").write_text(boxes.as_yolo(shapes))
        elif mask is not None:
            os.symlink(os.path.abspath(mask), link.with_name(f"{link.stem}{MASK_LINK_SUFFIX}{Path(mask).suffix}"))
