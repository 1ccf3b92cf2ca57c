"""The images under a class folder, as published defect sets ship them: sub-folders read,
ground-truth masks and archive debris left out.

torchvision's ImageFolder reads a class folder with every sub-folder in it, and public sets
rely on that: the magnetic-tile set keeps its photos in `MT_Blowhole/Imgs/`. The same sets
put each photo's pixel mask beside it (`exp1_num_4727.png` next to `exp1_num_4727.jpg`;
KolektorSDD2's `10000_GT.png`; a `masks/` or `ground_truth/` sub-folder elsewhere). Read as
pictures of their class, masks are pictures of the answer: the network learns "a white
blob on black is a blowhole", and the test split's accuracy is inflated by the same files.

A file is a mask when its name pairs it with another image in the same folder (the same
stem under another extension, or that stem plus a suffix of MASK_SUFFIXES) and its pixels
take at most MASK_LEVELS values: a photo has hundreds of grey levels, a mask one per label.
Only paired files are opened, so a folder of photos costs one directory walk, and the
magnetic tiles one small PNG each. A JPEG's values say little (compression rings a mask's
edges into many values), so a lossy file counts only when a mask suffix names it and
nearly all its pixels are black or white (BINARY_SHARE): a binary mask saved as JPEG. Sub-folders named as ground truth (MASK_DIRS) are not
entered. Hidden files and folders, and macOS archive debris (`__MACOSX/`, `._name.jpg`
resource forks, which carry an image's extension but no image), are not images.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
MASK_SUFFIXES = ("_mask", "-mask", "_gt", "-gt", "_label", "_labels", "_seg", "_segmentation", "_anno")
MASK_DIRS = frozenset({"mask", "masks", "gt", "ground_truth", "groundtruth", "ground-truth", "label", "labels",
                       "annotation", "annotations", "segmentation", "segmentations"})
# A binary mask has 2 values, a multi-label one a few more; a photo, even of a plain
# surface, has far more than 8 once sensor noise is in it.
MASK_LEVELS = 8
# Folders that hold the photos beside their annotations: a split's class folders may sit in
# one (NEU-DET: train/images/<class>/), a segmentation set's photos beside masks/.
CONTAINER_NAMES = frozenset({"images", "imgs", "img", "image", "jpegimages"})
# A candidate larger than the decoder's own pixel limit is not counted, only listed as an
# image (the decoder then refuses it with its reason).
MAX_MASK_PIXELS = 40_000_000
ARCHIVE_DEBRIS = frozenset({"__MACOSX"})
# A file in each folder dtrain writes outputs to (mark_output): such a folder is no photos'.
OUTPUT_MARK = ".dtrain-output"
# Not counted by their values: the photo of a pair is usually one of these, and the count
# of values of a lossy file says nothing (its mask would have many).
LOSSY = frozenset({".jpg", ".jpeg", ".webp"})
# A lossy file named as a mask (MASK_SUFFIXES) is one when at least this share of its
# pixels is within DARK_OR_LIGHT of black or white: JPEG ringing at a binary mask's edges
# stays near them, where a photo, even of a plain surface, sits in between.
BINARY_SHARE = 0.98
DARK_OR_LIGHT = 32


def mark_output(folder: Path) -> None:
    """Mark `folder` as one dtrain writes a run's outputs to (OUTPUT_MARK), so that a scan
    of photos never reads it (not_photos). Best effort: an unwritable folder fails later, where
    the outputs are written, with its own message."""
    try:
        (folder / OUTPUT_MARK).write_text("dtrain writes its outputs here (plots, checkpoints, reports): "
                                          "a scan for photos leaves this folder out\n")
    except OSError:
        pass


def not_photos(folder: Path) -> bool:
    """A folder whose files are never a part's photos: hidden or debris by name, or one of
    dtrain's own output folders (`cd photos && dtrain quickstart --data .` puts runs/ beside
    the class folders; its plots would be a class of their own on the next run)."""
    return hidden_or_debris(folder.name) or (folder / OUTPUT_MARK).is_file()


def hidden_or_debris(name: str) -> bool:
    """A file or folder name that is never a photo or a folder of photos: hidden (`.x`,
    `.ipynb_checkpoints`, `._x.jpg` resource forks) or an archive's debris (`__MACOSX`)."""
    return name.startswith(".") or name in ARCHIVE_DEBRIS


