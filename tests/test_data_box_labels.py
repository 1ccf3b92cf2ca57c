"""Detection sets labelled by their box files (owner: data): YOLO exports (Roboflow's
SPLIT/images + SPLIT/labels, Ultralytics' images/SPLIT + labels/SPLIT) and Pascal VOC
(JPEGImages/ + Annotations/). A photo whose file holds a box is a defect, one whose file is
empty or missing a good part; the recipe finds the layout itself, says how each photo was
labelled, and trains on the boxes as masks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dtrain.data.config import DataConfig
from dtrain.data.layouts import scan
from dtrain.errors import DtrainError
from dtrain.recipe.stats import detect_layout
from tests.quickstart_helpers import quickstart_data

BOX = "0 0.5 0.5 0.2 0.3\n"


def _photo(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (30, 40), dtype=np.uint8)).save(path)


def _label(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _labels(cfg: DataConfig) -> dict[str, bool]:
    """{photo: defective} over every split the config names."""
    out = {}
    for split in (cfg.train_split, cfg.val_split, cfg.test_split):
        if split:
            listing = scan(cfg, split)
            assert not set(out) & set(listing.paths), "a photo in two splits"
            out.update({p: listing.classes[t] == "defect" for p, t in zip(listing.paths, listing.targets)})
    return out


def _config(root: Path) -> DataConfig:
    return DataConfig(root=str(root), image_size=32, **detect_layout(root))


def test_a_roboflow_yolo_export_is_labelled_by_its_box_files(tmp_path):
    """SPLIT/images/x.jpg beside SPLIT/labels/x.txt; a good part has an empty file, or none."""
    truth, seed = {}, 0
    for split, n in (("train", 12), ("valid", 6), ("test", 6)):
        for i in range(n):
            photo = tmp_path / split / "images" / f"part_{i}.jpg"
            _photo(photo, seed := seed + 1)
            if i != n - 1:  # the last of each split: a background photo without a label file
                _label(tmp_path / split / "labels" / f"part_{i}.txt", BOX if i % 3 == 0 else "")
            truth[str(photo)] = i % 3 == 0 and i != n - 1
    fields = detect_layout(tmp_path)
    assert fields == {"layout": "masklabels", "val_split": "valid"}
    cfg = _config(tmp_path)
    assert _labels(cfg) == truth
    train = scan(cfg, "train")
    assert train.labelled_by["its box file marks a defect"] == 4
    assert train.labelled_by["its box file is empty"] == 7 and train.labelled_by["it has no mask"] == 1
    assert str(tmp_path / "train" / "labels") + "/" in train.left_out  # the label folder is no class of photos


def test_an_ultralytics_layout_is_not_read_as_classes_named_train_and_val(tmp_path):
    """images/{train,val}/x.jpg beside labels/{train,val}/x.txt: before, class folders 'train' and 'val'."""
    truth = {}
    for split, n in (("train", 12), ("val", 6)):
        for i in range(n):
            photo = tmp_path / "images" / split / f"{i}.png"
            _photo(photo, 100 * len(split) + i)
            _label(tmp_path / "labels" / split / f"{i}.txt", BOX if i % 2 == 0 else "")
            truth[str(photo)] = i % 2 == 0
    fields = detect_layout(tmp_path)
    assert fields["layout"] == "masklabels" and fields["test_split"] == "val", fields
    cfg = _config(tmp_path)
    assert scan(cfg, cfg.train_split).classes == ["defect", "ok"]
    assert _labels(cfg) == truth


def test_a_voc_set_with_image_sets_is_labelled_by_its_annotations_and_split_for_you(tmp_path):
    """JPEGImages/ + Annotations/ (+ ImageSets/ of id lists): an annotation without objects is a good part."""
    truth = {}
    (tmp_path / "ImageSets" / "Main").mkdir(parents=True)
    (tmp_path / "ImageSets" / "Main" / "trainval.txt").write_text("\n".join(str(i) for i in range(20)))
    for i in range(20):
        photo = tmp_path / "JPEGImages" / f"{i:06d}.png"
        _photo(photo, i)
        objects = ("<object><name>crack</name><bndbox><xmin>3</xmin><ymin>4</ymin><xmax>12</xmax><ymax>9</ymax>"
                   "</bndbox></object>") if i % 4 == 0 else ""
        _label(tmp_path / "Annotations" / f"{i:06d}.xml",
               f"<annotation><size><width>40</width><height>30</height></size>{objects}</annotation>")
        truth[str(photo)] = i % 4 == 0
    assert detect_layout(tmp_path) == {"layout": "masklabels"}
    assert _labels(_config(tmp_path)) == truth


def test_a_detection_set_whose_every_photo_holds_a_box_of_one_class_is_refused_with_what_to_do(tmp_path):
    """No good part and one defect type: nothing to tell apart (several types: boxclasses, below)."""
    for i in range(6):
        _photo(tmp_path / "train" / "images" / f"{i}.jpg", i)
        _label(tmp_path / "train" / "labels" / f"{i}.txt", BOX)
    cfg = _config(tmp_path)
    with pytest.raises(DtrainError) as err:
        scan(cfg, cfg.train_split)
    assert "every training photo" in err.value.message and "all of one class (0)" in err.value.message
    assert "add photos of good parts" in err.value.hint and "data.yaml" in err.value.hint


def test_quickstart_trains_a_yolo_export_with_its_boxes_as_masks(synth_data, dtrain_cmd, tmp_path):
    """synth_data's photos as a Roboflow export: a box around the middle third of every defective
    photo, an empty label file for every good one. The recipe finds the layout, says the labels
    came from box files, trains with the boxes as masks, and measures misses against 'ok'."""
    root = tmp_path / "export"
    test_defects = 0
    for split, to in (("train", "train"), ("val", "valid"), ("test", "test")):
        for cls_dir in sorted((synth_data / split).iterdir()):
            for src in sorted(cls_dir.iterdir())[:40 if cls_dir.name == "ok" else 12]:
                dst = root / to / "images" / f"{cls_dir.name}_{src.stem}.png"
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dst)
                _label(root / to / "labels" / f"{dst.stem}.txt", "" if cls_dir.name == "ok" else "2 0.5 0.5 0.33 0.33\n")
                test_defects += to == "test" and cls_dir.name != "ok"
    work = tmp_path / "qs"
    proc = quickstart_data(dtrain_cmd, root, work, epochs=2)
    assert "labels read from the box files (data.layout masklabels)" in proc.stdout, proc.stdout
    assert "because its box file marks a defect" in proc.stdout and "because its box file is empty" in proc.stdout
    assert "recipe: mask_loss = 1.0" in proc.stdout and "(all of them boxes from annotation files" in proc.stdout
    report = json.loads((work / "report.json").read_text())
    assert report["classes"] == ["defect", "ok"] and report["negative_class"] == "ok", report
    assert report["n_defective"] == test_defects and report["n_missed"] is not None, sorted(report)


# ---- COCO JSON (CVAT, Label Studio, Roboflow exports) ---------------------------------------------


def _coco(path: Path, images: list[tuple[str, int, int]], anns: list[dict]) -> Path:
    """images: (file_name, width, height), ids 1.. in order; anns: {"image": index, ...COCO fields}."""
    doc = {"images": [{"id": i + 1, "file_name": n, "width": w, "height": h} for i, (n, w, h) in enumerate(images)],
           "annotations": [{"id": k + 1, "image_id": a.pop("image") + 1, "category_id": 1, **a}
                           for k, a in enumerate(dict(a) for a in anns)],
           "categories": [{"id": 1, "name": "scratch"}]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_a_roboflow_coco_export_is_labelled_by_its_json(tmp_path):
    """SPLIT/_annotations.coco.json beside SPLIT's photos: a box or a polygon is a defect; an image
    listed with no annotation is a good part."""
    truth = {}
    for split, n in (("train", 10), ("valid", 5), ("test", 5)):
        names, anns = [], []
        for i in range(n):
            _photo(tmp_path / split / f"p{i}.jpg", 10 * len(split) + i)
            names.append((f"p{i}.jpg", 40, 30))
            if i % 3 == 0:
                anns.append({"image": i, "bbox": [4, 5, 10, 6]})
            elif i % 3 == 1 and i > 5:
                anns.append({"image": i, "bbox": [0, 0, 8, 8], "segmentation": [[1, 1, 7, 1, 7, 7, 1, 7]]})
            truth[str(tmp_path / split / f"p{i}.jpg")] = i % 3 == 0 or (i % 3 == 1 and i > 5)
        _coco(tmp_path / split / "_annotations.coco.json", names, anns)
    assert detect_layout(tmp_path) == {"layout": "masklabels", "val_split": "valid"}
    assert _labels(_config(tmp_path)) == truth


def test_cvat_coco_boxes_and_polygons_land_where_their_pixels_are(tmp_path):
    """images/ beside annotations/instances_default.json, no split folders: carved for you; the
    mask is the box's pixels (COCO's [x, y, w, h] edges) or the filled polygon."""
    from dtrain.data import mask_targets

    names = []
    for i in range(12):
        _photo(tmp_path / "images" / f"{i}.png", i)
        names.append((f"images/{i}.png", 40, 30))  # CVAT writes the folder it saw
    anns = [{"image": i, "bbox": [20, 4, 20, 12]} for i in range(0, 12, 2)]
    anns.append({"image": 1, "bbox": [0, 0, 10, 10], "segmentation": [[2, 2, 8, 2, 8, 6, 2, 6]]})
    _coco(tmp_path / "annotations" / "instances_default.json", names, anns)
    assert detect_layout(tmp_path) == {"layout": "masklabels"}
    labels = _labels(_config(tmp_path))
    assert labels == {str(tmp_path / "images" / f"{i}.png"): i % 2 == 0 or i == 1 for i in range(12)}
    masks = mask_targets.mask_files([str(tmp_path / "images" / "0.png"), str(tmp_path / "images" / "1.png")])
    box = mask_targets.read_mask(masks[0], (30, 40), (30, 40))[0].numpy() > 0
    want = np.zeros((30, 40), bool)
    want[4:16, 20:40] = True
    assert np.array_equal(box, want)
    polygon = mask_targets.read_mask(masks[1], (30, 40), (30, 40))[0].numpy() > 0
    assert polygon[3:6, 3:8].all() and not polygon[8:, :].any() and not polygon[:, 10:].any()


@pytest.mark.parametrize("text", [
    '{"images": [{"id": 1, "file_name": "a.png", "width": 40, "height": 30}], "annotations": [{"image_id": 9, '
    '"bbox": [1, 1, 2, 2]}]}',  # an annotation of no listed image
    '{"images": [{"id": 1, "file_name": "a.png"}], "annotations": []}',  # no size: shares cannot be made
    '{"classes": ["ok", "scratch"], "counts": {}}',  # JSON, not COCO (dtrain data synth's manifest)
    '{"images": [], "annotations": [', '{"images": [], "annotations": ' + "[" * 100000 + "]" * 100000 + "}",
    # damaged; nested past the parser
    '{"images": [{"id": 1, "file_name": "a.png", "width": 1' + "0" * 400 + ', "height": 30}], "annotations": []}',
    # a size of more digits than a float holds (json reads it as an int; converting it overflowed)
])
def test_json_that_is_not_a_readable_coco_file_labels_nothing(tmp_path, text):
    from dtrain.data import mask_targets

    photo = tmp_path / "images" / "a.png"
    _photo(photo, 0)
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "instances.json").write_text(text)
    assert mask_targets.mask_files([str(photo)]) == [None]


def test_two_images_of_one_name_are_told_apart_by_their_folders(tmp_path):
    from dtrain.data import boxes, coco

    for split in ("train", "val"):
        _photo(tmp_path / "images" / split / "x.png", len(split))
    listing = _coco(tmp_path / "result.json", [("images/train/x.png", 40, 30), ("images/val/x.png", 40, 30)],
                    [{"image": 1, "bbox": [1, 1, 5, 5]}])
    train, val = (coco.find(tmp_path / "images" / s / "x.png", listing) for s in ("train", "val"))
    assert (boxes.marks(train), boxes.marks(val)) == (False, True)
    assert coco.find(tmp_path / "elsewhere" / "x.png", listing) is None  # neither path: not guessed


def test_a_k_fold_run_writes_a_coco_entry_as_the_photos_own_box_file(tmp_path):
    """A COCO entry is no file to link beside the photo's link: its boxes are written there."""
    from dtrain.data import mask_targets
    from dtrain.recipe.folds import link_split

    photo = tmp_path / "set" / "a.png"
    _photo(photo, 0)
    _coco(tmp_path / "set" / "_annotations.coco.json", [("a.png", 40, 30)], [{"image": 0, "bbox": [20, 4, 20, 12]}])
    ref = mask_targets.mask_files([str(photo)])[0]
    link_split(tmp_path / "folds", "train", ["defect", "ok"], [str(photo)], [0], masks=[ref])
    linked = tmp_path / "folds" / "train" / "defect" / "000000_a.png"
    paired = mask_targets.mask_files([str(linked)])[0]
    assert paired == str(linked.with_name("000000_a_mask.txt"))
    same = [mask_targets.read_mask(m, (30, 40), (30, 40)) for m in (ref, paired)]
    assert torch.equal(*same) and same[0].any()


