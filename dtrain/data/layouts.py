"""Folder layouts on disk -> the list of (path, label) of one split.

A layout is a function `(cfg, split) -> Listing`, registered by name in `LAYOUTS`.

- `imagefolder`: ROOT/<split>/<class>/*.png (what `dtrain data synth` writes). Without a
  val folder, `data.val_from_train` > 0 carves val out of train, per class, seeded.
- `classfolders`: ROOT/<class>/* with no split folders (torchvision's ImageFolder, and how
  a plant's labelled photos usually arrive): every class is cut into
  `data.split_fractions` (train, val, test) of a seeded shuffle.
- `mvtec` (MVTec-AD): ROOT/<category>/train/good/*, ROOT/<category>/test/<defect>/*.
  MVTec has no validation split, so one is carved out of `test`: per class, the sorted
  file list is shuffled with a seed derived from (`data.split_seed`, class name) and the
  first `data.mvtec_val_fraction` goes to val, the rest stays in test. A supervised
  classifier never sees a defect in MVTec's own `train`; `data.mvtec_train_fraction`
  (default 0: the official protocol) moves that share of every test class into train,
  taken before the val carve so the three splits never overlap.
- `masklabels`: the photos' own ground-truth masks are their labels, as sets published for
  segmentation ship them (KolektorSDD2: ROOT/{train,test}/10000.png beside 10000_GT.png;
  KolektorSDD: ROOT/kos01/Part0.jpg beside Part0_label.bmp), or their box files, as
  detection sets do (YOLO exports: ROOT/train/images/x.jpg beside ROOT/train/labels/x.txt,
  or ROOT/images/train/ beside ROOT/labels/train/; VOC XML likewise, dtrain.data.boxes). A
  photo is `defect` when its mask marks any pixel or its box file a box, and `ok` when the
  file is empty or there is none (nothing drawn on the part: MVTec ships no masks for its
  good parts, YOLO no label file for a background photo). The box's class is not kept: the
  two classes are what a miss rate is measured on. With split folders, train/ holds val
  unless a val folder does (`data.val_from_train`); without them, every class is cut by
  `data.split_fractions`.
- `boxclasses`: a detection set whose every photo holds a box has no good part: each photo
  is the class of the boxes that cover most of it (a classifier of defect types), split as
  masklabels.

Every carve is per class, from the class's sorted file list shuffled with a seed of
(`data.split_seed`, class name): the same split in every process, run and machine, and a
rare class keeps images in each split.

A class folder's images are those in it and in its sub-folders (as torchvision's
ImageFolder reads one: the magnetic-tile set keeps its photos in `MT_Blowhole/Imgs/`),
less ground-truth masks and archive debris (dtrain.data.masks); `Listing.left_out` says
what was left out and why.

Classes are the sorted union of the class folders of all splits, so every split of one
data set agrees on the label numbering. An empty split name (`val_split: ""`) means the
data set has no such split: it adds no classes (MVTec still carves its share out of test, unlisted, so the
test split does not change with it). "ok", "good" and "normal" are synonyms for the
negative class: the config default "ok" works on MVTec's "good" without an override, then on one class whose name
reads as defect-free ("MT_Free", "ok_front", "no_defect": `says_defect_free`), and on data with none of them
(defect types only) it means "no negative class" (`negative_index` None: a classification task).
"""

from __future__ import annotations

import functools
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.data import boxes
from dtrain.data.config import DataConfig
from dtrain.data.masks import (
    CONTAINER_NAMES, IMAGE_EXTENSIONS, images_under, marks_pixels, masks_of_images, not_photos,
)
from dtrain.data.truth_trees import BoxTrees
from dtrain.errors import DtrainError
from dtrain.printable import printable, unsafe

