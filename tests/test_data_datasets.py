"""Datasets: both layouts, bad files through real DataLoader workers, clear errors."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from dtrain.data.config import DataConfig
from dtrain.data.datasets import collate_skip_bad, open_split
from dtrain.data.synth import CLASSES
from dtrain.data.transforms import MEAN, STD, normalize_batch, preprocess_image
from dtrain.errors import DtrainError


def test_imagefolder_split_has_classes_labels_and_uint8_images(synth_data):
    cfg = DataConfig(root=str(synth_data), image_size=32)
    ds = open_split(cfg, "val", train=False)
    assert ds.classes == sorted(CLASSES)
    assert ds.classes[ds.negative_index] == "ok"
    assert len(ds) == len(ds.paths) == len(ds.targets) == len(list((synth_data / "val").rglob("*.png")))
    for i in (0, len(ds) - 1):
        img, label = ds[i]
        assert img.dtype == torch.uint8 and img.shape == (3, 32, 32)
        assert label == ds.targets[i] and Path(ds.paths[i]).parent.name == ds.classes[label]
    assert sorted(set(ds.targets)) == list(range(len(CLASSES)))


def test_resize_and_augmentation_keep_uint8(synth_data):
    cfg = DataConfig(root=str(synth_data), image_size=40)
    plain = open_split(cfg, "train", train=False)
    aug = open_split(cfg, "train", train=True)
    assert torch.equal(plain[3][0], plain[3][0])
    torch.manual_seed(0)
    seen = {aug[3][0].numpy().tobytes() for _ in range(12)}
    assert len(seen) > 1  # flips / rotations / jitter actually happen
    img = aug[3][0]
    assert img.dtype == torch.uint8 and img.shape == (3, 40, 40)
    assert open_split(cfg.model_copy(update={"augment": False}), "train", train=True).transform is None


def _mvtec_tree(src: Path, dst: Path) -> Path:
    """A small MVTec-AD shaped tree made of synthetic images."""
    base = dst / "metal_plate"
    pick = {"train/good": ("train", "ok", 12), "test/good": ("test", "ok", 10), "test/scratch": ("test", "scratch", 7), "test/crack": ("test", "crack", 6)}
    for sub, (split, cls, n) in pick.items():
        (base / sub).mkdir(parents=True)
        for p in sorted((src / split / cls).glob("*.png"))[:n]:
            shutil.copy(p, base / sub / f"{p.stem[-3:]}.png")
    (base / "ground_truth" / "scratch").mkdir(parents=True)  # ignored, as in MVTec
    (dst / "other_part" / "test" / "good").mkdir(parents=True)
    return base


def test_mvtec_layout_carves_a_seeded_val_split(synth_data, tmp_path):
    _mvtec_tree(synth_data, tmp_path)
    cfg = DataConfig(root=str(tmp_path), layout="mvtec", category="metal_plate", image_size=32, mvtec_val_fraction=0.3)
    train, val, test = (open_split(cfg, s, train=False) for s in ("train", "val", "test"))
    assert train.classes == ["crack", "good", "scratch"]
    assert train.classes[train.negative_index] == "good"  # "ok" (the default) is a synonym
    assert set(train.targets) == {1} and len(train) == 12
    assert not set(val.paths) & set(test.paths)
    assert len(val) + len(test) == 23 and len(val) == 3 + 2 + 2
    again = open_split(cfg, "val", train=False)
    assert again.paths == val.paths
    other = open_split(cfg.model_copy(update={"split_seed": 1}), "val", train=False)
    assert other.paths != val.paths and len(other) == len(val)
    img, _ = val[0]
    assert img.shape == (3, 32, 32)


def test_empty_val_split_means_no_validation_split(synth_data, tmp_path):
    """val_split "" must not make ROOT itself a split (its train/val/test folders classes)."""
    cfg = DataConfig(root=str(synth_data), image_size=32, val_split="")
    train = open_split(cfg, "train", train=False)
    assert train.classes == sorted(CLASSES)
    assert train.paths == open_split(DataConfig(root=str(synth_data), image_size=32), "train", train=False).paths
    _mvtec_tree(synth_data, tmp_path)
    mv = DataConfig(root=str(tmp_path), layout="mvtec", category="metal_plate", val_split="")
    test = open_split(mv, "test", train=False)
    # val is still carved out of test, only not read: a k-fold final model trained on it, and `dtrain eval`
    # reads the set without val, so its test must be the one the recipe held out
    assert test.paths == open_split(mv.model_copy(update={"val_split": "val"}), "test", train=False).paths
    assert len(test) == 23 - (round(10 * 0.3) + round(7 * 0.3) + round(6 * 0.3))
    assert test.classes == ["crack", "good", "scratch"]


def test_mvtec_train_fraction_moves_defects_into_train_without_overlap(synth_data, tmp_path):
    _mvtec_tree(synth_data, tmp_path)
    cfg = DataConfig(root=str(tmp_path), layout="mvtec", category="metal_plate", mvtec_train_fraction=0.5, negative_class="good")
    parts = [set(open_split(cfg, s, train=False).paths) for s in ("train", "val", "test")]
    assert sum(map(len, parts)) == len(set.union(*parts)) == 12 + 23
    train = open_split(cfg, "train", train=False)
    assert {train.classes[t] for t in train.targets} == {"good", "scratch", "crack"}


def test_mvtec_without_category_lists_the_categories(synth_data, tmp_path):
    _mvtec_tree(synth_data, tmp_path)
    with pytest.raises(DtrainError) as err:
        open_split(DataConfig(root=str(tmp_path), layout="mvtec"), "test", train=False)
    assert "metal_plate" in str(err.value) and "other_part" in str(err.value)


def test_classfolders_layout_splits_every_class_by_the_shares_seeded(class_folders_data, tmp_path):
    counts = {d.name: len(list(d.iterdir())) for d in class_folders_data.iterdir()}
    for name in counts:  # the fixture is read-only: a root of links to its class folders
        (tmp_path / "flat" / name).mkdir(parents=True)
        for image in (class_folders_data / name).iterdir():
            (tmp_path / "flat" / name / image.name).symlink_to(image)
    (tmp_path / "flat" / "notes").mkdir()  # a folder without images is not a class
    cfg = DataConfig(root=str(tmp_path / "flat"), layout="classfolders", image_size=32)
    splits = {s: open_split(cfg, s, train=False) for s in ("train", "val", "test")}
    assert all(ds.classes == sorted(counts) for ds in splits.values())
    parts = [set(ds.paths) for ds in splits.values()]
    assert sum(map(len, parts)) == len(set.union(*parts)) == sum(counts.values())  # disjoint, nothing lost
    for i, name in enumerate(sorted(counts)):
        n_val = sum(t == i for t in splits["val"].targets)
        n_test = sum(t == i for t in splits["test"].targets)
        assert n_val == round(counts[name] * 0.2) and n_test == round(counts[name] * 0.2)  # stratified per class
    assert open_split(cfg, "val", train=False).paths == splits["val"].paths
    reseeded = open_split(cfg.model_copy(update={"split_seed": 1}), "val", train=False)
    assert reseeded.paths != splits["val"].paths and len(reseeded) == len(splits["val"])
    shares = open_split(cfg.model_copy(update={"split_fractions": (0.5, 0.5, 0.0)}), "test", train=False)
    assert len(shares) == 0
    with pytest.raises(ValueError, match="sum to 1"):
        DataConfig(layout="classfolders", split_fractions=(0.6, 0.3, 0.3))
    img, _ = splits["train"][0]
    assert img.shape == (3, 32, 32)


def test_val_carved_from_train_when_there_is_no_val_folder(synth_data, tmp_path):
    root = tmp_path / "data"
    for split in ("train", "test"):
        shutil.copytree(synth_data / split, root / split)
    (root / "val" / "ghost").mkdir(parents=True)  # with val carved out of train, never read
    cfg = DataConfig(root=str(root), image_size=32, val_from_train=0.25)
    train, val, test = (open_split(cfg, s, train=False) for s in ("train", "val", "test"))
    assert train.classes == val.classes == test.classes == sorted(CLASSES)
    whole = open_split(cfg.model_copy(update={"val_from_train": 0.0}), "train", train=False)
    assert not set(train.paths) & set(val.paths) and set(train.paths) | set(val.paths) == set(whole.paths)
    assert abs(len(val) - 0.25 * len(whole)) <= len(CLASSES)
    assert test.paths == open_split(cfg.model_copy(update={"val_from_train": 0.0}), "test", train=False).paths


def test_train_and_a_val_folder_only_the_val_folder_is_test(synth_data, tmp_path):
    """train/ + valid/ (no test/), as detect_layout reads it: valid/ is the test split, val is
    carved out of train, and the carved split's name reads no folder, not even one called that."""
    from dtrain.recipe.stats import detect_layout

    root = tmp_path / "data"
    shutil.copytree(synth_data / "train", root / "train")
    shutil.copytree(synth_data / "val", root / "valid")
    cfg = DataConfig(root=str(root), image_size=32, **detect_layout(root))
    train, val, test = (open_split(cfg, s, train=False) for s in (cfg.train_split, cfg.val_split, cfg.test_split))
    assert cfg.test_split == "valid" and train.classes == val.classes == test.classes == sorted(CLASSES)
    assert sorted(Path(p).relative_to(root / "valid") for p in test.paths) == sorted(
        p.relative_to(synth_data / "val") for p in (synth_data / "val").rglob("*.png"))
    from_train = {str(p.relative_to(synth_data / "train")) for p in (synth_data / "train").rglob("*.png")}
    assert not set(train.paths) & set(val.paths)
    assert {str(Path(p).relative_to(root / "train")) for p in train.paths + val.paths} == from_train


