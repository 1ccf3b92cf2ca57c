"""What a label file marks on one photo (`Shapes`), read from VOC, YOLO, LabelMe or COCO
(dtrain.data.boxes, dtrain.data.coco), and how it is turned to the photo as it is seen.

A photo is decoded upright: its EXIF orientation applied, as viewers, OpenCV and most
labelling tools apply it (dtrain.data.decode). Not every tool does: LabelImg draws on the
pixels as stored, and writes the stored size into its VOC file. A quarter turn (EXIF 5-8)
swaps a photo's width and height, so a file that states the size it was drawn on (VOC's
`<size>`, LabelMe's `imageWidth`/`imageHeight`, COCO's `width`/`height`) shows which
pixels it meant: lying across where the photo stands upright (or the other way round), it
was drawn on the stored pixels, and its shapes are turned as the pixels are
(`seen_upright`). The proportions are compared, not the exact sizes, since a set may be
resized after labelling. A half turn or a mirror (EXIF 2-4) keeps the proportions, and a
file without a size (YOLO) says nothing: those are taken as drawn upright, as every tool
that applies the orientation draws them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from dtrain.data.decode import QUARTER_TURNS

Box = tuple[float, float, float, float]
Polygon = tuple[tuple[float, float], ...]

# EXIF orientation -> the map of a point (x, y), as shares of the stored picture's width and
# height, to shares of the upright picture: the steps of dtrain.data.decode.upright
# (a transpose for 5 and 7, then quarter turns, then a mirror), composed.
_TO_UPRIGHT: dict[int, Callable[[float, float], tuple[float, float]]] = {
    2: lambda x, y: (1 - x, y),
    3: lambda x, y: (1 - x, 1 - y),
    4: lambda x, y: (x, 1 - y),
    5: lambda x, y: (y, x),
    6: lambda x, y: (1 - y, x),
    7: lambda x, y: (1 - y, 1 - x),
    8: lambda x, y: (y, 1 - x),
}


@dataclass(frozen=True)
class Shapes:
    """What one file marks, in shares of the photo's width and height: boxes as
    (x0, y0, x1, y1), their edges; polygons as their corners. `pixel_boxes`: boxes in the
    photo's own pixels (edges, 0-based), from a VOC file that does not say the size it was
    labelled at."""

    boxes: tuple[Box, ...] = ()
    polygons: tuple[Polygon, ...] = ()
    pixel_boxes: tuple[Box, ...] = ()
    # The class each shape was labelled with, in the order boxes, polygons, pixel_boxes: VOC's
    # and LabelMe's names, COCO's category names, YOLO's class numbers (named by the layout).
    labels: tuple[str, ...] = ()
    # (width, height) of the picture the shapes were drawn on, as the file states it; None
    # where it states none (YOLO, a VOC file without <size>).
    frame: tuple[float, float] | None = None

    def __bool__(self) -> bool:
        return bool(self.boxes or self.polygons or self.pixel_boxes)

    def main_label(self) -> str | None:
        """The label whose shapes cover the most of the photo (a box's area, a polygon's by the
        shoelace formula), the first by name on a tie; None without shapes. What a photo of a
        detection set without good parts is, as a defect type (data.layouts.boxclasses)."""
        areas: dict[str, float] = {}
        sizes = [*map(_box_area, self.boxes), *map(_polygon_area, self.polygons), *map(_box_area, self.pixel_boxes)]
        for label, area in zip(self.labels, sizes):
            areas[label] = areas.get(label, 0.0) + area
        return max(sorted(areas), key=lambda k: areas[k]) if areas else None

    def seen_upright(self, orientation: int, upright_hw: tuple[int, int]) -> Shapes:
        """These shapes on the photo as decoded, `upright_hw` its (height, width) after its EXIF
        `orientation`: turned with the pixels when the file's frame shows it was drawn on them
        as stored (module docstring), else as they are."""
        if not drawn_as_stored(self.frame, orientation, upright_hw):
            return self
        to = _TO_UPRIGHT[orientation]
        boxes = []
        for x0, y0, x1, y1 in self.boxes:
            (ax, ay), (bx, by) = to(x0, y0), to(x1, y1)
            boxes.append((min(ax, bx), min(ay, by), max(ax, bx), max(ay, by)))
        polygons = tuple(tuple(to(x, y) for x, y in polygon) for polygon in self.polygons)
        width, height = self.frame  # type: ignore[misc]
        return replace(self, boxes=tuple(boxes), polygons=polygons, frame=(height, width))


def drawn_as_stored(frame: tuple[float, float] | None, orientation: int, upright_hw: tuple[int, int]) -> bool:
    """Whether a label drawn on a picture of `frame` (width, height) was drawn on the photo's
    stored pixels: it lies across where the upright photo stands, or the other way round,
    under a quarter turn. Square photos and frames, and frames not stated, cannot tell."""
    if orientation not in QUARTER_TURNS or frame is None:
        return False
    width, height = frame
    up_height, up_width = upright_hw
    if width == height or up_width == up_height:
        return False
    return (width > height) != (up_width > up_height)


def _box_area(box: Box) -> float:
    return abs(box[2] - box[0]) * abs(box[3] - box[1])


def _polygon_area(corners: Polygon) -> float:
    xs, ys = [x for x, _ in corners], [y for _, y in corners]
    return abs(sum(xs[i] * ys[i - 1] - xs[i - 1] * ys[i] for i in range(len(corners)))) / 2