NEGATIVE_SYNONYMS = ("ok", "good", "normal")
DETECTION_LABELS = frozenset({"labels", "label", "annotations", "annotation", "masks", "ground_truth", "xml", "json"})
# How else a defect-free class is named in public and plant data sets ("MT_Free" for
# magnetic tiles, "ok_front" for cast impellers, "Negative" beside "Positive" for cracked
# concrete, "no_defect", "Defect-free"): a word of the
# name, or the whole name with its separators dropped. A name that also carries a word
# of rejection ("not_ok", "ok_bad") is not one.
NEGATIVE_WORDS = frozenset({"ok", "good", "normal", "free", "pass", "passed", "clean", "flawless", "intact", "negative"})
NEGATIVE_PHRASES = frozenset({"nodefect", "nodefects", "defectfree", "nondefective", "nondefect", "withoutdefect",
                              "withoutdefects"})
REJECTION_WORDS = frozenset({"not", "nok", "ng", "bad", "fail", "failed", "reject", "rejected", "defect", "defects",
                             "defective", "def", "anomaly", "anomalous", "positive"})


@dataclass(frozen=True)
class Listing:
    classes: list[str]
    negative_index: int | None  # None: no defect-free class, a classification task
    paths: list[str]
    targets: list[int]
    left_out: dict[str, str] = field(default_factory=dict)  # masks and ground-truth folders: path -> why
    # masklabels only: how many photos were labelled by each rule (MASK_RULES)
    labelled_by: dict[str, int] = field(default_factory=dict)


def scan(cfg: DataConfig, split: str) -> Listing:
    try:
        layout = LAYOUTS[cfg.layout]
    except KeyError:
        raise DtrainError(
            f"unknown data layout '{cfg.layout}'", f"valid layouts: {', '.join(sorted(LAYOUTS))}"
        ) from None
    return layout(cfg, split)


class SplitMissing(DtrainError):
    """The layout has no folder for this split: a caller listing every split it might hold
    skips this one, where any other error stops it."""


def _require_dir(path: Path, what: str, hint: str | None = None) -> None:
    if not path.is_dir():
        raise DtrainError(
            f"{what} not found: {path} is missing",
            hint or f"create a synthetic data set with `dtrain data synth {path}` or set data.root to your images",
        )


def _images_in(folder: Path, left_out: dict[str, str]) -> list[Path]:
    """The images of one class folder, sub-folders included (dtrain.data.masks); what is
    not a photo is added to `left_out`."""
    images, skipped = images_under(folder)
    left_out.update(skipped)
    return images


def _class_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not not_photos(p))


def resolve_negative(classes: list[str], negative_class: str | None, where: Path) -> int | None:
    """The index of the defect-free class; None when there is none (see DataConfig.negative_class)."""
    if negative_class is None:
        return None
    if negative_class in classes:
        return classes.index(negative_class)
    if negative_class in NEGATIVE_SYNONYMS:
        for alias in NEGATIVE_SYNONYMS:
            if alias in classes:
                return classes.index(alias)
        named = [c for c in classes if says_defect_free(c)]
        if len(named) > 1:
            raise DtrainError(
                f"several classes in {where} are named like defect-free parts: {', '.join(named)}",
                f"name the one to measure misses against, e.g. --set data.negative_class={named[0]} "
                "(or null for a classification task)",
            )
        return classes.index(named[0]) if named else None
    raise DtrainError(
        f"negative class '{negative_class}' is not one of the classes in {where}: {', '.join(classes)}",
        "set data.negative_class to the class of defect-free parts (e.g. --set data.negative_class=good)",
    )


