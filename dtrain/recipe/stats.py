"""What the recipe looks at in a labelled image set: classes, counts, image sizes, grey or colour.

Reads the folder listing (dtrain.data.layouts) and, through the hardened decoder
(dtrain.data.decode: sizes checked before anything is inflated), the headers of a fixed
sample of the training images: SAMPLE of them, evenly spaced over the sorted listing
(class by class, so every class in proportion to its size), whatever the set's size.
The header's size and mode answer everything but one question: whether a colour-mode
image is really grey (cameras and converters often store grey as RGB). For that, at most
COLOUR_SAMPLE of the sampled colour-mode images, evenly spaced among them, are decoded
in full; their grey share stands for all colour-mode images of the sample. Over every
split, byte-identical files are found (recipe.copies: a test image that is also a training
image, one file under two classes), reading only files that share their size.
"""

from __future__ import annotations

import os
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dtrain.data.config import DataConfig
from dtrain.data.decode import DEFAULT_MAX_DECODE_BYTES, DEFAULT_MAX_PIXELS, Header, ImageRefused, check, decode, read_header
from dtrain.errors import DtrainError
from dtrain.recipe.copies import File, identical

if TYPE_CHECKING:
    from dtrain.data.layouts import Listing

# Pillow modes of single-channel images (8 or 16 bits, with or without alpha).
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})

# Images lying loose in the data folder whose names begin with 2..MAX_NAME_CLASSES prefixes
# may be classes by name (NEU-CLS: Cr_1.bmp); more prefixes than that are not classes.
MAX_NAME_CLASSES = 50
# 16-bit images decoded to see how many of their bits are used (a 12-bit camera's values
# stored as they come keep 16 grey levels in the decoder's high byte).
DEEP_SAMPLE = 20
# Images whose headers are read: enough for a median side (its error shrinks as 1/sqrt(n)).
SAMPLE = 200
# Colour-mode images decoded to tell grey-stored-as-RGB from colour: a share to +-7 % (1/sqrt(50)).
COLOUR_SAMPLE = 50
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
    refused: dict[str, str] = field(default_factory=dict)  # sampled files the decoder refuses: path -> why
    left_out: dict[str, str] = field(default_factory=dict)  # masks and ground-truth folders (dtrain.data.masks)
    copies: list[list[File]] = field(default_factory=list)  # byte-identical files over all splits (recipe.copies)
    deep_bits: list[int] = field(default_factory=list)  # of sampled 16-bit images: bits their largest value needs
    labelled_by: dict[str, int] = field(default_factory=dict)  # masklabels: photos per labelling rule, all splits
    masked_defects: int = 0  # defective training photos with a mask paired (dtrain.data.mask_targets)
    boxed_defects: int = 0  # of these, the ones whose mask is a box file (dtrain.data.boxes)

    @property
    def n_train(self) -> int:
        return sum(self.train_counts.values())

    @property
    def n_val(self) -> int:
        return sum(self.val_counts.values())

    @property
    def median_side(self) -> int:
        return int(statistics.median(self.short_sides))


# Other names data sets give their validation folder.
VAL_NAMES = ("val", "valid", "validation", "dev")
# train/ + test/ without a validation folder: this share of train becomes val, so a
# 80/20 train/test set ends up 60/20/20, the classfolders default (DataConfig).
VAL_FROM_TRAIN = 0.25
CARVED_VAL = "val-from-train"