def images_under(folder: Path) -> tuple[list[Path], dict[str, str]]:
    """Every image under `folder` and its sub-folders, sorted, and what was left out:
    {path: why} for masks (files) and ground-truth sub-folders."""
    images, left_out, _ = _scan(folder)
    return images, left_out


def walk(folder: Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk, top-down, with linked folders followed (a class folder of links is a common
    way to pick a subset without copying) and a folder met again through a link (a loop) left
    out, as are hidden folders, archive debris and dtrain's output folders below `folder`
    (not_photos; `folder` itself is read as asked); the sub-folders come sorted. A caller may
    prune `dirs` further in place, as with os.walk."""
    seen = {os.path.realpath(folder)}
    for here, dirs, names in os.walk(folder, followlinks=True):
        kept = []
        for d in sorted(dirs):
            real = os.path.realpath(os.path.join(here, d))
            if not not_photos(Path(here, d)) and real not in seen:
                seen.add(real)
                kept.append(d)
        dirs[:] = kept
        yield here, dirs, names


def masks_of_images(folder: Path) -> tuple[list[Path], dict[str, Path], dict[str, str]]:
    """images_under's images and left-out files, and {image: its mask} for the images that
    have one: a mask beside it (as images_under finds them), or a file of a ground-truth
    sub-folder of the image's folder named as it, with or without a mask suffix (DAGM's
    `Label/0576_label.PNG` for `0576.PNG`)."""
    return _scan(folder)


def _scan(folder: Path) -> tuple[list[Path], dict[str, str], dict[str, Path]]:
    images: list[Path] = []
    left_out: dict[str, str] = {}
    pairs: dict[str, Path] = {}
    for here, dirs, names in walk(folder):
        kept, truth = [], []
        for d in dirs:
            if d.lower() in MASK_DIRS:
                # A folder's key ends in a separator, so a reader tells it from a file without a stat.
                left_out[os.path.join(here, d, "")] = f"a sub-folder named '{d}': ground truth, not photos"
                truth.append(Path(here, d))
                continue
            kept.append(d)
        dirs[:] = kept  # os.walk descends only into what stays in the list
        found = _image_files(Path(here), names)
        masks = _masks_among(found)
        left_out.update((m, why) for m, (_, why) in masks.items())
        photos = [p for p in found if str(p) not in masks]
        images.extend(photos)
        pairs.update((str(photo), Path(m)) for m, (photo, _) in masks.items())
        if Path(here).name.lower() in CONTAINER_NAMES and Path(here) != Path(folder):
            # a segmentation set's images/ beside masks/: the truth folders are its siblings
            parent = Path(here).parent
            truth += [parent / d for d in sorted(os.listdir(parent))
                      if d.lower() in MASK_DIRS and (parent / d).is_dir()]
        _pair_in_truth_folders(photos, truth, pairs)
    return sorted(images), left_out, pairs


def _image_files(folder: Path, names: list[str]) -> list[Path]:
    return [p for p in (folder / n for n in names)
            if not hidden_or_debris(p.name) and p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()]


def _pair_in_truth_folders(photos: list[Path], truth: list[Path], pairs: dict[str, Path]) -> None:
    """Adds to `pairs` the masks that ground-truth sub-folders (`truth`) hold for `photos`,
    matched by name: the photo's stem, or it plus a mask suffix."""
    if not truth or not photos:
        return
    by_stem = {p.stem.lower(): p for p in photos}
    for folder in truth:
        for mask in sorted(_image_files(folder, os.listdir(folder))):
            stem = mask.stem.lower()
            base = next((stem[: -len(s)] for s in MASK_SUFFIXES if stem.endswith(s)), stem)
            photo = by_stem.get(stem) or by_stem.get(base)
            if photo is not None:
                pairs.setdefault(str(photo), mask)


def masks_among(files: list[Path]) -> dict[str, str]:
    """{path: why} for the files of one folder that are ground-truth masks of another file
    there (what the data layer leaves out; `dtrain inspect` skips them too)."""
    return {m: why for m, (_, why) in _masks_among(files).items()}