# ---- LabelMe JSON beside each photo ----------------------------------------------------------------


def _labelme(path: Path, shapes: list[dict], size=(40, 30), image_data: str | None = None) -> Path:
    path.write_text(json.dumps({"version": "5.2.1", "flags": {}, "shapes": shapes, "imagePath": f"{path.stem}.png",
                                "imageData": image_data, "imageWidth": size[0], "imageHeight": size[1]}))
    return path


def test_labelme_shapes_land_where_their_points_are(tmp_path):
    """A rectangle fills its box, a polygon its outline; a line keeps a width; a photo whose file
    embeds the photo itself (imageData) is read too."""
    from dtrain.data import boxes

    photo = tmp_path / "a.png"
    _photo(photo, 0)
    rect = _labelme(tmp_path / "r.json", [{"label": "dent", "shape_type": "rectangle", "points": [[30, 16], [20, 4]]}],
                    image_data="iVBORw0KGgo" * 200_000)
    want = np.zeros((30, 40), bool)
    want[4:16, 20:30] = True
    assert np.array_equal(boxes.rasterise(boxes.read_shapes(rect), 30, 40)[0].numpy() > 0, want)
    poly = _labelme(tmp_path / "p.json", [{"label": "pit", "shape_type": "polygon",
                                          "points": [[2, 2], [12, 2], [12, 8], [2, 8]]}])
    marked = boxes.rasterise(boxes.read_shapes(poly), 30, 40)[0].numpy() > 0
    assert marked[3:8, 3:12].all() and not marked[10:].any() and not marked[:, 14:].any()
    line = _labelme(tmp_path / "l.json", [{"label": "scratch", "shape_type": "linestrip",
                                          "points": [[5, 20], [35, 20]]}])
    rows = np.nonzero((boxes.rasterise(boxes.read_shapes(line), 30, 40)[0].numpy() > 0).any(axis=1))[0]
    assert list(rows) == [19, 20]  # a horizontal line: two rows, not none
    circle = _labelme(tmp_path / "c.json", [{"label": "pit", "shape_type": "circle", "points": [[20, 15], [25, 15]]}])
    disc = boxes.rasterise(boxes.read_shapes(circle), 30, 40)[0].numpy() > 0
    assert disc[15, 16:24].all() and not disc[15, 27:].any() and not disc[:9].any()


