"""Data sets as public defect sets ship them (owner: data): photos in sub-folders, each
beside its ground-truth mask, class folders under images/ beside annotations, images loose
in one folder, and macOS archive debris. Masks must not train or test; what cannot be
read as classes is refused with the way out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dtrain.data.config import DataConfig
from dtrain.data.layouts import scan
from dtrain.data.masks import images_under
from dtrain.errors import DtrainError
from dtrain.recipe.decide import notes
from dtrain.recipe.stats import detect_layout, gather


def _photo(path: Path, seed: int, colour: bool = False) -> None:
    rng = np.random.default_rng(seed)
    shape = (48, 64, 3) if colour else (48, 64)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)


def _mask(path: Path, dtype=np.uint8, value: int = 255) -> None:
    m = np.zeros((48, 64), dtype)
    m[10:20, 30:34] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(m).save(path)


def _magnetic_tiles(root: Path, per_class: int = 10) -> None:
    """The magnetic-tile set's own layout: MT_<class>/Imgs/<name>.jpg, its mask <name>.png beside it."""
    for c, name in enumerate(("MT_Blowhole", "MT_Crack", "MT_Free")):
        for i in range(per_class):
            _photo(root / name / "Imgs" / f"exp1_num_{c}{i:03d}.jpg", seed=100 * c + i)
            _mask(root / name / "Imgs" / f"exp1_num_{c}{i:03d}.png")


def test_a_published_tile_set_trains_on_its_photos_not_on_its_masks(tmp_path):
    root = tmp_path / "tiles"
    _magnetic_tiles(root)
    (root / "__MACOSX" / "MT_Crack").mkdir(parents=True)  # what a zip made on a Mac adds
    (root / "__MACOSX" / "MT_Crack" / "._exp1_num_1000.jpg").write_bytes(b"\x00\x05\x16\x07 resource fork")
    (root / "MT_Crack" / "Imgs" / "._exp1_num_1000.jpg").write_bytes(b"\x00\x05\x16\x07 resource fork")

    fields = detect_layout(root)
    assert fields["layout"] == "classfolders"
    cfg = DataConfig(root=str(root), image_size=32, **{k: v for k, v in fields.items() if k != "layout"},
                     layout=fields["layout"])
    listings = [scan(cfg, split) for split in (cfg.train_split, cfg.val_split, cfg.test_split)]
    assert listings[0].classes == ["MT_Blowhole", "MT_Crack", "MT_Free"]  # not "Imgs", not "__MACOSX"
    assert listings[0].classes[listings[0].negative_index] == "MT_Free"
    every = [p for listing in listings for p in listing.paths]
    assert len(every) == 30 and len(set(every)) == 30
    assert all(p.endswith(".jpg") and "/._" not in p for p in every)
    left_out = listings[0].left_out
    assert sorted(Path(p).name for p in left_out) == sorted(f"exp1_num_{c}{i:03d}.png" for c in range(3) for i in range(10))
    assert left_out[str(root / "MT_Crack" / "Imgs" / "exp1_num_1003.png")] == "a mask of exp1_num_1003.jpg: 2 pixel values"

    stats = gather(cfg)
    said = " ".join(notes(stats))
    assert "30 ground-truth masks among the images, left out" in said and "exp1_num_" in said


def test_mask_suffixes_16_bit_masks_and_ground_truth_folders_are_left_out(tmp_path):
    folder = tmp_path / "crack"
    _photo(folder / "10000.png", seed=1)
    _mask(folder / "10000_GT.png", np.uint16, 65535)  # KolektorSDD2's naming, at 16 bits
    _photo(folder / "part7.bmp", seed=2, colour=True)
    _mask(folder / "part7-mask.png", value=1)  # a label-index mask: values 0 and 1
    _mask(folder / "masks" / "part9.png")
    _photo(folder / "part9.png", seed=3)
    _photo(folder / "batch2" / "part10.jpg", seed=4)  # a sub-folder of photos is read

    images, left_out = images_under(folder)

    assert [p.name for p in images] == ["10000.png", "part10.jpg", "part7.bmp", "part9.png"]
    assert left_out == {
        str(folder / "10000_GT.png"): "a mask of 10000.png: 2 pixel values",
        str(folder / "part7-mask.png"): "a mask of part7.bmp: 2 pixel values",
        str(folder / "masks") + "/": "a sub-folder named 'masks': ground truth, not photos",
    }


