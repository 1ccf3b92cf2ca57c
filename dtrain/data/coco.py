"""Defect boxes and polygons from a COCO JSON file, the format CVAT, Label Studio and
Roboflow export detection and segmentation labels in.

One file lists a split's (or a whole set's) images, `{"id", "file_name", "width", "height"}`,
and their annotations, `{"image_id", "bbox": [x, y, w, h], "segmentation": ...}` in pixels.
Where the exports put it: Roboflow's `train/_annotations.coco.json` beside the photos, CVAT's
`annotations/instances_default.json` beside `images/`, Label Studio's `result.json` beside
`images/`. A photo's ground truth is then not a file of its own, so it is referred to as
`<json path>` + REF_SEP + `<its file_name>` (`ref`): a string like any mask path, which the
data layer pairs with the photo (dtrain/data/truth_trees.py) and dtrain/data/boxes.py
reads as the photo's Shapes. A polygon segmentation is filled as drawn; a run-length one
(`iscrowd`) by its bbox. An image listed with no annotation marks nothing (a good part).

A photo is matched by its file name: COCO's `file_name` may carry the folder the exporter
saw (`images/x.jpg`), so the last path component is compared, case-insensitively; where
one file lists two images of that name, the one whose `file_name` ends the photo's path
is taken, and none when that does not decide. Files over MAX_BYTES are not opened, and a
JSON file that is not COCO (no `images` and `annotations` lists) is no label file.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from dtrain.data.shapes import Shapes

# Between the JSON file's path and the image's file_name in a ref: no file system path
# an exporter writes holds it.
REF_SEP = "#coco:"
# COCO of ~100 000 annotated images is ~100 MB; a label file past this is not read.
MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Entry:
    """One listed image: its `file_name` as written, and what its annotations mark as shares
    of its size, which is the entry's frame (boxes' labels first)."""

    file_name: str
    shapes: Shapes


def is_ref(path: str | Path) -> bool:
    return REF_SEP in str(path)


def ref_parts(ref: str | Path) -> tuple[str, str]:
    """(json path, file_name) of a ref."""
    json_path, _, name = str(ref).rpartition(REF_SEP)
    return json_path, name


def entry_of(ref: str | Path) -> Entry | None:
    """The listed image a ref names; None when its file is gone, unreadable or not COCO, or
    no longer lists it."""
    json_path, name = ref_parts(ref)
    index = read_index(json_path)
    if index is None:
        return None
    return next((e for e in index.get(_key(name), ()) if e.file_name == name), None)


def find(photo: Path, json_path: Path) -> str | None:
    """The ref of `photo` in COCO file `json_path`, or None when the file does not list it
    (or lists two images of its name and its path does not say which)."""
    index = read_index(json_path)
    if index is None:
        return None
    listed = index.get(_key(photo.name), ())
    if len(listed) > 1:
        where = photo.as_posix().lower()
        listed = [e for e in listed if where.endswith("/" + e.file_name.replace("\\", "/").lstrip("./").lower())]
    return f"{json_path}{REF_SEP}{listed[0].file_name}" if len(listed) == 1 else None


def read_index(path: str | Path) -> dict[str, tuple[Entry, ...]] | None:
    """{lower-case file name: its entries} of a COCO file; None when it is not one."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _index(str(path), st.st_mtime_ns, st.st_size)


def _key(file_name: str) -> str:
    return file_name.replace("\\", "/").rsplit("/", 1)[-1].lower()


@functools.lru_cache(maxsize=64)
def _index(path: str, _mtime_ns: int, size: int) -> dict[str, tuple[Entry, ...]] | None:
    """Keyed by the file's time and size: a training run asks once per photo."""
    if size > MAX_BYTES:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        # Other JSON near the photos (logs, LabelMe files, a manifest) is skipped unparsed.
        if b'"annotations"' not in data or b'"images"' not in data:
            return None
        doc = json.loads(data)
    except (OSError, ValueError, RecursionError):  # unreadable, not JSON, or nested past the parser
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list) or not isinstance(doc.get("annotations"), list):
        return None
    images: dict[object, tuple[str, float, float]] = {}
    for image in doc["images"]:
        if not isinstance(image, dict) or not isinstance(image.get("file_name"), str):
            return None
        width, height = finite(image.get("width")), finite(image.get("height"))
        key = _hashable(image.get("id"))
        if key is None or not (width and height and width > 0 and height > 0):
            return None  # shares need the size it was labelled at: every exporter writes it, and an id
        images[key] = (image["file_name"], width, height)
    names = {_hashable(c.get("id")): str(c.get("name")) for c in doc.get("categories") or []
             if isinstance(c, dict) and c.get("name") is not None}
    marks: dict[object, tuple[list, list, list, list]] = {key: ([], [], [], []) for key in images}
    for ann in doc["annotations"]:
        if not isinstance(ann, dict) or _hashable(ann.get("image_id")) not in images:
            return None  # an annotation of no listed image: a damaged or foreign file, not guessed at
        _, width, height = images[_hashable(ann["image_id"])]
        boxes, polygons, box_labels, polygon_labels = marks[_hashable(ann["image_id"])]
        category = _hashable(ann.get("category_id"))
        label = names.get(category, "" if category is None else str(category))
        shapes = _polygons(ann.get("segmentation"), width, height)
        if shapes:
            polygons.extend(shapes)
            polygon_labels.extend([label] * len(shapes))
            continue
        box_labels.append(label)
        box = ann.get("bbox")
        corners = [finite(v) for v in box] if isinstance(box, list) and len(box) == 4 else None
        if corners is None or None in corners:
            return None
        x, y, w, h = corners  # type: ignore[misc]
        boxes.append((x / width, y / height, (x + w) / width, (y + h) / height))
    out: dict[str, list[Entry]] = {}
    for key, (name, width, height) in images.items():
        boxes, polygons, box_labels, polygon_labels = marks[key]
        shapes = Shapes(tuple(boxes), tuple(polygons), labels=(*box_labels, *polygon_labels), frame=(width, height))
        out.setdefault(_key(name), []).append(Entry(name, shapes))
    return {k: tuple(v) for k, v in out.items()}


def _polygons(seg: object, width: float, height: float) -> list[tuple[tuple[float, float], ...]]:
    """A polygon segmentation ([[x1, y1, x2, y2, ...], ...]) as shares; [] for none or RLE."""
    if not isinstance(seg, list):
        return []
    out = []
    for ring in seg:
        values = [finite(v) for v in ring] if isinstance(ring, list) else [None]
        if None in values or len(values) < 6 or len(values) % 2:
            return []  # not a polygon this reads: the bbox stands for it
        out.append(tuple((x / width, y / height) for x, y in zip(values[0::2], values[1::2])))  # type: ignore[operator]
    return out


def finite(v: object) -> float | None:
    """A JSON number as a float; None for anything else (true, a string, NaN, an infinity,
    an integer of more digits than a float holds: json reads those as Python ints, and
    converting one raises OverflowError, which stopped the layout scan)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        value = float(v)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _hashable(v: object) -> object:
    return v if isinstance(v, (int, str)) and not isinstance(v, bool) else None