def says_defect_free(name: str) -> bool:
    """Whether a class name reads as the defect-free class (see NEGATIVE_WORDS)."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    if "".join(words) in NEGATIVE_PHRASES:
        return True
    return bool(NEGATIVE_WORDS.intersection(words)) and not REJECTION_WORDS.intersection(words)


def _listing(classes: list[str], negative: str | None, where: Path, files: dict[str, list[Path]],
             left_out: dict[str, str]) -> Listing:
    for name in classes:
        _require_text(name, where)
    neg = resolve_negative(classes, negative, where)
    paths: list[str] = []
    targets: list[int] = []
    for name in classes:
        for path in files.get(name, []):
            paths.append(str(path))
            targets.append(classes.index(name))
    return Listing(classes, neg, paths, targets, left_out)


def _require_text(name: str, where: Path) -> None:
    """A class name goes into reports, plots, the exported model and the service's JSON
    answers, all of which need text. A folder name that is not UTF-8 (a Windows zip unpacked
    here: cp1252, cp437 or GBK bytes) reaches Python as surrogates, which the run would meet
    only at its end (the report's plots raised after training), and a pushed data set could
    not be read back. So it is refused before anything runs; its photo file names may be
    any bytes. Nor may it hold control characters."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise DtrainError(
            f"the class name {os.fsencode(name)!r} in {where} is not UTF-8 text (a class name goes into the "
            "reports, the exported model and the service's answers)",
            "rename it to UTF-8: names from a zip made on Windows are usually cp1252, cp437 or gbk, e.g. "
            f"`convmv -f cp1252 -t utf8 -r --notest {where}` (or unpack with `unzip -O cp437`)",
        ) from None
    if any(unsafe(ch) for ch in name):
        # A tab, a newline or an escape in a label would act on every terminal, log, CSV row and
        # service answer it is printed in (dtrain/printable.py); a class is named by people.
        raise DtrainError(
            f"the class name '{printable(name)}' in {where} holds control characters (a tab, a newline, a "
            "terminal escape or a direction override), which would act on every terminal and log it is printed in",
            "rename the folder (or the label) to plain text",
        )


def imagefolder(cfg: DataConfig, split: str) -> Listing:
    if cfg.val_from_train > 0:
        return _val_from_train(cfg, split)
    root = Path(cfg.root)
    _require_dir(root, "data directory")
    split_dir = root / split
    if not split_dir.is_dir():
        found = ", ".join(_class_dirs(root)) or "nothing"
        raise SplitMissing(
            f"split '{split}' not found: {split_dir} is missing (found: {found})",
            f"expected ROOT/<split>/<class>/*.png; `dtrain data synth {root}` writes that layout; for "
            "ROOT/<class>/* without split folders set data.layout=classfolders",
        )
    classes: set[str] = set()
    # "" is "no such split"; root / "" would be the root itself, its split folders as classes.
    for name in {cfg.train_split, cfg.val_split, cfg.test_split, split} - {""}:
        if (root / name).is_dir():
            classes.update(_class_dirs(class_root(root / name)))
    if not classes:
        raise DtrainError(f"no class folders in {split_dir}", "put each class's images in ROOT/<split>/<class>/")
    ordered = sorted(classes)
    left_out: dict[str, str] = {}
    split_dir = class_root(split_dir)
    files = {name: _images_in(split_dir / name, left_out) for name in ordered if (split_dir / name).is_dir()}
    return _listing(ordered, cfg.negative_class, root, files, left_out)


def _val_from_train(cfg: DataConfig, split: str) -> Listing:
    """imagefolder with val carved out of the train folder: the data set read as one without
    a val split (so a val folder, if any, is never read, not even for class names), then
    every train class cut by `val_from_train`."""
    plain = cfg.model_copy(update={"val_from_train": 0.0, "val_split": ""})
    if split not in (cfg.train_split, cfg.val_split):
        return imagefolder(plain, split)
    whole = imagefolder(plain, cfg.train_split)
    part = 0 if split == cfg.train_split else 1
    by_class = {name: [Path(p) for p, t in zip(whole.paths, whole.targets) if t == i] for i, name in enumerate(whole.classes)}
    files = _carve_classes(by_class, cfg, _train_val_shares(cfg), part)
    return _listing(whole.classes, cfg.negative_class, Path(cfg.root), files, whole.left_out)