def _masks_among(files: list[Path]) -> dict[str, tuple[Path, str]]:
    """{path: (the file it is a mask of, why)} for the files of one folder that are masks of
    another file there."""
    stems: dict[str, list[Path]] = {}
    for p in files:
        stems.setdefault(p.stem.lower(), []).append(p)
    out: dict[str, str] = {}
    for p in files:
        if p.suffix.lower() in LOSSY:  # compression blurs a mask's edges into many values: named and binary only
            partner = _suffix_partner(p.stem.lower(), stems)
            share = _black_or_white(str(p), *_identity(p)) if partner is not None else None
            if share is not None and share >= BINARY_SHARE:
                out[str(p)] = (partner, f"a mask of {partner.name}: {share:.1%} of its pixels black or white "
                                        "(a mask saved lossily)")
            continue
        partner = _partner(p, stems)
        if partner is None:
            continue
        levels = _levels(str(p), *_identity(p))
        if levels is not None and levels <= MASK_LEVELS:
            out[str(p)] = (partner, f"a mask of {partner.name}: {levels} pixel value{'s' if levels > 1 else ''}")
    return out


def _partner(p: Path, stems: dict[str, list[Path]]) -> Path | None:
    """The photo `p` is named after, if any: the same stem under another extension, or
    the stem `p` has without a mask suffix."""
    stem = p.stem.lower()
    same = [q for q in stems.get(stem, []) if q != p]
    if same:
        # Of a pair, only the file with few values is a mask; its partner is checked in turn.
        return same[0]
    return _suffix_partner(stem, stems)


def _suffix_partner(stem: str, stems: dict[str, list[Path]]) -> Path | None:
    """The photo a mask suffix names: `x_mask` -> `x.*`."""
    for suffix in MASK_SUFFIXES:
        if stem.endswith(suffix) and stem[: -len(suffix)] in stems:
            return stems[stem[: -len(suffix)]][0]
    return None


def _identity(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=65536)
def _levels(path: str, _mtime_ns: int, _size: int) -> int | None:
    """How many distinct pixel values the file has, up to MASK_LEVELS + 1; None when it
    cannot be read (the decoder refuses it later with its own reason). Keyed by the file's
    time and size: every split and rank scans the folders again."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            if img.width * img.height > MAX_MASK_PIXELS or getattr(img, "is_animated", False):  # not n_frames: it walks every page
                return None
            if img.mode.startswith("I;16"):  # Pillow's getcolors refuses 16-bit grey
                import numpy as np

                return min(len(np.unique(np.asarray(img))), MASK_LEVELS + 1)
            colours = img.getcolors(MASK_LEVELS)  # None when there are more than MASK_LEVELS
    except Exception:  # noqa: BLE001 - any unreadable file is simply not a mask
        return None
    return MASK_LEVELS + 1 if colours is None else len(colours)


@functools.lru_cache(maxsize=65536)
def _black_or_white(path: str, _mtime_ns: int, _size: int) -> float | None:
    """The share of the file's pixels (as grey) within DARK_OR_LIGHT of 0 or 255; None when
    it cannot be read. Keyed as _levels."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            if img.width * img.height > MAX_MASK_PIXELS or getattr(img, "is_animated", False):  # not n_frames: it walks every page
                return None
            hist = img.convert("L").histogram()
    except Exception:  # noqa: BLE001 - any unreadable file is simply not a mask
        return None
    total = sum(hist)
    return (sum(hist[:DARK_OR_LIGHT]) + sum(hist[256 - DARK_OR_LIGHT:])) / total if total else None


# A lossy mask marks a pixel from half of full scale on: JPEG ringing around a binary mask's
# edges, and the noise of an all-black one, stay well under it. A lossless mask marks any
# pixel above 0, so label images that store classes as 1, 2, ... count too.
LOSSY_MARK = 128


def mark_floor(path: str | Path) -> int:
    """The smallest value that marks a pixel in this mask file (LOSSY_MARK in a lossy one)."""
    return LOSSY_MARK if Path(path).suffix.lower() in LOSSY else 1


def marks_pixels(mask: Path) -> bool | None:
    """Whether `mask` marks any pixel (a defect drawn on it); None when it cannot be read."""
    return _marks(str(mask), *_identity(mask))


@functools.lru_cache(maxsize=65536)
def _marks(path: str, _mtime_ns: int, _size: int) -> bool | None:
    from PIL import Image

    floor = mark_floor(path)
    try:
        with Image.open(path) as img:
            if img.width * img.height > MAX_MASK_PIXELS:
                return None
            if img.mode.startswith("I"):  # 16/32-bit grey: Pillow's 8-bit conversion would clip it
                import numpy as np

                return bool(np.asarray(img).max() >= floor)
            return img.convert("L").getextrema()[1] >= floor
    except Exception:  # noqa: BLE001 - an unreadable mask labels nothing; the caller says so
        return None