def detect_layout(root: Path) -> dict[str, Any]:
    """The DataConfig fields of the layout `root` holds: ImageFolder with split folders
    (ROOT/{train,val,test}/<class>; val under another common name, or carved out of train
    when there is none; with train/ and a val folder only, that folder is the test split),
    MVTec-AD (ROOT/[category/]{train,test}/<class>), or bare class folders (ROOT/<class>/*,
    split per class by data.split_fractions)."""
    from dtrain.data.layouts import class_folders_with_images, split_root

    if not root.is_dir():
        raise DtrainError(f"data directory not found: {root}", "pass --data the folder that holds train/ (and val/, test/)")
    splits = split_root(root)  # YOLO keeps its splits in images/: images/train/ beside labels/train/
    if (splits / "train").is_dir() and _labelled_by_masks(splits / "train"):
        return {"layout": _by_boxes_or_masks(splits / "train"), **_split_folders(splits)}
    if not (splits / "train").is_dir() and _labelled_by_masks(root):
        return {"layout": _by_boxes_or_masks(root)}
    if (table := _label_table(root)) is not None:
        return table
    mvtec_like = _anomaly_shaped(root)  # train/ + test/ alone is MVTec's shape when train/ holds good parts only
    if (root / "train").is_dir() and (_val_folder(root) or ((root / "test").is_dir() and not mvtec_like)):
        return {"layout": "imagefolder", **_split_folders(root)}
    if mvtec_like or any(_anomaly_shaped(d) for d in root.iterdir() if d.is_dir()):
        return {"layout": "mvtec"}
    if len(class_folders_with_images(root)) >= 2:
        return {"layout": "classfolders"}
    loose = _loose_images(root)
    flat = _classes_by_name(loose)
    if flat:
        listed = ", ".join(f"{k} ({v})" for k, v in sorted(flat.items()))
        hint = ("if the prefix is the class (as in NEU-CLS: Cr_1.bmp, In_1.bmp), move each image into a folder named "
                "by it, ROOT/<prefix>/*")
        if all("_" in p.stem for p in loose):  # the shell line splits at the first '_'
            hint += f"; e.g. cd {root} && for f in *_*.*; do mkdir -p \"${{f%%_*}}\" && mv \"$f\" \"${{f%%_*}}/\"; done"
        raise DtrainError(
            f"{root} holds {sum(flat.values())} images directly, and no class folders; their names begin with "
            f"{len(flat)} prefixes: {listed}",
            hint,
        )
    raise DtrainError(
        f"{root} is none of: ImageFolder (train/ and val/ with one folder per class), MVTec-AD (train/good), "
        "class folders (one folder of images per class, at least two)",
        "lay the images out as ROOT/{train,val,test}/<class>/*.png, or ROOT/<class>/* to have them split for you",
    )


# The DataConfig fields that say where a layout keeps its splits and labels: they go with the
# layout when a checkpoint's data settings move to a root laid out otherwise (relocated).
LAYOUT_FIELDS = ("layout", "labels_file", "category", "train_split", "val_split", "test_split", "val_from_train",
                 "mvtec_train_fraction")


def relocated(base: dict[str, Any], root: str) -> dict[str, Any]:
    """A training run's data fields `base` for another local `root` (dtrain eval / export
    --data on new photos): where `root` holds another layout than the one trained on (a model
    trained on bare class folders, its new photos laid out as train/val/test), that layout's
    fields replace the run's (LAYOUT_FIELDS); the rest (negative class, bits, seeds, split
    fractions) stay, and a run trained without a val split still has none. Read with the run's
    own layout, the split folders were taken for classes."""
    trained_on = base.get("root")
    if "://" in root or base.get("layout") == "shards" or (
            trained_on is not None and os.path.realpath(root) == os.path.realpath(trained_on)):
        return base  # the same folder, however it is written: as trained
    try:
        found = detect_layout(Path(root))
    except DtrainError:
        return base  # the run's own layout then says what is wrong with the root
    if found["layout"] == base.get("layout", "imagefolder"):
        return base
    if not base.get("val_split", "val"):  # trained without one (a k-fold final model: on train + val):
        found = {**found, "val_split": "", "val_from_train": 0.0}  # a val carved here would be images it saw
    return {**{k: v for k, v in base.items() if k not in LAYOUT_FIELDS}, **found}


def _anomaly_shaped(base: Path) -> bool:
    """MVTec-AD's shape, as anomaly-detection sets ship it: base/train/ holds good parts only
    (a `good/` folder, or one folder named as defect-free beside a test/ folder: BTAD's
    `train/ok/` with `test/ok/` and `test/ko/`). Read as an ImageFolder, such a set would
    train on no defect at all; the mvtec layout lends test images to train
    (decide.lend_test_images)."""
    from dtrain.data.layouts import says_defect_free
    from dtrain.data.masks import not_photos

    train = base / "train"
    if not train.is_dir():
        return False
    names = [d.name for d in train.iterdir() if d.is_dir() and not not_photos(d)]
    if "good" in names:
        return True
    return len(names) == 1 and (base / "test").is_dir() and says_defect_free(names[0])  # ok, good, normal too