def _carve_classes(files: dict[str, list[Path]], cfg: DataConfig, shares: tuple[float, float, float],
                   role: int) -> dict[str, list[Path]]:
    """Every class's files cut by `shares` (_carve), the `role`-th part (0 train, 1 val, 2 test)."""
    return {name: _carve(paths, cfg.split_seed, name, shares)[role] for name, paths in files.items()}


def _train_val_shares(cfg: DataConfig) -> tuple[float, float, float]:
    """A train folder cut into train and val by data.val_from_train."""
    return 1 - cfg.val_from_train, cfg.val_from_train, 0.0


def _carve(files: list[Path], seed: int, name: str, shares: tuple[float, float, float]) -> tuple[list[Path], ...]:
    """One class's files -> (train, val, test) by `shares` of a seeded shuffle; val and test
    round to the nearest image, train keeps the rest (so a class of 3 still trains)."""
    pool = _shuffled(files, seed, name)
    n_val, n_test = round(len(pool) * shares[1]), round(len(pool) * shares[2])
    if n_val + n_test >= len(pool):  # a tiny class: train first, then val
        n_val, n_test = min(n_val, max(len(pool) - 1, 0)), 0
    n_train = len(pool) - n_val - n_test
    return sorted(pool[:n_train]), sorted(pool[n_train:n_train + n_val]), sorted(pool[n_train + n_val:])


def class_root(folder: Path) -> Path:
    """Where the class folders of a split (or of a classfolders root) are: in it, or in its
    `images/` sub-folder when the set keeps its annotations beside the photos (NEU-DET:
    train/images/<class>/ and train/annotations/*.xml). A flat `images/` next to
    `labels/` or `annotations/` is a detection set (boxes in files), refused. An `images/`
    beside other folders that are neither is a class of that name, like its siblings."""
    subdirs = _subdirs(folder)
    inner = next((d for d in subdirs if d.name.lower() in CONTAINER_NAMES), None)
    if inner is None or any(d != inner and d.name.lower() not in DETECTION_LABELS for d in subdirs):
        return folder
    if any(_subdirs(inner)):
        return inner
    beside = [d.name for d in _subdirs(folder) if d.name.lower() in DETECTION_LABELS]
    if beside and any(p.suffix.lower() in IMAGE_EXTENSIONS for p in inner.iterdir()):
        raise DtrainError(
            f"{folder} holds {inner.name}/ and {beside[0]}/: a detection or segmentation data set (the defects' places "
            "in label files), not one folder of images per class, and none of its photos has a label dtrain reads "
            "(a mask image, Pascal VOC .xml or YOLO .txt named as the photo, or an entry in a COCO .json)",
            "dtrain trains a classifier of whole parts: sort the images into one folder per class "
            f"({folder}/<class>/*), give each photo a mask or box file, or pass --data the folder that holds them",
        )
    return folder


def _subdirs(folder: Path) -> list[Path]:
    return [folder / name for name in _class_dirs(folder)]


def class_folders_with_images(root: Path, left_out: dict[str, str] | None = None) -> dict[str, list[Path]]:
    """ROOT's sub-folders that hold images, in them or below (the classes of a classfolders
    layout) -> their images."""
    skipped: dict[str, str] = {} if left_out is None else left_out
    root = class_root(root)
    found = {name: _images_in(root / name, skipped) for name in _class_dirs(root)}
    return {name: images for name, images in found.items() if images}


def _root_and_role(cfg: DataConfig, split: str) -> tuple[Path, int]:
    """The data folder, and `split`'s place in (train, val, test), for layouts that carve them."""
    root = Path(cfg.root)
    _require_dir(root, "data directory")
    roles = {name: i for i, name in enumerate((cfg.train_split, cfg.val_split, cfg.test_split)) if name}
    if split not in roles:
        raise DtrainError(f"unknown split '{split}' for a {cfg.layout} data set", f"valid splits: {', '.join(roles)}")
    return root, roles[split]