def test_a_missing_split_folder_names_the_classfolders_layout(class_folders_data):
    with pytest.raises(DtrainError, match="split 'train' not found") as err:
        open_split(DataConfig(root=str(class_folders_data), image_size=32), "train", train=False)
    assert "data.layout=classfolders" in err.value.hint


def _corrupt_copy(synth_data: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "data"
    shutil.copytree(synth_data / "val", root / "val")
    truncated = root / "val" / "dent" / "zz_truncated.png"
    data = (synth_data / "val" / "dent").glob("*.png").__next__().read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    not_an_image = root / "val" / "ok" / "zz_text.png"
    not_an_image.write_text("this is not a png")
    return root, sorted([str(truncated), str(not_an_image)])


@pytest.mark.parametrize("cache_decoded", [False, True])
def test_corrupt_images_are_reported_and_skipped_through_worker_processes(synth_data, tmp_path, cache_decoded):
    root, bad = _corrupt_copy(synth_data, tmp_path)
    ds = open_split(DataConfig(root=str(root), image_size=32, cache_decoded=cache_decoded), "val", train=True)
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, collate_fn=collate_skip_bad)
    seen = 0
    for epoch in range(2):
        for images, labels in loader:
            assert images.dtype == torch.uint8 and labels.dtype == torch.int64
            assert images.shape[0] == labels.shape[0] and images.shape[1:] == (3, 32, 32)
            seen += images.shape[0]
    assert seen == 2 * (len(ds) - 2)
    assert sorted(ds.bad_files) == bad
    assert "zz_text.png" in "".join(ds.bad_reasons)