def test_a_photo_kept_in_two_formats_and_an_unpaired_plain_picture_are_kept(tmp_path):
    """Only a file named after a photo and with few pixel values is a mask: two photos that
    share a name stay, and so does a flat picture (an all-black frame) that pairs with none."""
    folder = tmp_path / "ok"
    _photo(folder / "a.png", seed=1)
    _photo(folder / "a.jpg", seed=2)
    _mask(folder / "dark_frame.png", value=0)
    _mask(folder / "b_label.png")  # a suffix of a mask, but no photo called b

    images, left_out = images_under(folder)

    assert [p.name for p in images] == ["a.jpg", "a.png", "b_label.png", "dark_frame.png"]
    assert left_out == {}


def test_a_binary_mask_saved_as_jpeg_is_left_out_and_a_plain_photo_named_so_is_not(tmp_path):
    """A JPEG's values count for nothing (ringing makes many), so a lossy file is a mask only
    when a mask suffix names it after a photo and nearly all its pixels are black or white."""
    folder = tmp_path / "crack"
    _photo(folder / "p1.jpg", seed=1)
    m = np.zeros((48, 64), np.uint8)
    m[10:30, 20:26] = 255
    Image.fromarray(m).save(folder / "p1_mask.jpg", quality=75)  # ringing around the crack's edges
    _photo(folder / "p2.jpg", seed=2)
    grey = np.clip(np.random.default_rng(3).normal(128, 6, (48, 64)), 0, 255).astype(np.uint8)
    Image.fromarray(grey).save(folder / "p2_gt.jpg")  # named like a mask, but a plain grey surface
    Image.fromarray(m).save(folder / "p3.jpg")  # black and white, but no photo called p3 to be the mask of

    images, left_out = images_under(folder)

    assert [p.name for p in images] == ["p1.jpg", "p2.jpg", "p2_gt.jpg", "p3.jpg"]
    (path, why), = left_out.items()
    assert path == str(folder / "p1_mask.jpg") and why.startswith("a mask of p1.jpg: ")
    assert why.endswith("of its pixels black or white (a mask saved lossily)")
    assert len(np.unique(np.asarray(Image.open(folder / "p1_mask.jpg")))) > 8  # its values alone would not say so


def test_imagefolder_reads_sub_folders_of_a_class_and_says_what_it_left_out(tmp_path):
    root = tmp_path / "data"
    for split in ("train", "val"):
        for i in range(3):
            _photo(root / split / "ok" / "line1" / f"{i}.png", seed=i)
            _photo(root / split / "scratch" / f"{i}.jpg", seed=10 + i)
            _mask(root / split / "scratch" / f"{i}.png")
    cfg = DataConfig(root=str(root), image_size=32, test_split="")

    train = scan(cfg, "train")

    assert train.classes == ["ok", "scratch"] and train.targets == [0, 0, 0, 1, 1, 1]
    assert all(Path(p).suffix == (".png" if "/ok/" in p else ".jpg") for p in train.paths)
    assert len(train.left_out) == 3


def test_class_folders_under_images_beside_annotations_are_the_classes(tmp_path):
    """NEU-DET's layout: train/images/<class>/*.jpg, train/annotations/*.xml, validation/..."""
    root = tmp_path / "NEU-DET"
    for split, n in (("train", 4), ("validation", 2)):
        for c in ("crazing", "inclusion", "patches"):
            for i in range(n):
                _photo(root / split / "images" / c / f"{c}_{i}.jpg", seed=i)
                (root / split / "annotations").mkdir(parents=True, exist_ok=True)
                (root / split / "annotations" / f"{c}_{i}.xml").write_text("<annotation/>")

    fields = detect_layout(root)
    cfg = DataConfig(root=str(root), image_size=32, **fields)
    train, test = scan(cfg, cfg.train_split), scan(cfg, cfg.test_split)

    assert fields["test_split"] == "validation"
    assert train.classes == test.classes == ["crazing", "inclusion", "patches"]
    assert len(test.paths) == 6 and all("/validation/images/" in p for p in test.paths)
    assert sorted(set(train.targets)) == [0, 1, 2]


