"""Defect boxes and outlines as masks: Pascal VOC, YOLO, LabelMe and COCO labels of the photos.

Why: many public defect sets mark where each defect lies with boxes, not pixel masks
(NEU-DET: `train/images/<class>/crazing_1.jpg` beside `train/annotations/crazing_1.xml`;
GC10-DET and most sets exported from labelling tools: VOC XML or YOLO text). A box says
where the defect is, which is what the mask head and the transplants need from a mask
(dtrain.data.mask_targets); its corners hold some surface too, which the mask head learns
as "near a defect" and a transplant lifts as a faint change (its background is estimated
from the pixels around the box, so the surface inside mostly cancels).

Read here:
- VOC: `<annotation>` with `<object><bndbox><xmin>..<ymax>` in pixels (1-based, inclusive,
  as the format's tools write them), scaled by the photo's own size when `<size>` says
  another (a set resized after labelling), taken as the photo's own pixels without one;
- YOLO: a line per object, `class cx cy w h` as shares of the photo's side, or
  `class x1 y1 x2 y2 ...` for a polygon (YOLO segmentation exports), filled;
- LabelMe: a JSON file beside the photo, `{"shapes": [{"shape_type", "points"}], "imageWidth",
  "imageHeight"}` in pixels: polygons filled, rectangles as boxes, circles as 24-gons, and
  lines, points and anything else as the box around their points, padded by a pixel (a
  scratch drawn as a line keeps a width);
- COCO: a photo's entry in a COCO JSON file (dtrain.data.coco), its boxes and polygons.

Shapes are drawn on the photo as decoded, upright; one whose stated size shows it was drawn
on a phone photo's stored pixels is turned with them first (dtrain.data.shapes).

A file that is none of these (a `.txt` of notes beside a photo, a damaged XML, a camera's
JSON metadata) is not a box file:
`readable` says so once, and the photo keeps no mask rather than a wrong one. Files are
read through ElementTree, which never fetches external entities; expat (>= 2.4) refuses
entity expansion bombs, and files over MAX_BYTES (JSON_MAX_BYTES for LabelMe's) are not opened.
"""

from __future__ import annotations

import functools
import json
import math
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain.data import coco
from dtrain.data.shapes import Shapes

if TYPE_CHECKING:  # torch only where a mask is drawn: the data layouts label photos by box files without it
    import torch

BOX_EXTENSIONS = (".xml", ".txt", ".json")
# A box file of a thousand objects is ~200 kB: anything larger is not one.
MAX_BYTES = 1 << 20
# LabelMe may embed the photo itself (base64 `imageData`): a 20 MP PNG is ~40 MB of it.
JSON_MAX_BYTES = 64 << 20
# A LabelMe circle is filled as a polygon of this many corners.
CIRCLE_CORNERS = 24
# Pixels by which a box edge may miss a pixel's edge and still be taken as on it.
EDGE_SLACK = 1e-3
# Shares (or pixels) beyond which a shape is no label of the photo: far outside any picture.
MAX_COORDINATE = 1e6


def is_box_file(path: str | Path) -> bool:
    """A VOC, YOLO or LabelMe file by its name, or a photo's entry in a COCO file (dtrain.data.coco)."""
    return coco.is_ref(path) or Path(path).suffix.lower() in BOX_EXTENSIONS


def readable(path: str | Path) -> bool:
    """Whether `path` is a VOC, YOLO or LabelMe file (or COCO entry) that this module reads (an
    empty one is: it marks nothing)."""
    return _shapes(path) is not None


def marks(path: str | Path) -> bool | None:
    """Whether box file `path` marks a defect (one box or polygon at least); None when it is
    not a box file this module reads. The data layouts label a photo by it (masklabels)."""
    shapes = _shapes(path)
    return None if shapes is None else bool(shapes)


def read_shapes(path: str | Path) -> Shapes:
    """The shapes a box file marks. Raises ValueError when it is not a box file this module
    reads."""
    shapes = _shapes(path)
    if shapes is None:
        what = "a COCO file that lists this image" if coco.is_ref(path) else "a Pascal VOC, YOLO or LabelMe label file"
        raise ValueError(f"{Path(str(path)).name} is not {what}")
    return shapes