@pytest.mark.parametrize("text", [
    '{"camera": "acA2440", "exposure_us": 800}',  # a camera's metadata beside the photo
    '{"shapes": [{"shape_type": "polygon", "points": [[1, 1], [2]]}], "imageWidth": 40, "imageHeight": 30}',
    '{"shapes": [], "imageWidth": 0, "imageHeight": 30}', '{"shapes": ',
    '{"shapes": [{"shape_type": "rectangle", "points": [[1, 1], [1' + "0" * 400 + ', 5]]}], "imageWidth": 40, '
    '"imageHeight": 30}',  # a point of more digits than a float holds
])
def test_json_beside_a_photo_that_is_not_labelme_gives_no_mask(tmp_path, text):
    from dtrain.data import mask_targets

    photo = tmp_path / "dent" / "a.png"
    _photo(photo, 0)
    (tmp_path / "dent" / "a.json").write_text(text)
    assert mask_targets.mask_files([str(photo)]) == [None]


def test_a_labelme_labelled_folder_is_labelled_by_its_shapes(tmp_path):
    """Photos beside their LabelMe files, loose in train/ and test/: a shape is a defect; a file
    with no shape, or none, is a good part."""
    truth = {}
    for split in ("train", "test"):
        for i in range(12):
            photo = tmp_path / split / f"{i:03d}.png"
            _photo(photo, 10 * len(split) + i)
            if i % 4 != 3:
                shapes = [{"label": "crack", "shape_type": "polygon", "points": [[2, 2], [9, 3], [5, 9]]}] if i % 4 == 0 else []
                _labelme(photo.with_suffix(".json"), shapes)
            truth[str(photo)] = i % 4 == 0
    assert detect_layout(tmp_path) == {"layout": "masklabels", "val_from_train": 0.25}
    assert _labels(_config(tmp_path)) == truth