def _test_split(cfg: DataConfig) -> Listing | None:
    """The test split's listing, read only to find copies of training images in it; None
    where the data has none (an ImageFolder with train/ and val/ alone)."""
    from dtrain.data.layouts import scan

    if not cfg.test_split:
        return None
    try:
        return scan(cfg, cfg.test_split)
    except DtrainError:  # no test folder: nothing there to be a copy
        return None


def _classes_by_name(images: list[Path]) -> dict[str, int]:
    """{prefix: images} for images lying loose in one folder whose names begin with a few
    shared prefixes (the part before the first '_', '-' or digit); {} when they do not."""
    counts = Counter(re.split(r"[_\-\s]|(?<=[A-Za-z])(?=\d)", p.stem, maxsplit=1)[0] for p in images)
    counts.pop("", None)
    if not 2 <= len(counts) <= MAX_NAME_CLASSES or min(counts.values()) < 2:
        return {}
    return dict(counts)


def _by_boxes_or_masks(folder: Path) -> str:
    """masklabels (defect or ok), or boxclasses (defect types) where every photo of `folder`
    holds a box: a detection set without good parts has no 'ok' to learn."""
    from dtrain.data.layouts import every_photo_boxed

    return "boxclasses" if every_photo_boxed(folder) else "masklabels"


def _labelled_by_masks(folder: Path) -> bool:
    """Whether `folder`'s photos are labelled by their masks or box files rather than by
    folders: some of them have one (dtrain.data.masks, dtrain.data.truth_trees), and the
    folders they lie in name no classes. They lie loose in `folder` (KolektorSDD2's train/),
    in images/ beside masks/ or labels/ (a segmentation or detection set), or in numbered
    folders of one name (KolektorSDD's kos01..kos50, DAGM's Class1..Class10: parts or
    textures, each holding good and defective photos)."""
    from dtrain.data.layouts import class_folders_with_images
    from dtrain.data.masks import CONTAINER_NAMES, masks_of_images
    from dtrain.data.truth_trees import BoxTrees

    try:
        # a photo folder is no class (VOC's JPEGImages/ beside Annotations/ and ImageSets/)
        groups = [g for g in class_folders_with_images(folder) if g.lower() not in CONTAINER_NAMES]
    except DtrainError:  # flat images/ beside labels/ or masks/: labelled by masks if masks pair with them
        groups = []
    if groups and not _numbered(groups):
        return False
    photos, _, masks = masks_of_images(folder)
    if masks:
        return True
    boxed = BoxTrees()
    return any(boxed.mask_of(p) is not None for p in photos)


def _label_table(root: Path) -> dict[str, Any] | None:
    """csvlabels' fields when `root` holds a table of labels (dtrain.data.csv_labels) and its
    folders name no classes (none, numbered ones, or split folders without class folders)."""
    from dtrain.data import csv_labels
    from dtrain.data.layouts import class_folders_with_images
    from dtrain.data.masks import images_under

    table = csv_labels.find_table(root)
    if table is None:
        return None
    for folder in [root / s for s in ("train", "val", "test") if (root / s).is_dir()] or [root]:
        try:
            groups = list(class_folders_with_images(folder))
        except DtrainError:  # images/ beside annotations/: no classes in folders
            groups = []
        if len(groups) >= 2 and not _numbered(groups) and not all(g.lower() in csv_labels.SPLIT_ROLES for g in groups):
            return None
    rows = csv_labels.read(table, root, images_under(root)[0]).rows
    fields: dict[str, Any] = {"layout": "csvlabels", "labels_file": table.name}
    if all(r.split for r in rows) and not any(r.split == "val" for r in rows):
        fields["val_from_train"] = VAL_FROM_TRAIN
    return fields


def _numbered(names: list[str]) -> bool:
    """Two or more names that differ only in a trailing number ("kos01", "Class_2")."""
    stems = {re.sub(r"[\s_\-]*\d+$", "", n).lower() if re.search(r"\d$", n) else None for n in names}
    return len(names) >= 2 and len(stems) == 1 and None not in stems


def _val_folder(root: Path) -> str | None:
    return next((name for name in VAL_NAMES if (root / name).is_dir()), None)