def as_yolo(shapes: Shapes) -> str:
    """`shapes` as a YOLO text file (class 0): what a k-fold run writes beside a photo's link
    when the photo's boxes live in a COCO file, which cannot be linked per photo. Boxes in
    pixels (a VOC file without a size) cannot be written as shares: the caller links those."""
    lines = [f"0 {(x0 + x1) / 2:.6f} {(y0 + y1) / 2:.6f} {x1 - x0:.6f} {y1 - y0:.6f}" for x0, y0, x1, y1 in shapes.boxes]
    lines += ["0 " + " ".join(f"{x:.6f} {y:.6f}" for x, y in polygon) for polygon in shapes.polygons]
    return "".join(line + "\n" for line in lines)


def _shapes(path: str | Path) -> Shapes | None:
    if coco.is_ref(path):
        entry = coco.entry_of(path)
        return None if entry is None else entry.shapes
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _parse(str(path), st.st_mtime_ns, st.st_size)


def rasterise(shapes: Shapes, height: int, width: int) -> torch.Tensor:
    """uint8 [1, height, width]: 1 on every pixel a shape covers any part of, 0 elsewhere
    (as a mask's marked pixel stays marked when resized: a thin defect is not lost)."""
    import torch
    from PIL import Image, ImageDraw

    canvas = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(canvas)
    for polygon in filter(_drawable, shapes.polygons):
        # shares -> pixel centres: share 0 is the first pixel's left edge
        draw.polygon([(x * width - 0.5, y * height - 0.5) for x, y in polygon], fill=1, outline=1)
    out = torch.frombuffer(bytearray(canvas.tobytes()), dtype=torch.uint8).view(1, height, width)
    pixels = [(x0 * width, y0 * height, x1 * width, y1 * height) for x0, y0, x1, y1 in shapes.boxes]
    for x0, y0, x1, y1 in filter(_drawable, pixels + list(shapes.pixel_boxes)):
        # shares written to 6 decimals (YOLO files) land a hair off a pixel's edge: not a pixel more
        c0, c1 = max(math.floor(x0 + EDGE_SLACK), 0), min(math.ceil(x1 - EDGE_SLACK), width)
        r0, r1 = max(math.floor(y0 + EDGE_SLACK), 0), min(math.ceil(y1 - EDGE_SLACK), height)
        out[:, r0:r1, c0:c1] = 1
    return out


def _drawable(shape: tuple) -> bool:
    """Whether every coordinate is a number a drawing takes: a share of a size stated as a
    hair above zero (1e-300 px) is infinite or past what Pillow's C ints hold; such a shape
    marks nothing rather than stop a loader worker."""
    values = [v for item in shape for v in (item if isinstance(item, tuple) else (item,))]
    return all(math.isfinite(v) and abs(v) < MAX_COORDINATE for v in values)


@functools.lru_cache(maxsize=65536)
def _parse(path: str, _mtime_ns: int, size: int) -> Shapes | None:
    """Keyed by the file's time and size, as dtrain.data.masks caches: every rank and epoch asks again."""
    cap = JSON_MAX_BYTES if path.lower().endswith(".json") else MAX_BYTES
    if size > cap:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return None
    if path.lower().endswith(".xml"):
        return _voc(data)
    if path.lower().endswith(".json"):
        return _labelme(data)
    return _yolo(data)