def test_a_class_named_images_beside_other_classes_is_a_class(tmp_path):
    """Only an images/ whose siblings are annotation folders holds the classes; beside other
    class folders it is one (here with its photos one folder down, as magnetic tiles keep them)."""
    root = tmp_path / "set"
    for split in ("train", "val"):
        for c in ("images", "ok", "scratch"):
            for i in range(3):
                _photo(root / split / c / ("Imgs" if c == "images" else "") / f"{c}_{i}.jpg", seed=i)
    cfg = DataConfig(root=str(root), image_size=32, **detect_layout(root))
    train = scan(cfg, cfg.train_split)
    assert train.classes == ["images", "ok", "scratch"] and sorted(set(train.targets)) == [0, 1, 2]


def test_a_detection_set_whose_labels_name_none_of_its_photos_is_refused_with_what_to_do(tmp_path):
    """Flat images/ beside labels/ whose files label none of these photos (a COCO file of other
    images, a .txt of notes): boxes, not classes, and no label per photo (the formats that are
    read: tests/test_data_box_labels.py)."""
    root = tmp_path / "coco"
    for i in range(3):
        _photo(root / "train" / "images" / f"{i}.jpg", seed=i)
    (root / "train" / "labels").mkdir(parents=True, exist_ok=True)
    (root / "train" / "labels" / "instances.json").write_text(
        '{"images": [{"id": 1, "file_name": "other.jpg", "width": 8, "height": 8}], "annotations": []}')
    (root / "train" / "labels" / "0.txt").write_text("scratch near the rim\n")
    _photo(root / "valid" / "images" / "9.jpg", seed=9)
    cfg = DataConfig(root=str(root), image_size=32, **detect_layout(root))

    with pytest.raises(DtrainError) as err:
        scan(cfg, cfg.train_split)

    assert "holds images/ and labels/: a detection or segmentation data set" in err.value.message
    assert "an entry in a COCO .json" in err.value.message and "one folder per class" in err.value.hint


def test_images_loose_in_the_folder_get_their_name_prefixes_named_as_a_way_out(tmp_path):
    """NEU-CLS ships 1800 bmp files in one folder, the class in the name (Cr_1.bmp)."""
    root = tmp_path / "NEU-CLS"
    for c in ("Cr", "In", "Pa"):
        for i in range(1, 4):
            _photo(root / f"{c}_{i}.bmp", seed=i)

    with pytest.raises(DtrainError) as err:
        detect_layout(root)

    assert "holds 9 images directly, and no class folders; their names begin with 3 prefixes: Cr (3), In (3), Pa (3)" \
        in err.value.message
    assert "ROOT/<prefix>/*" in err.value.hint and "for f in *_*.*; do mkdir -p" in err.value.hint


def test_names_without_an_underscore_get_no_shell_line_that_would_not_sort_them(tmp_path):
    root = tmp_path / "loose"
    for c in ("crazing", "patches"):
        for i in range(1, 3):
            _photo(root / f"{c}{i}.png", seed=i)
    (root / "README.txt").write_text("no underscore here either, but not an image")

    with pytest.raises(DtrainError) as err:
        detect_layout(root)

    assert "2 prefixes: crazing (2), patches (2)" in err.value.message
    assert "ROOT/<prefix>/*" in err.value.hint and "for f in" not in err.value.hint


def test_a_link_back_up_the_tree_is_read_once_not_forever(tmp_path):
    folder = tmp_path / "scratch"
    _photo(folder / "a.png", seed=1)
    _photo(folder / "batch" / "b.png", seed=2)
    (folder / "batch" / "up").symlink_to(folder, target_is_directory=True)
    (folder / "again").symlink_to(folder / "batch", target_is_directory=True)

    images, _ = images_under(folder)

    assert [p.relative_to(folder).as_posix() for p in images] == ["a.png", "again/b.png"]