def classfolders(cfg: DataConfig, split: str) -> Listing:
    root, role = _root_and_role(cfg, split)
    left_out: dict[str, str] = {}
    found = class_folders_with_images(root, left_out)
    if not found:
        raise DtrainError(f"no class folders with images in {root}", "put each class's images in ROOT/<class>/")
    files = _carve_classes(found, cfg, cfg.split_fractions, role)
    return _listing(list(found), cfg.negative_class, root, files, left_out)


def _mvtec_base(cfg: DataConfig) -> Path:
    root = Path(cfg.root)
    _require_dir(root, "data directory")
    if cfg.category:
        base = root / cfg.category
        if not base.is_dir():
            raise DtrainError(
                f"MVTec category '{cfg.category}' not found: {base} is missing",
                f"categories in {root}: {', '.join(_mvtec_categories(root)) or 'none'}",
            )
        return base
    if (root / "train").is_dir() and (root / "test").is_dir():
        return root
    raise DtrainError(
        f"{root} holds several MVTec categories; say which one",
        f"set data.category to one of: {', '.join(_mvtec_categories(root)) or '(none found)'}",
    )


def _mvtec_categories(root: Path) -> list[str]:
    return [name for name in _class_dirs(root) if (root / name / "test").is_dir()]


def _shuffled(files: list[Path], seed: int, name: str) -> list[Path]:
    out = list(files)
    # A str seed hashes deterministically (its UTF-8 bytes); the name's own bytes are the same
    # seed, and also take a name that is not UTF-8 as far as _listing, which says so.
    random.Random(os.fsencode(f"{seed}:{name}")).shuffle(out)
    return out


def mvtec(cfg: DataConfig, split: str) -> Listing:
    base = _mvtec_base(cfg)
    roles = {cfg.train_split: "train", cfg.val_split: "val", cfg.test_split: "test"}
    if split not in roles:
        raise DtrainError(
            f"unknown split '{split}' for an MVTec data set",
            f"valid splits: {', '.join(roles)}",
        )
    role = roles[split]
    for sub in ("train", "test"):
        _require_dir(base / sub, f"MVTec folder '{sub}'", "expected <category>/train/good/* and <category>/test/<defect>/*")
    classes = sorted(set(_class_dirs(base / "train")) | set(_class_dirs(base / "test")))
    files: dict[str, list[Path]] = {}
    left_out: dict[str, str] = {}
    for name in classes:
        official_train = _images_in(base / "train" / name, left_out) if (base / "train" / name).is_dir() else []
        pool = _images_in(base / "test" / name, left_out) if (base / "test" / name).is_dir() else []
        pool = _shuffled(pool, cfg.split_seed, name)
        n_train = int(len(pool) * cfg.mvtec_train_fraction)
        rest = pool[n_train:]
        # Carved whether or not val is read: a k-fold final model trained on it, and `dtrain eval`
        # then reads this data set without val (evaluation.evaluate), so its test split stays the same.
        n_val = int(round(len(rest) * cfg.mvtec_val_fraction))
        chosen = {"train": official_train + pool[:n_train], "val": rest[:n_val], "test": rest[n_val:]}[role]
        files[name] = sorted(chosen)
    return _listing(classes, cfg.negative_class, base, files, left_out)


# masklabels' two classes, and the rules that put a photo in one (Listing.labelled_by's keys).
MASK_DEFECT, MASK_OK = "defect", "ok"
MASK_RULES = ("its mask marks pixels", "its mask is empty", "it has no mask", "its box file marks a defect",
              "its box file is empty")
BOX_RULES = MASK_RULES[3:]
# How Listing.left_out's reasons begin for photos (not masks) a layout leaves out: the recipe's
# notes count each kind apart from the ground truth.
UNREADABLE_MASK, UNLISTED = "its mask cannot be read", "not listed in"
NO_TYPE = "no defect type"  # boxclasses: a photo whose boxes name none
# A dataset YAML is a few hundred bytes; a larger one beside the photos is something else.
NAMES_MAX_BYTES = 1 << 20