def test_unreadable_files_with_awkward_names_are_reported_by_their_exact_names(synth_data, tmp_path):
    """A name may hold a newline or a tab, or bytes that are not UTF-8 (a Windows zip unpacked
    here: Python keeps them as surrogates, which a UTF-8 write refused, so reporting the
    file stopped the loader)."""
    root, _ = _corrupt_copy(synth_data, tmp_path)
    folder = os.fsencode(root / "val" / "ok")
    for name in (b"new\nline.png", b"tab\tbed.png", b"d\xe9faut.png"):
        with open(folder + b"/" + name, "wb") as f:
            f.write(b"not a png")
    odd = sorted(os.fsdecode(folder + b"/" + n) for n in (b"new\nline.png", b"tab\tbed.png", b"d\xe9faut.png"))
    ds = open_split(DataConfig(root=str(root), image_size=32, cache_decoded=False), "val", train=False)
    loader = DataLoader(ds, batch_size=64, num_workers=2, collate_fn=collate_skip_bad)
    assert sum(images.shape[0] for images, _ in loader) == len(ds) - 5
    assert set(odd) <= set(ds.bad_files) and len(ds.bad_files) == 5
    assert "ImageRefused" in ds.bad_reasons[odd[0]]


def test_a_class_folder_named_in_bytes_that_are_not_utf8_is_refused_up_front(synth_data, class_folders_data, tmp_path):
    """A class name is text in every report, plot, exported model and answer of the service;
    the old code trained and then failed in the report's plots (matplotlib refuses a
    surrogate), after the whole run."""
    root = tmp_path / "split"
    shutil.copytree(synth_data, root)
    for split in ("train", "val", "test"):
        os.rename(os.fsencode(root / split / "pit"), os.fsencode(root / split) + b"/piq\xfbre")
    with pytest.raises(DtrainError, match=r"the class name b'piq\\xfbre' in .* is not UTF-8 text") as err:
        open_split(DataConfig(root=str(root), image_size=32), "train", train=True)
    assert "convmv -f cp1252 -t utf8" in err.value.hint
    flat = tmp_path / "flat"
    shutil.copytree(class_folders_data, flat, symlinks=True)
    os.rename(os.fsencode(flat / "dent"), os.fsencode(flat) + b"/\xb0dent")
    with pytest.raises(DtrainError, match="is not UTF-8 text"):
        open_split(DataConfig(root=str(flat), layout="classfolders", image_size=32), "val", train=False)


