"""Sets labelled by a table (owner: data): a CSV of file and class, as a plant's database or a
labelling tool exports it and as VisA ships `split_csv/1cls.csv` (object, split, label, image,
mask). The columns are found by what they hold; what the table cannot say is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dtrain.data.config import DataConfig
from dtrain.data.layouts import scan
from dtrain.errors import DtrainError
from dtrain.recipe.decide import notes
from dtrain.recipe.stats import detect_layout, gather


def _photo(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 48), dtype=np.uint8)).save(path)


def _splits(root: Path, fields: dict) -> list:
    cfg = DataConfig(root=str(root), image_size=32, **fields)
    return [scan(cfg, s) for s in (cfg.train_split, cfg.val_split, cfg.test_split)]


def _labels(listings) -> dict[str, str]:
    out: dict[str, str] = {}
    for listing in listings:
        assert not set(out) & set(listing.paths)  # no photo in two splits
        out.update((p, listing.classes[t]) for p, t in zip(listing.paths, listing.targets))
    return out


def test_a_table_of_files_and_classes_labels_the_photos_and_splits_them_per_class(tmp_path):
    truth = {}
    lines = ["file;defect type;operator note"]  # ';' and a free-text column, as a spreadsheet exports it
    for i in range(30):
        label = "ok" if i % 3 else "scratch"
        _photo(tmp_path / "images" / f"p{i:03d}.png", i)
        truth[str(tmp_path / "images" / f"p{i:03d}.png")] = label
        where = tmp_path / "images" if i == 0 else "./images" if i == 1 else "images"  # absolute, ./, plain
        lines.append(f"{where}/p{i:03d}.png;{label};checked by shift {i}")
    _photo(tmp_path / "images" / "unlabelled.png", 99)
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    fields = detect_layout(tmp_path)
    assert fields == {"layout": "csvlabels", "labels_file": "labels.csv"}
    listings = _splits(tmp_path, fields)
    assert _labels(listings) == truth
    assert listings[0].classes == ["ok", "scratch"] and listings[0].negative_index == 0
    said = " ".join(notes(gather(DataConfig(root=str(tmp_path), image_size=32, **fields))))
    assert "1 images under the data folder are not in the label table" in said and "unlabelled.png" in said


def test_a_visa_shaped_table_with_split_and_mask_columns(tmp_path):
    truth, lines = {}, ["object,split,label,image,mask"]
    for i in range(24):
        label = "anomaly" if i % 4 == 0 else "normal"
        folder = "Anomaly" if label == "anomaly" else "Normal"
        image = f"candle/Data/Images/{folder}/{i:03d}.JPG"
        _photo(tmp_path / image, i)
        mask = ""
        if label == "anomaly":
            mask = f"candle/Data/Masks/Anomaly/{i:03d}.png"
            m = np.zeros((40, 48), np.uint8)
            m[3:9, 3:9] = 255
            (tmp_path / mask).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(m).save(tmp_path / mask)
        split = "test" if i >= 16 else "train"
        lines.append(f"candle,{split},{label},{image},{mask}")
        truth[str(tmp_path / image)] = (label, split)
    (tmp_path / "split_1cls.csv").write_text("\n".join(lines) + "\n")
    fields = detect_layout(tmp_path)
    assert fields == {"layout": "csvlabels", "labels_file": "split_1cls.csv", "val_from_train": 0.25}
    train, val, test = _splits(tmp_path, fields)
    got = _labels([train, val, test])
    assert got == {p: label for p, (label, _) in truth.items()}
    assert sorted(test.paths) == sorted(p for p, (_, split) in truth.items() if split == "test")
    assert len(val.paths) == 4 and train.classes[train.negative_index] == "normal"


def test_split_folders_and_a_table_without_a_header(tmp_path):
    lines = []
    for split in ("train", "test"):
        for i in range(12):
            name = f"{split}_{i}.png"
            _photo(tmp_path / split / name, hash(name) % 1000)
            lines.append(f"{name},{'bad' if i % 4 == 0 else 'good'}")
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    fields = detect_layout(tmp_path)
    assert fields == {"layout": "csvlabels", "labels_file": "labels.csv", "val_from_train": 0.25}
    train, val, test = _splits(tmp_path, fields)
    assert len(_labels([train, val, test])) == 24  # the first line is a photo too
    assert all("/test/" in p for p in test.paths) and len(test.paths) == 12
    assert train.classes == ["bad", "good"] and train.classes[train.negative_index] == "good"


@pytest.mark.parametrize("rows,said", [
    (["file,label", "a.png,ok", "a.png,dent"], "lists a.png twice, as 'ok' and 'dent'"),
    (["file,label", "a.png,ok", "gone.png,dent"], "lists 1 files that are not under"),
    (["file,split,label", "a.png,train,ok", "a.png,test,ok"], "lists a.png twice, in the train and the test split"),
    (["id,label", "1,ok", "2,dent"], "no column of"),
    (["file,label", "a.png,ok,extra"], "same number"),
    (["file,label", "a.png,ok", 'a.png,"' + "x" * 200_000 + '"'], "cannot be read as CSV: field larger than field limit"),
])
def test_what_a_table_cannot_say_is_refused(tmp_path, rows, said):
    _photo(tmp_path / "a.png", 0)
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(DtrainError) as err:
        _splits(tmp_path, {"layout": "csvlabels"})
    assert said in err.value.message


def test_a_table_saved_by_a_windows_spreadsheet_is_read(tmp_path):
    for i in range(2):
        _photo(tmp_path / f"a{i}.png", i)
    (tmp_path / "labels.csv").write_bytes("file;label\na0.png;défaut\na1.png;ok\n".encode("cp1252"))
    listing = scan(DataConfig(root=str(tmp_path), layout="csvlabels", split_fractions=(1.0, 0.0, 0.0)), "train")
    assert listing.classes == ["défaut", "ok"] and len(listing.paths) == 2


def test_class_folders_beside_a_stray_table_stay_class_folders(tmp_path):
    for name in ("crack", "ok"):
        for i in range(4):
            _photo(tmp_path / name / f"{i}.png", i)
    (tmp_path / "results.csv").write_text("file,label\ncrack/0.png,ok\n")
    assert detect_layout(tmp_path) == {"layout": "classfolders"}