def _voc(data: bytes) -> Shapes | None:
    try:
        root = ET.fromstring(data)
    except ET.ParseError:  # damaged, or an entity bomb expat refused
        return None
    if root.tag.lower() != "annotation":
        return None
    width, height = _number(root, "size/width"), _number(root, "size/height")
    edges, labels = [], []
    for obj in root.iter("object"):
        labels.append((obj.findtext("name") or "").strip())
        box = obj.find("bndbox")
        corners = None if box is None else [_number(box, k) for k in ("xmin", "ymin", "xmax", "ymax")]
        if corners is None or None in corners:
            return None  # an object without its box: not a file to guess at
        x0, y0, x1, y1 = corners  # type: ignore[misc]
        edges.append((x0 - 1, y0 - 1, x1, y1))  # 1-based inclusive pixels -> the edges they span
    if not (width and height and width >= 1 and height >= 1):
        # Without <size> (or with a zero one, as some converters write; a picture has a pixel at
        # least, and shares of less would overflow) the pixels are the photo's own.
        return Shapes(pixel_boxes=tuple(edges), labels=tuple(labels))
    return Shapes(boxes=tuple((x0 / width, y0 / height, x1 / width, y1 / height) for x0, y0, x1, y1 in edges),
                  labels=tuple(labels), frame=(width, height))


def _number(node: ET.Element, path: str) -> float | None:
    """A finite number, else None: float() reads "inf", "nan" and "1e400", and an infinite
    box edge would stop the drawing of the mask with an OverflowError in a loader worker."""
    found = node.find(path)
    try:
        value = float(found.text) if found is not None and found.text else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _labelme(data: bytes) -> Shapes | None:
    if b'"shapes"' not in data:  # a COCO file of 100 MB beside the photos is not parsed twice
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("shapes"), list):
        return None  # another JSON beside the photo (a camera's metadata, a COCO file): not LabelMe
    width, height = coco.finite(doc.get("imageWidth")), coco.finite(doc.get("imageHeight"))
    if not (width and height and width > 0 and height > 0):
        return None
    found, polygons, box_labels, polygon_labels = [], [], [], []
    for shape in doc["shapes"]:
        points = shape.get("points") if isinstance(shape, dict) else None
        corners = [(coco.finite(p[0]), coco.finite(p[1])) for p in points if isinstance(p, list) and len(p) == 2] \
            if isinstance(points, list) else []
        if not corners or len(corners) != len(points) or any(None in c for c in corners):
            return None  # a shape without readable points: a damaged file, not guessed at
        xs, ys = [x / width for x, _ in corners], [y / height for _, y in corners]  # type: ignore[operator]
        kind = shape.get("shape_type") or "polygon"
        label = str(shape.get("label") or "").strip()
        if kind == "polygon" and len(corners) >= 3:
            polygons.append(tuple(zip(xs, ys)))
            polygon_labels.append(label)
        elif kind == "circle" and len(corners) == 2:
            (cx, cy), (px, py) = corners
            r = math.hypot(px - cx, py - cy)  # type: ignore[operator]
            polygons.append(tuple(((cx + r * math.cos(a)) / width, (cy + r * math.sin(a)) / height)  # type: ignore[operator]
                                  for a in (2 * math.pi * k / CIRCLE_CORNERS for k in range(CIRCLE_CORNERS))))
            polygon_labels.append(label)
        elif kind == "rectangle" and len(corners) == 2:
            found.append((min(xs), min(ys), max(xs), max(ys)))
            box_labels.append(label)
        else:  # line, linestrip, point, a mask's bbox: the box around the points, a pixel wider each way
            found.append((min(xs) - 1 / width, min(ys) - 1 / height, max(xs) + 1 / width, max(ys) + 1 / height))
            box_labels.append(label)
    return Shapes(tuple(found), tuple(polygons), labels=(*box_labels, *polygon_labels), frame=(width, height))


def _yolo(data: bytes) -> Shapes | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    found, polygons, box_labels, polygon_labels = [], [], [], []
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        try:
            number = str(int(fields[0]))  # the class number: data.layouts names it from the set's names file
            values = [float(v) for v in fields[1:]]
        except ValueError:
            return None
        if any(not 0.0 <= v <= 1.0 for v in values):
            return None  # YOLO writes shares of the side; pixels or anything else: not YOLO
        if len(values) == 4:
            cx, cy, w, h = values
            found.append((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2))
            box_labels.append(number)
        elif len(values) >= 6 and len(values) % 2 == 0:
            polygons.append(tuple(zip(values[0::2], values[1::2])))
            polygon_labels.append(number)
        else:
            return None
    return Shapes(tuple(found), tuple(polygons), labels=(*box_labels, *polygon_labels))