def test_collate_of_only_bad_samples_is_an_empty_batch():
    images, labels = collate_skip_bad([None, None])
    assert images.shape[0] == 0 and labels.shape == (0,) and labels.dtype == torch.int64


def test_missing_data_directory_names_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "nowhere" / "defects"
    with pytest.raises(DtrainError) as err:
        open_split(DataConfig(root=str(missing)), "train", train=True)
    assert str(missing) in err.value.message
    assert "dtrain data synth" in err.value.hint


def test_missing_split_and_unknown_negative_class(synth_data, tmp_path):
    shutil.copytree(synth_data / "train", tmp_path / "train")
    with pytest.raises(DtrainError, match="split 'val' not found"):
        open_split(DataConfig(root=str(tmp_path)), "val", train=False)
    with pytest.raises(DtrainError, match="negative class 'fine'"):
        open_split(DataConfig(root=str(tmp_path), negative_class="fine"), "train", train=False)


def test_normalize_batch_matches_the_reference_formula():
    batch = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    ref = (batch.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    out = normalize_batch(batch, channels_last=True)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert normalize_batch(batch, channels_last=False).is_contiguous()


def test_preprocess_image_matches_the_evaluation_pipeline(synth_data):
    ds = open_split(DataConfig(root=str(synth_data), image_size=48), "test", train=False)
    path = ds.paths[5]
    expected = ds[5][0]
    pil = Image.open(path)
    array = np.asarray(pil.convert("RGB"))
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    bmp = io.BytesIO()
    pil.save(bmp, format="BMP")  # not a torchvision codec: decoded by Pillow
    for source in (pil, array, torch.from_numpy(array.copy()), buf.getvalue(), path, bmp.getvalue()):
        out = preprocess_image(source, 48)
        assert out.dtype == torch.uint8 and out.shape == (3, 48, 48)
        assert torch.equal(out, expected), type(source)
    grey = preprocess_image(pil.convert("L"), 48)
    assert grey.shape == (3, 48, 48) and torch.equal(grey[0], grey[2])


def test_cache_decoded_serves_the_same_pixels(synth_data):
    cfg = DataConfig(root=str(synth_data), image_size=24)
    plain = open_split(cfg, "test", train=False)
    cached = open_split(cfg.model_copy(update={"cache_decoded": True}), "test", train=False)
    assert len(plain) == len(cached)
    for i in range(0, len(plain), 7):
        assert torch.equal(plain[i][0], cached[i][0]) and plain[i][1] == cached[i][1]


def test_augmentation_brightness_contrast_agrees_with_torchvision_within_rounding():
    from torchvision.transforms.v2 import functional as F

    from dtrain.data.transforms import InspectionAugment

    img = torch.randint(30, 220, (3, 16, 16), dtype=torch.uint8)
    aug = InspectionAugment(0.1, 0.1)
    for fb, fc in ((0.93, 1.08), (1.1, 0.9), (1.0, 1.0), (0.9, 0.95)):
        ours = aug.transform(img, {"k": 0, "flip": False, "fb": fb, "fc": fc})
        ref = F.adjust_contrast(F.adjust_brightness(img, fb), fc)
        assert ours.dtype == torch.uint8
        assert (ours.int() - ref.int()).abs().max() <= 2


def test_augmentation_covers_all_eight_orientations_and_keeps_colour():
    from dtrain.data.transforms import InspectionAugment

    img = torch.arange(3 * 4 * 4, dtype=torch.uint8).reshape(3, 4, 4) * 5
    aug = InspectionAugment(0.0, 0.0)
    torch.manual_seed(0)
    seen = {aug(img).numpy().tobytes() for _ in range(200)}
    assert len(seen) == 8
    coloured = torch.zeros(3, 8, 8, dtype=torch.uint8)
    coloured[0], coloured[1], coloured[2] = 180, 120, 60  # rust-like
    out = InspectionAugment(0.1, 0.1)(coloured).float()
    assert out[0].mean() > out[1].mean() > out[2].mean()


def test_augmentation_shift_moves_a_defect_within_its_bound():
    from dtrain.data.transforms import InspectionAugment

    img = torch.full((3, 32, 32), 100, dtype=torch.uint8)
    img[:, 15, 16] = 250  # one bright pixel: where it lands says how far the picture moved
    aug = InspectionAugment(0.0, 0.0, shift=0.125)  # up to 4 px each way at 32 px
    torch.manual_seed(0)
    moves = set()
    for _ in range(300):
        out = aug(img)
        assert out.shape == img.shape and out.dtype == torch.uint8
        # Undo the symmetry: the dark edge is a full row or column on one of the four sides.
        (y,), (x,) = [t.unique() for t in torch.nonzero(out[0] == 250, as_tuple=True)]
        moves.add((int(y), int(x)))
        assert (out[0] == 100).sum() == 32 * 32 - 1  # the mirrored border is the part's own surface
    # Every landing spot is within 4 px of the centre (under any of the 8 symmetries), and there are many.
    assert len(moves) > 30
    assert all(11 <= y <= 20 and 11 <= x <= 20 for y, x in moves)
    # Without a shift, the same seed draws the same 4 numbers as before the option existed.
    torch.manual_seed(1)
    plain = InspectionAugment(0.1, 0.1)(img)
    torch.manual_seed(1)
    assert torch.equal(plain, InspectionAugment(0.1, 0.1, shift=0.0)(img))
    with pytest.raises(ValueError, match="shift"):
        InspectionAugment(0.1, 0.1, shift=0.5)


def test_shift_mirrors_the_uncovered_border():
    from dtrain.data.transforms import _shift

    row = torch.arange(8, dtype=torch.float32).expand(1, 8, 8)
    moved = _shift(row, 0.25, 1.0, 0.0)  # 2 px to the right
    assert moved[0, 0].tolist() == [2, 1, 0, 1, 2, 3, 4, 5]
    assert torch.equal(_shift(row, 0.25, 0.0, 0.0), row)