# ---- detection sets without good parts: classes from the boxes ---------------------------------


def test_a_yolo_export_without_good_parts_is_a_classifier_of_its_named_box_classes(tmp_path):
    """NEU-DET as Roboflow exports it: every photo holds boxes, data.yaml names the numbers. A
    photo with boxes of two types is the type that covers most of it."""
    (tmp_path / "data.yaml").write_text("train: ../train/images\nval: ../valid/images\nnc: 3\n"
                                        "names: ['crazing', 'inclusion', 'scratches']\n")
    truth = {}
    for split, n in (("train", 12), ("valid", 6)):
        for i in range(n):
            photo = tmp_path / split / "images" / f"{i}.jpg"
            _photo(photo, 10 * len(split) + i)
            kind = i % 3
            # a small box of the next type beside a large one of its own
            _label(tmp_path / split / "labels" / f"{i}.txt",
                   f"{(kind + 1) % 3} 0.2 0.2 0.1 0.1\n{kind} 0.6 0.6 0.5 0.5\n")
            truth[str(photo)] = ("crazing", "inclusion", "scratches")[kind]
    unlabelled = tmp_path / "valid" / "images" / "blank.jpg"  # no type to learn: left out, with why
    _photo(unlabelled, 99)
    _label(tmp_path / "valid" / "labels" / "blank.txt", "")
    fields = detect_layout(tmp_path)
    assert fields == {"layout": "boxclasses", "test_split": "valid", "val_split": "val-from-train",
                      "val_from_train": 0.25}
    cfg = _config(tmp_path)
    seen = {}
    for split in (cfg.train_split, cfg.val_split, cfg.test_split):
        listing = scan(cfg, split)
        assert listing.classes == ["crazing", "inclusion", "scratches"] and listing.negative_index is None
        seen.update({p: listing.classes[t] for p, t in zip(listing.paths, listing.targets)})
    assert seen == truth
    assert scan(cfg, "valid").left_out[str(unlabelled)] == "no defect type: its label file marks no defect"
    from dtrain.recipe.decide import notes
    from dtrain.recipe.stats import gather

    said = " ".join(notes(gather(cfg)))
    assert "1 photos left out of every split: a classifier of defect types learns nothing" in said, said
    assert "ground-truth mask" not in said.replace("ground-truth folder", "")