def _split_folders(root: Path) -> dict[str, Any]:
    """The split fields of a ROOT/train/ layout: a val folder under any of its names; train/ +
    valid/ only (as many published sets ship): the val folder is the held-out set results are
    quoted on, so it becomes the test split, and val is carved out of train under a name no
    folder has (so the val folder is never read); no val folder: val carved out of train; no
    test folder either: no test split."""
    val = _val_folder(root)
    test = (root / "test").is_dir()
    if val is not None and test:
        return {"val_split": val}
    if val is not None:
        return {"test_split": val, "val_split": CARVED_VAL, "val_from_train": VAL_FROM_TRAIN}
    return {"val_from_train": VAL_FROM_TRAIN, **({} if test else {"test_split": ""})}


def _loose_images(root: Path) -> list[Path]:
    from dtrain.data.masks import IMAGE_EXTENSIONS

    return [p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS]


def describe_layout(fields: dict[str, Any]) -> str:
    """detect_layout's result in words, for the recipe's first line."""
    layout = fields["layout"]
    if layout == "boxclasses":
        how = ("labels from the classes of the photos' boxes (every photo holds one: no good parts, so defect types); "
               "a photo is the class whose boxes cover most of it")
        if fields.get("val_from_train"):
            return f"{how}; {fields['val_from_train']:.0%} of train/ is val"
        if fields.get("val_split", "val") != "val":
            return f"{how}; val in {fields['val_split']}/"
        shares = "/".join(str(round(x * 100)) for x in DataConfig().split_fractions)
        return f"{how}; every class split {shares} % into train/val/test, seeded by data.split_seed"
    if layout == "masklabels":
        how = ("labels from the photos' masks or box files: 'defect' where one marks pixels or a box, 'ok' where it is "
               "empty or missing")
        if fields.get("val_split", "val") == "val" and not fields.get("val_from_train"):
            shares = "/".join(str(round(x * 100)) for x in DataConfig().split_fractions)
            return f"{how}; each of the two split {shares} % into train/val/test, seeded by data.split_seed"
        if fields.get("val_from_train"):
            return f"{how}; {fields['val_from_train']:.0%} of train/ is val"
        return f"{how}; val in {fields['val_split']}/"
    if layout == "csvlabels":
        how = f"labels from the table {fields['labels_file']}"
        if fields.get("val_from_train"):
            return f"{how}; its train and test splits, {fields['val_from_train']:.0%} of train is val"
        return f"{how}; its splits, or every class split by data.split_fractions where it names none"
    if layout == "classfolders":
        shares = "/".join(str(round(x * 100)) for x in DataConfig().split_fractions)
        return f"class folders: every class split {shares} % into train/val/test, seeded by data.split_seed"
    if fields.get("val_from_train") and fields.get("test_split", "test") != "test":
        return (f"imagefolder with train/ and {fields['test_split']}/ only: {fields['test_split']}/ is the test split, "
                f"and {fields['val_from_train']:.0%} of every train class is val")
    if fields.get("val_from_train"):
        return f"imagefolder without a val folder: {fields['val_from_train']:.0%} of every train class is val"
    if fields.get("val_split", "val") != "val":
        return f"imagefolder, val in {fields['val_split']}/"
    return f"{layout} layout"


