"""Sets labelled by their masks (owner: data): photos beside ground-truth masks and no class
folders (KolektorSDD2's train/10000.png + 10000_GT.png, KolektorSDD's kos01/Part0.jpg +
Part0_label.bmp, DAGM's Class1/Train/Label/). A photo is a defect when its mask marks a
pixel, a good part when the mask is empty or missing; the recipe finds the layout itself
and says how many photos each rule labelled."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dtrain.data.config import DataConfig
from dtrain.data.layouts import scan
from dtrain.recipe.decide import notes
from dtrain.recipe.stats import describe_layout, detect_layout, gather
from tests.quickstart_helpers import quickstart_data

NO_BOXES = {"its box file marks a defect": 0, "its box file is empty": 0}


def _photo(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 100), dtype=np.uint8)).save(path)


def _mask(path: Path, value: int = 255) -> None:
    m = np.zeros((40, 100), np.uint8)
    m[5:9, 50:60] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(m).save(path)


def _kolektor2(root: Path, n: int = 40) -> dict[str, bool]:
    """train/ and test/ of photos `<n>.png`, each beside `<n>_GT.png`: every fifth marks a defect,
    the rest are black. -> {photo path: defective}."""
    truth = {}
    for split, start in (("train", 10000), ("test", 20000)):
        for i in range(n):
            photo = root / split / f"{start + i}.png"
            _photo(photo, start + i)
            _mask(photo.with_name(f"{start + i}_GT.png"), value=255 if i % 5 == 0 else 0)
            truth[str(photo)] = i % 5 == 0
    return truth


def _config(root: Path, fields: dict) -> DataConfig:
    return DataConfig(root=str(root), image_size=32, **fields)


def _splits(cfg: DataConfig) -> list:
    return [scan(cfg, s) for s in (cfg.train_split, cfg.val_split, cfg.test_split)]


def _labels(listing) -> dict[str, bool]:
    return {p: listing.classes[t] == "defect" for p, t in zip(listing.paths, listing.targets)}


def test_a_kolektor2_shaped_set_is_labelled_by_its_masks_with_val_carved_from_train(tmp_path):
    truth = _kolektor2(tmp_path)
    fields = detect_layout(tmp_path)
    assert fields == {"layout": "masklabels", "val_from_train": 0.25}
    assert "labels from the photos' masks" in describe_layout(fields)
    cfg = _config(tmp_path, fields)
    train, val, test = _splits(cfg)
    assert train.classes == ["defect", "ok"] and train.classes[train.negative_index] == "ok"
    seen = {}
    for listing in (train, val, test):
        assert not set(seen) & set(listing.paths)  # the splits never share a photo
        seen.update(_labels(listing))
    assert seen == truth  # every photo once, labelled as its mask says; no mask is a photo
    assert all("/test/" in p for p in test.paths) and len(test.paths) == 40
    assert len(val.paths) == 10 and _labels(val) and sum(_labels(val).values()) == 2  # 25 % of each class
    assert train.labelled_by == {"its mask marks pixels": 6, "its mask is empty": 24, "it has no mask": 0, **NO_BOXES}

    stats = gather(cfg)
    assert stats.train_counts == {"defect": 6, "ok": 24} and stats.negative_class == "ok"
    assert stats.labelled_by == {"its mask marks pixels": 16, "its mask is empty": 64, "it has no mask": 0, **NO_BOXES}
    said = " ".join(notes(stats))
    assert "labels read from the masks" in said and "16 because its mask marks pixels" in said
    assert "80 ground-truth masks among the images, left out" in said


def test_numbered_part_folders_with_label_files_are_labelled_by_masks_and_split_by_fractions(tmp_path):
    """KolektorSDD: kos01..kos06 (one folder per part), Part<i>.jpg beside Part<i>_label.bmp."""
    truth = {}
    for k in range(1, 7):
        for i in range(5):
            photo = tmp_path / f"kos{k:02d}" / f"Part{i}.jpg"
            _photo(photo, 10 * k + i)
            marked = i == k % 5
            _mask(photo.with_name(f"Part{i}_label.bmp"), value=255 if marked else 0)
            truth[str(photo)] = marked
    fields = detect_layout(tmp_path)
    assert fields == {"layout": "masklabels"}  # not 6 classes named after the parts
    seen = {}
    for listing in _splits(_config(tmp_path, fields)):
        assert not set(seen) & set(listing.paths)
        seen.update(_labels(listing))
    assert seen == truth


def test_photos_without_a_mask_are_good_parts_and_masks_in_a_label_folder_pair_by_name(tmp_path):
    """DAGM: Class<n>/Train/<id>.PNG, a mask Class<n>/Train/Label/<id>_label.PNG for defective ones only."""
    truth = {}
    for c in (1, 2):
        for i in range(8):
            photo = tmp_path / f"Class{c}" / "Train" / f"{i:04d}.PNG"
            _photo(photo, 100 * c + i)
            truth[str(photo)] = i < 2
            if i < 2:
                _mask(tmp_path / f"Class{c}" / "Train" / "Label" / f"{i:04d}_label.PNG")
    fields = detect_layout(tmp_path)
    assert fields["layout"] == "masklabels"
    listings = _splits(_config(tmp_path, fields))
    seen = {p: d for listing in listings for p, d in _labels(listing).items()}
    assert seen == truth
    counts = {rule: sum(listing.labelled_by[rule] for listing in listings) for rule in listings[0].labelled_by}
    assert counts == {"its mask marks pixels": 4, "its mask is empty": 0, "it has no mask": 12, **NO_BOXES}


def test_a_segmentation_set_with_images_beside_masks_is_labelled_by_them(tmp_path):
    """ROOT/{train,test}/images/<n>.jpg with ROOT/<split>/masks/<n>.png (a YOLO set's labels/*.txt
    pair with nothing: still refused, test_data_published_layouts)."""
    truth = {}
    for split in ("train", "test"):
        for i in range(8):
            photo = tmp_path / split / "images" / f"{i}.jpg"
            _photo(photo, i)
            _mask(tmp_path / split / "masks" / f"{i}.png", value=255 if i < 3 else 0)
            truth[str(photo)] = i < 3
    fields = detect_layout(tmp_path)
    assert fields == {"layout": "masklabels", "val_from_train": 0.25}
    listings = _splits(_config(tmp_path, fields))
    assert {p: d for listing in listings for p, d in _labels(listing).items()} == truth
    assert any(k.endswith("/train/masks/") for k in listings[0].left_out)


def test_class_folders_with_masks_keep_their_names_as_labels(tmp_path):
    """Folders named as defects (not numbered) are the classes, masks or not: the tile set's rule."""
    for name in ("crack", "ok"):
        for i in range(6):
            photo = tmp_path / name / f"{i}.jpg"
            _photo(photo, i)
            _mask(photo.with_suffix(".png"), value=255 if name == "crack" else 0)
    assert detect_layout(tmp_path) == {"layout": "classfolders"}