def test_coco_categories_voc_names_and_labelme_labels_name_the_classes(tmp_path):
    """The other formats name their boxes themselves (COCO by category, its number where unnamed)."""
    from dtrain.data import boxes

    coco_dir, voc_dir, lm_dir = tmp_path / "coco", tmp_path / "voc", tmp_path / "labelme"
    names = [(f"{i}.png", 40, 30) for i in range(8)]
    for i in range(8):
        _photo(coco_dir / f"{i}.png", i)
    doc = _coco(coco_dir / "_annotations.coco.json", names, [{"image": i, "bbox": [2, 2, 9, 9]} for i in range(8)])
    raw = json.loads(doc.read_text())
    raw["categories"] = [{"id": 1, "name": "pit"}]
    for k, ann in enumerate(raw["annotations"]):
        ann["category_id"] = 1 if k % 2 else 2  # 2 is named nowhere: its number names it
    doc.write_text(json.dumps(raw))
    assert detect_layout(coco_dir) == {"layout": "boxclasses"}
    cfg = _config(coco_dir)
    listings = [scan(cfg, s) for s in (cfg.train_split, cfg.val_split, cfg.test_split)]
    assert listings[0].classes == ["2", "pit"] and sum(len(x.paths) for x in listings) == 8
    voc = tmp_path / "a.xml"
    voc.write_text("<annotation><size><width>40</width><height>30</height></size>"
                   "<object><name>dent</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>4</xmax><ymax>4</ymax></bndbox>"
                   "</object><object><name> scratch </name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>30</xmax>"
                   "<ymax>3</ymax></bndbox></object></annotation>")
    assert boxes.read_shapes(voc).main_label() == "scratch"  # 30 x 3 px over 4 x 4
    lm_dir.mkdir()
    lm = _labelme(lm_dir / "a.json", [{"label": "pit", "shape_type": "circle", "points": [[20, 15], [23, 15]]},
                                      {"label": "stain", "shape_type": "polygon", "points": [[0, 0], [5, 0], [5, 5]]}])
    assert boxes.read_shapes(lm).main_label() == "pit"  # pi 3^2 = 28 over 12.5