def gather(cfg: DataConfig, sample: int = SAMPLE, colour_sample: int = COLOUR_SAMPLE) -> DataStats:
    from dtrain.data.layouts import scan

    if "://" in cfg.root or cfg.layout == "shards":
        raise DtrainError("the recipe reads a local folder of images", "pass --data a local ImageFolder or MVTec directory")
    train = scan(cfg, cfg.train_split)
    val = scan(cfg, cfg.val_split) if cfg.val_split else None
    test = _test_split(cfg)
    if not train.paths:
        raise DtrainError(f"no training images under {cfg.root}", "put each class's images in ROOT/train/<class>/")
    sides, aspects, colour, deep, refused = [], [], [], [], {}
    grey = 0
    for path in _evenly(train.paths, sample):
        try:
            header = _header(path)
        except ImageRefused as exc:
            refused[path] = exc.message
            continue
        sides.append(min(header.width, header.height))
        aspects.append(max(header.width, header.height) / max(min(header.width, header.height), 1))
        if header.mode in GREY_MODES:
            grey += 1
        else:
            colour.append(path)
        if header.bytes_per_sample == 2:
            deep.append(path)
    if not sides:
        raise DtrainError(f"none of the {len(refused)} sampled training images can be read, e.g. {next(iter(refused))}: "
                          f"{next(iter(refused.values()))}", "check the files under ROOT/train/")
    checked = _evenly(colour, colour_sample)
    grey_stored_as_colour = sum(_is_grey(p) for p in checked)
    if checked:
        grey += len(colour) * grey_stored_as_colour / len(checked)
    return DataStats(
        classes=train.classes,
        negative_class=None if train.negative_index is None else train.classes[train.negative_index],
        train_counts=_counts(train),
        val_counts=_counts(val) if val else {},
        short_sides=sides,
        aspect_ratios=aspects,
        grey_share=grey / len(sides),
        refused=refused,
        left_out={k: v for listing in (train, val, test) if listing for k, v in listing.left_out.items()},
        deep_bits=[b for b in map(_significant_bits, _evenly(deep, DEEP_SAMPLE)) if b is not None],
        **_masked_defects(train),
        labelled_by={rule: sum(listing.labelled_by[rule] for listing in (train, val, test) if listing)
                     for rule in train.labelled_by},
        copies=identical(File(path, split, listing.classes[target])
                         for split, listing in ((cfg.train_split, train), (cfg.val_split, val), (cfg.test_split, test))
                         if listing for path, target in zip(listing.paths, listing.targets)),
    )


def _masked_defects(listing) -> dict[str, int]:
    """DataStats' masked_defects and boxed_defects of the training split."""
    from dtrain.data.boxes import is_box_file
    from dtrain.data.mask_targets import mask_files

    masks = [mask for mask, target in zip(mask_files(listing.paths), listing.targets)
             if mask is not None and target != listing.negative_index]
    return {"masked_defects": len(masks), "boxed_defects": sum(map(is_box_file, masks))}


def _counts(listing) -> dict[str, int]:
    found = Counter(listing.targets)
    return {name: found.get(i, 0) for i, name in enumerate(listing.classes)}


def _evenly(items: list[str], n: int) -> list[str]:
    """n items evenly spaced over the list (all of them when there are no more than n)."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def _header(path: str) -> Header:
    """The header of one file, refused as the decoder would refuse it (too large, several frames...)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ImageRefused(f"cannot read the file: {exc.strerror}") from None
    header = read_header(data)
    check(header, DEFAULT_MAX_PIXELS, DEFAULT_MAX_DECODE_BYTES)
    return header


def _significant_bits(path: str) -> int | None:
    """Bits the largest sample of a 16-bit image needs: 12 for a 12-bit camera's values
    stored as they come (0..4095), 16 when they fill the range. None if unreadable."""
    import numpy as np
    from PIL import Image

    try:
        with open(path, "rb") as f:
            data = f.read()
        if data.startswith(b"\x89PNG"):  # Pillow reads 16-bit colour PNG as 8 bits: torchvision keeps 16
            from torchvision.io import ImageReadMode, decode_png

            img = decode_png(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.UNCHANGED)
            top = int(img.to(torch.int32).max())  # torch has no max over uint16
        else:
            with Image.open(path) as img:
                if not img.mode.startswith("I;16"):  # a 16-bit colour TIFF: Pillow gives only its high bytes,
                    return None  # which say nothing of the low ones (and the decoder keeps those high bytes)
                top = int(np.asarray(img).max())
    except (OSError, RuntimeError, ValueError):  # the training loader names unreadable files; here no evidence
        return None
    return top.bit_length()


def _is_grey(path: str) -> bool:
    """A colour-mode image whose channels never differ by more than GREY_TOLERANCE (every 4th pixel)."""
    try:
        with open(path, "rb") as f:
            img = decode(f.read())
    except (OSError, ImageRefused):
        return False  # the training loader will skip and name it; here it is no evidence of grey
    px = img[:, ::4, ::4].to(torch.int16)
    return bool((px.max(dim=0).values - px.min(dim=0).values).max() <= GREY_TOLERANCE)