def split_root(root: Path) -> Path:
    """Where a data set's split folders are: in `root`, or in its photo folder when the set
    keeps its splits there beside a labels tree (YOLO / Ultralytics: ROOT/images/train/ with
    ROOT/labels/train/). Read as class folders, that layout would be classes named train
    and val."""
    if (root / "train").is_dir() or not root.is_dir():
        return root
    subdirs = [d for d in root.iterdir() if d.is_dir() and not not_photos(d)]
    photos = [d for d in subdirs if d.name.lower() in CONTAINER_NAMES and (d / "train").is_dir()]
    if len(photos) == 1 and any(d.name.lower() in DETECTION_LABELS for d in subdirs):
        return photos[0]
    return root


Labeller = Callable[[Path], tuple[dict[str, list[Path]], dict[str, str], dict[str, str]]]


def _labelled_split(cfg: DataConfig, split: str, label: Labeller) -> tuple[dict[str, list[Path]], dict[str, str],
                                                                            dict[str, str], Path, int]:
    """masklabels' and boxclasses' splits: `label(folder)` -> ({class: photos}, left out, {photo:
    rule}) of every photo under a folder; split folders (under images/ too, split_root), val
    carved out of train, or every class cut by data.split_fractions. -> (files, left_out,
    rules, the folder of the splits, the split's role)."""
    root, role = _root_and_role(cfg, split)
    root = split_root(root)
    if not (root / cfg.train_split).is_dir():  # one folder of photos: every class cut by split_fractions
        whole, left_out, rules = label(root)
        files = _carve_classes(whole, cfg, cfg.split_fractions, role)
    elif role < 2 and cfg.val_from_train > 0:  # val carved out of train, as imagefolder's
        whole, left_out, rules = label(root / cfg.train_split)
        files = _carve_classes(whole, cfg, _train_val_shares(cfg), role)
    else:
        if not (root / split).is_dir():
            raise SplitMissing(f"split '{split}' not found: {root / split} is missing",
                               "expected ROOT/<split>/ with the photos and their labels")
        files, left_out, rules = label(root / split)
    return files, left_out, rules, root, role


def masklabels(cfg: DataConfig, split: str) -> Listing:
    files, left_out, rules, root, role = _labelled_split(cfg, split, _by_masks)
    if role == 0:
        _both_classes(files, rules, root)
    listing = _listing([MASK_DEFECT, MASK_OK], cfg.negative_class, root, files, left_out)
    counts = {rule: 0 for rule in MASK_RULES}
    for path in listing.paths:
        counts[rules[path]] += 1
    return Listing(listing.classes, listing.negative_index, listing.paths, listing.targets, left_out, counts)


def _both_classes(files: dict[str, list[Path]], rules: dict[str, str], root: Path) -> None:
    """Refuses a training split whose masks or boxes leave one of the two classes empty: a
    detection set whose every photo holds a defect (NEU-DET, GC10-DET) has no good part to
    tell a defect from, and a classifier trained on one class learns nothing."""
    empty = [c for c, photos in files.items() if not photos]
    if not empty or not any(files.values()):
        return
    boxed = any(rule in BOX_RULES for rule in rules.values())
    source = "box file" if boxed else "mask"
    if empty == [MASK_OK]:
        raise DtrainError(
            f"every training photo in {root} has a {source} that marks a defect: no good part to tell defects from",
            "add photos of good parts (with an empty label file, or none), or sort the photos into one folder per "
            "defect type to train a classifier of types",
        )
    raise DtrainError(f"no training photo in {root} has a {source} that marks a defect: nothing to learn a defect from",
                      "check that the masks or label files belong to these photos (same names), or sort the photos "
                      "into class folders")