def test_quickstart_trains_a_detection_set_without_good_parts_as_defect_types(synth_data, dtrain_cmd, tmp_path):
    """synth_data's defective photos as a YOLO export whose data.yaml names the types: the recipe
    finds no good part, trains a classifier of the types, with the boxes as masks."""
    root = tmp_path / "export"
    types = sorted(d.name for d in (synth_data / "train").iterdir() if d.name != "ok")
    (root).mkdir()
    (root / "data.yaml").write_text("names:\n" + "".join(f"  {i}: {t}\n" for i, t in enumerate(types)))
    for split, to in (("train", "train"), ("val", "valid"), ("test", "test")):
        for k, name in enumerate(types):
            for src in sorted((synth_data / split / name).iterdir())[:12]:
                dst = root / to / "images" / f"{name}_{src.stem}.png"
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dst)
                _label(root / to / "labels" / f"{dst.stem}.txt", f"{k} 0.5 0.5 0.33 0.33\n")
    work = tmp_path / "qs"
    proc = quickstart_data(dtrain_cmd, root, work, epochs=2)
    assert "labels from the classes of the photos' boxes" in proc.stdout, proc.stdout
    assert "recipe: mask_loss = 1.0" in proc.stdout
    report = json.loads((work / "report.json").read_text())
    assert report["classes"] == types and report["negative_class"] is None, report


def test_a_hostile_names_file_names_nothing(tmp_path):
    """A YAML alias bomb under `names` (each level ten of the one below): no names, at once."""
    from dtrain.data.layouts import yolo_names

    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (tmp_path / "data.yaml").write_text("\n".join(levels) + "\nnames: [*a8, ok]\n")
    assert yolo_names(tmp_path) == {}
    (tmp_path / "data.yaml").write_text("names: " + "[" * 2000 + "]" * 2000 + "\n")  # PyYAML recursed out of its stack
    assert yolo_names(tmp_path) == {}
    (tmp_path / "data.yaml").write_text("names: {0: crazing, 1: pitted}\n")
    assert yolo_names(tmp_path) == {"0": "crazing", "1": "pitted"}


def test_labelimg_classes_txt_beside_the_yolo_files_names_the_numbers(tmp_path):
    """LabelImg writes classes.txt into the folder of its YOLO files (no data.yaml)."""
    for i in range(6):
        _photo(tmp_path / "train" / "images" / f"{i}.jpg", i)
        _label(tmp_path / "train" / "labels" / f"{i}.txt", f"{i % 2} 0.5 0.5 0.2 0.2\n")
    (tmp_path / "train" / "labels" / "classes.txt").write_text("dent\nscratch\n")
    cfg = _config(tmp_path)
    listing = scan(cfg, cfg.train_split)
    assert cfg.layout == "boxclasses" and listing.classes == ["dent", "scratch"]


def test_a_damaged_mask_file_is_a_read_error_its_photo_survives(tmp_path):
    """Pillow raises KeyError (an IM file's unknown mode) or NotImplementedError (DDS pixel
    flags) on some damaged files: read_mask let them through, past the dataset's read errors,
    and one such mask ended training."""
    from image_fixtures import damaged_files

    from dtrain.data import mask_targets

    for name, data in damaged_files().items():
        path = tmp_path / name
        path.write_bytes(data)
        try:
            mask_targets.read_mask(path, (8, 8), (4, 4))
        except (OSError, ValueError):
            pass  # what the dataset catches: the photo trains without its mask