def test_what_a_mask_marks(tmp_path):
    """A label image storing the class as 1 marks it; JPEG noise in an all-black mask does not;
    a mask that cannot be read leaves its photo out with the reason."""
    root = tmp_path / "set"
    for i in range(4):
        _photo(root / "train" / f"{i}.png", i)
        _photo(root / "test" / f"{i}.png", 10 + i)
    _mask(root / "train" / "0_mask.png", value=1)
    noisy = np.random.default_rng(0).integers(0, 20, (40, 100), dtype=np.uint8)
    Image.fromarray(noisy).save(root / "train" / "1_mask.jpg", quality=60)
    _mask(root / "train" / "2_mask.png", value=0)
    (root / "train" / "masks").mkdir()
    (root / "train" / "masks" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")  # 3.png's mask, unreadable
    _mask(root / "test" / "0_gt.png")
    cfg = DataConfig(root=str(root), layout="masklabels", val_from_train=0.0, val_split="")
    train = scan(cfg, "train")
    assert _labels(train) == {str(root / "train" / "0.png"): True, str(root / "train" / "1.png"): False,
                              str(root / "train" / "2.png"): False}
    assert "its mask cannot be read (3.png)" in train.left_out[str(root / "train" / "3.png")]
    assert train.labelled_by == {"its mask marks pixels": 1, "its mask is empty": 2, "it has no mask": 0, **NO_BOXES}
    assert _labels(scan(cfg, "test")) == {str(root / "test" / f"{i}.png"): i == 0 for i in range(4)}


def test_quickstart_trains_a_kolektor2_shaped_set_from_its_masks(synth_data, dtrain_cmd, tmp_path):
    """Photos of synth_data (good parts and defects) laid out as KolektorSDD2 ships them: the
    recipe finds the layout, trains, and the report measures misses against the mask-labelled 'ok'."""
    root = tmp_path / "ksdd2"
    n, test_defects = 0, 0
    for split, to in (("train", "train"), ("val", "train"), ("test", "test")):
        for cls_dir in sorted((synth_data / split).iterdir()):
            for src in sorted(cls_dir.iterdir())[:40 if cls_dir.name == "ok" else 12]:
                dst = root / to / f"{n:05d}.png"
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dst)
                with Image.open(src) as im:
                    size = im.size
                m = np.zeros(size[::-1], np.uint8)
                if cls_dir.name != "ok":
                    m[size[1] // 3: size[1] // 2, size[0] // 3: size[0] // 2] = 255
                    test_defects += to == "test"
                Image.fromarray(m).save(root / to / f"{n:05d}_GT.png")
                n += 1
    work = tmp_path / "qs"
    proc = quickstart_data(dtrain_cmd, root, work, epochs=2)
    assert "labels from the photos' masks" in proc.stdout, proc.stdout
    assert "labels read from the masks (data.layout masklabels)" in proc.stdout, proc.stdout
    report = json.loads((work / "report.json").read_text())
    assert report["classes"] == ["defect", "ok"] and report["negative_class"] == "ok", report
    assert report["n_defective"] == test_defects and report["n_missed"] is not None, sorted(report)


@pytest.mark.parametrize("names,numbered", [(["kos01", "kos02"], True), (["Class1", "Class10"], True),
                                            (["part_3", "part-4"], True), (["crack", "ok"], False),
                                            (["kos01"], False), (["a1", "b2"], False), (["Class1", "ok"], False)])
def test_numbered_folder_names(names, numbered):
    from dtrain.recipe.stats import _numbered

    assert _numbered(names) is numbered