def boxclasses(cfg: DataConfig, split: str) -> Listing:
    """Photos labelled by the class of their boxes: a detection set without good parts
    (NEU-DET or GC10-DET exported as YOLO, COCO, VOC or LabelMe) as a classifier of defect
    types. A photo is the class whose shapes cover most of it (boxes.Shapes.main_label);
    YOLO's class numbers are named by the set's names file (yolo_names). Classes are those
    of every split, so all splits number them alike."""
    root = split_root(Path(cfg.root))
    label = functools.partial(_by_box_class, names=yolo_names(root))
    files, left_out, _, _, role = _labelled_split(cfg, split, label)
    classes = sorted(label(root)[0]) if (root / cfg.train_split).is_dir() else sorted(files)
    kinds = [c for c in classes if files.get(c)]
    if role == 0 and len(kinds) < 2:
        raise DtrainError(
            f"every training photo in {root} holds a box, and all of one class ({', '.join(kinds) or 'none'}): no good "
            "part to tell a defect from, and no second defect type",
            "add photos of good parts (an empty label file, or none) to train defect against ok, or name the defect "
            "types (YOLO: a data.yaml with `names` and a class number per type; VOC, COCO, LabelMe: each box's name)",
        )
    return _listing(classes, cfg.negative_class, root, files, left_out)


def every_photo_boxed(folder: Path) -> bool:
    """Whether every photo under `folder` is labelled by a box file that marks a defect: a
    detection set without good parts, read by its boxes' classes (boxclasses) rather than
    as defect/ok (masklabels, which would refuse it)."""
    files, _, rules = _by_masks(folder)
    return bool(files[MASK_DEFECT]) and not files[MASK_OK] and all(r == BOX_RULES[0] for r in rules.values())


def _by_box_class(folder: Path, names: dict[str, str]) -> tuple[dict[str, list[Path]], dict[str, str], dict[str, str]]:
    """{class: photos} of every photo under `folder` by its boxes' main label, and what was left
    out: a photo without a box (no type to learn) or whose boxes name no class."""
    images, left_out, _ = masks_of_images(folder)
    boxed = BoxTrees()
    beside: dict[Path, dict[str, str]] = {}  # LabelImg's classes.txt per folder of box files, read once
    files: dict[str, list[Path]] = {}
    for photo in images:
        found = boxed.mask_of(photo)
        try:
            main = boxes.read_shapes(found).main_label() if found is not None else None
        except ValueError:  # changed since it was found: as an unreadable mask
            left_out[str(photo)] = f"{UNREADABLE_MASK} ({Path(str(found)).name}), so its label is unknown"
            continue
        if not main:
            left_out[str(photo)] = f"{NO_TYPE}: {'its label file marks no defect' if found else 'it has no label file'}"
            continue
        named = names or _classes_txt(Path(str(found)).parent, beside)
        files.setdefault(named.get(main, main), []).append(photo)
    return files, left_out, {}


def yolo_names(root: Path) -> dict[str, str]:
    """YOLO class numbers -> names from a dataset YAML's `names` in `root` or its parent
    (Roboflow's and Ultralytics' data.yaml: a list, or a mapping of numbers); {} when there
    is none (then LabelImg's classes.txt beside the box files, else the numbers are the names)."""
    for folder in (root, root.parent):
        for path in sorted(folder.glob("*.y*ml")):
            found = _yaml_names(path)
            if found:
                return found
    return {}


def _classes_txt(folder: Path, seen: dict[Path, dict[str, str]]) -> dict[str, str]:
    """LabelImg's `classes.txt` (one name per line, in class-number order) in a folder of YOLO
    files; {} without one. Looked up where the box files are, not by a walk of the whole set."""
    if folder not in seen:
        try:
            with open(folder / "classes.txt", "rb") as f:  # a names file is small: what is past the cap is not read
                text = f.read(NAMES_MAX_BYTES).decode("utf-8", errors="replace")
            lines = [line.strip() for line in text.splitlines()[:10_000]]
        except OSError:
            lines = []
        seen[folder] = {str(i): name for i, name in enumerate(lines) if name}
    return seen[folder]


