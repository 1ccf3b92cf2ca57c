"""Labels on phone photos stored turned (owner: data). Photos are decoded upright, their EXIF
orientation applied; a label drawn on the stored pixels (LabelImg's VOC files, masks made
with Pillow's plain open) states a frame lying across where the upright photo stands, and
is turned with the pixels; a label drawn upright (CVAT, LabelMe, Roboflow) is kept as it is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dtrain.data import boxes, mask_targets
from dtrain.data.config import DataConfig
from dtrain.data.datasets import open_split
from dtrain.data.decode import upright
from dtrain.data.shapes import Shapes

W, H = 40, 20  # the photo as stored: wider than tall
BLOCK = (3, 9, 10, 20)  # rows 3..8, columns 10..19 of the stored pixels: the defect


def _stored_photo(path: Path, orientation: int) -> np.ndarray:
    pixels = np.random.default_rng(0).integers(40, 110, (H, W), dtype=np.uint8)
    r0, r1, c0, c1 = BLOCK
    pixels[r0:r1, c0:c1] = 250
    exif = Image.Exif()
    exif[0x0112] = orientation
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, exif=exif.tobytes())
    return pixels


def _voc(path: Path, box: tuple[int, int, int, int], size: tuple[int, int]) -> None:
    x0, y0, x1, y1 = box  # 1-based, inclusive
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<annotation><size><width>{size[0]}</width><height>{size[1]}</height></size><object><name>dent"
                    f"</name><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox>"
                    "</object></annotation>")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_shapes_drawn_on_the_stored_pixels_are_turned_exactly_as_the_pixels_are(orientation):
    shapes = Shapes(boxes=((0.1, 0.2, 0.35, 0.6), (0.5, 0.0, 1.0, 0.25)), labels=("a", "b"), frame=(W, H))
    up_hw = (W, H) if orientation in (5, 6, 7, 8) else (H, W)
    turned = shapes.seen_upright(orientation, up_hw)
    if orientation in (5, 6, 7, 8):
        assert turned.frame == (H, W)
        want = upright(boxes.rasterise(shapes, H, W), orientation)
        assert torch.equal(boxes.rasterise(turned, *up_hw), want)
    else:  # a half turn or a mirror keeps the proportions: nothing shows which pixels were meant
        assert turned is shapes


def test_a_frame_that_stands_as_the_photo_stands_or_states_nothing_is_left_as_drawn():
    upright_frame = Shapes(boxes=((0.1, 0.2, 0.3, 0.4),), frame=(H, W))
    assert upright_frame.seen_upright(6, (W, H)) is upright_frame
    unstated = Shapes(boxes=((0.1, 0.2, 0.3, 0.4),))  # YOLO
    assert unstated.seen_upright(6, (W, H)) is unstated
    square = Shapes(boxes=((0.1, 0.2, 0.3, 0.4),), frame=(30, 30))
    assert square.seen_upright(8, (W, H)) is square


@pytest.mark.parametrize("orientation", [6, 8, 5, 7])
@pytest.mark.parametrize("tool", ["labelimg", "cvat", "labelme", "mask_stored", "mask_upright"])
def test_the_mask_channel_marks_the_defect_of_a_turned_photo_whoever_drew_the_label(tmp_path, orientation, tool):
    """NEU-DET's layout; the photo's defect is a bright block. The input is a rectangle, so the
    upright photo (standing) is turned a quarter into it, its mask channel with it."""
    photo = tmp_path / "train" / "images" / "dent" / "a.png"
    stored = _stored_photo(photo, orientation)
    r0, r1, c0, c1 = BLOCK
    mask = np.zeros((H, W), np.uint8)
    mask[r0:r1, c0:c1] = 255
    seen = upright(torch.from_numpy(mask)[None], orientation)[0].numpy()  # as the labeller of an upright photo saw it
    rows, cols = np.nonzero(seen)
    labels = tmp_path / "train" / "annotations"
    if tool == "labelimg":  # the stored pixels and their size
        _voc(labels / "a.xml", (c0 + 1, r0 + 1, c1, r1), (W, H))
    elif tool == "cvat":
        _voc(labels / "a.xml", (cols.min() + 1, rows.min() + 1, cols.max() + 1, rows.max() + 1), (H, W))
    elif tool == "labelme":
        shape = {"label": "dent", "shape_type": "rectangle",
                 "points": [[float(cols.min()), float(rows.min())], [float(cols.max() + 1), float(rows.max() + 1)]]}
        photo.with_suffix(".json").write_text(json.dumps({"shapes": [shape], "imageWidth": H, "imageHeight": W}))
    else:
        Image.fromarray(mask if tool == "mask_stored" else seen).save(photo.with_name("a_mask.png"))
    _stored_photo(tmp_path / "train" / "images" / "dent" / "b.png", 1)  # a second photo, as stored
    _voc(labels / "b.xml", (c0 + 1, r0 + 1, c1, r1), (W, H))

    cfg = DataConfig(root=str(tmp_path), val_split="", test_split="", image_size=H, image_width=W)
    ds = open_split(cfg, "train", train=False, masks=True)
    assert sorted(Path(p).name for p in ds.paths) == ["a.png", "b.png"]
    for i, path in enumerate(ds.paths):
        pixels = ds._load(i)
        assert pixels.shape == (4, H, W)
        assert pixels[3].any() and torch.equal(pixels[3] > 0, pixels[0] == 250), (path, tool)
    assert stored[r0, c0] == 250


def test_a_k_fold_link_writes_a_coco_entry_drawn_on_the_stored_pixels_as_seen_upright(tmp_path):
    from dtrain.recipe.folds import link_split

    photo = tmp_path / "set" / "a.png"
    _stored_photo(photo, 6)
    r0, r1, c0, c1 = BLOCK
    listing = {"images": [{"id": 0, "file_name": "a.png", "width": W, "height": H}],
               "annotations": [{"image_id": 0, "bbox": [c0, r0, c1 - c0, r1 - r0]}]}
    (tmp_path / "set" / "_annotations.coco.json").write_text(json.dumps(listing))
    ref = mask_targets.mask_files([str(photo)])[0]
    link_split(tmp_path / "folds", "train", ["defect", "ok"], [str(photo)], [0], masks=[ref])
    written = tmp_path / "folds" / "train" / "defect" / "000000_a_mask.txt"
    # YOLO states no frame, so it is written upright; read back at the upright size it marks the
    # block where the upright photo has it
    marked = mask_targets.read_mask(written, (W, H), (W, H), 6)[0] > 0
    from_ref = mask_targets.read_mask(ref, (W, H), (W, H), 6)[0] > 0
    assert torch.equal(marked, from_ref) and marked.sum() == (r1 - r0) * (c1 - c0)