def _yaml_names(path: Path) -> dict[str, str]:
    import yaml

    try:
        if path.stat().st_size > NAMES_MAX_BYTES:
            return {}
        doc = yaml.safe_load(path.read_bytes().decode("utf-8", errors="replace"))  # UTF-8 whatever the locale
    except (OSError, yaml.YAMLError, RecursionError):  # PyYAML recurses per level: "[[[...]]]" 1000 deep
        return {}
    names = doc.get("names") if isinstance(doc, dict) else None
    pairs = list(enumerate(names)) if isinstance(names, list) else list(names.items()) if isinstance(names, dict) else []
    # Names are words: a nested value (YAML aliases can nest a list a billion items deep in a
    # few lines) is no names list, and is never turned into a string.
    if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for _, v in pairs):
        return {}
    return {str(k): str(v) for k, v in pairs}


def _by_masks(folder: Path) -> tuple[dict[str, list[Path]], dict[str, str], dict[str, str]]:
    """{class: photos} of every photo under `folder` by its mask, what was left out (a photo
    whose mask cannot be read is, with that reason), and {photo: the rule (MASK_RULES) that
    labelled it}."""
    images, left_out, masks = masks_of_images(folder)
    boxed = BoxTrees()
    files: dict[str, list[Path]] = {MASK_DEFECT: [], MASK_OK: []}
    rules: dict[str, str] = {}
    for photo in images:
        mask = masks.get(str(photo))
        if mask is not None:
            marked = marks_pixels(mask)
            rule = MASK_RULES[0] if marked else MASK_RULES[1]
        elif (found := boxed.mask_of(photo)) is not None:  # only box files that parse are found
            mask, marked = Path(found), boxes.marks(found)
            rule = BOX_RULES[0] if marked else BOX_RULES[1]
        else:
            marked, rule = False, MASK_RULES[2]
        if marked is None:
            left_out[str(photo)] = f"{UNREADABLE_MASK} ({mask.name}), so its label is unknown"
            continue
        rules[str(photo)] = rule
        files[MASK_DEFECT if marked else MASK_OK].append(photo)
    return files, left_out, rules


def csvlabels(cfg: DataConfig, split: str) -> Listing:
    from dtrain.data import csv_labels

    root, role = _root_and_role(cfg, split)
    table = Path(cfg.labels_file) if cfg.labels_file else csv_labels.find_table(root)
    if table is not None and not table.is_absolute():
        table = root / table
    if table is None or not table.is_file():
        raise DtrainError(f"no label table for the csvlabels layout in {root}" if table is None else
                          f"label table not found: {table}",
                          "set data.labels_file to the CSV that lists each photo's file and class")
    images, left_out = images_under(root)
    got = csv_labels.read(table, root, images)
    left_out.update((str(p), f"{UNLISTED} {table.name}") for p in got.unlisted)
    classes = sorted({r.label for r in got.rows})
    names = ("train", "val", "test")
    def of_class(label: str, split: str | None = None) -> list[Path]:
        return sorted(r.path for r in got.rows if r.label == label and (split is None or r.split == split))

    if any(r.split is None for r in got.rows):  # no split column or folders: every class cut by split_fractions
        files = _carve_classes({c: of_class(c) for c in classes}, cfg, cfg.split_fractions, role)
    elif role < 2 and cfg.val_from_train > 0:  # splits named train and test only: val out of train
        files = _carve_classes({c: of_class(c, "train") for c in classes}, cfg, _train_val_shares(cfg), role)
    else:
        files = {c: of_class(c, names[role]) for c in classes}
    return _listing(classes, cfg.negative_class, root, files, left_out)


LAYOUTS: dict[str, Callable[[DataConfig, str], Listing]] = {
    "imagefolder": imagefolder,
    "classfolders": classfolders,
    "mvtec": mvtec,
    "masklabels": masklabels,
    "boxclasses": boxclasses,
    "csvlabels": csvlabels,
}
