"""Long pictures keep their proportions (DataConfig.image_width): the recipe decides a
rectangle, training augments it by the rectangle's symmetries, upright pictures are turned
a quarter the same way in training and in the torch-free runtime, and a wide model trains,
exports and inspects end to end."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from shared_once import once

from tests.quickstart_helpers import quickstart_data


def _strips(src: Path, root: Path) -> None:
    """Every synth_data picture (32 px) beside two defect-free ones of its split: 32 x 96 px
    strips, labelled by the picture, which sits left, middle or right. Upright copies of a few
    test strips (turned a quarter clockwise) go to root/upright, outside the data set."""
    for split in ("train", "val", "test"):
        ok = sorted((src / split / "ok").glob("*.png"))
        for cls_dir in sorted((src / split).iterdir()):
            (root / split / cls_dir.name).mkdir(parents=True)
            for i, p in enumerate(sorted(cls_dir.glob("*.png"))):
                tiles = [np.asarray(Image.open(ok[(3 * i + j) % len(ok)]).convert("RGB")) for j in (1, 2)]
                tiles.insert(i % 3, np.asarray(Image.open(p).convert("RGB")))
                strip = np.concatenate(tiles, axis=1)
                Image.fromarray(strip).save(root / split / cls_dir.name / p.name)
                if split == "test" and i < 4:
                    (root / "upright").mkdir(exist_ok=True)
                    Image.fromarray(np.ascontiguousarray(np.rot90(strip, -1))).save(root / "upright" / f"{cls_dir.name}_{p.name}")


@pytest.fixture(scope="module")
def strips(synth_data, tmp_path_factory) -> Path:
    return once(tmp_path_factory, "wide_strips", lambda root: _strips(synth_data, root))


def test_an_upright_picture_is_turned_alike_in_training_and_in_the_runtime(strips):
    from dtrain.data.transforms import preprocess_image, read_image
    from dtrain.serve.images import prepare_file

    upright = sorted((strips / "upright").glob("*.png"))[0]
    cls, _, name = upright.name.partition("_")
    wide = strips / "test" / cls / name
    assert read_image(upright).shape[-2:] == (96, 32)
    for size in ((32, 96), (24, 64)):
        torch_path = preprocess_image(upright, size)
        assert torch_path.shape == (3, *size)
        assert torch.equal(torch_path, preprocess_image(wide, size))  # turned back exactly, then resized alike
        assert np.abs(prepare_file(upright, size).astype(int) - torch_path.numpy().astype(int)).max() <= 1
    # a square input squashes it as before, whatever its orientation
    assert preprocess_image(upright, 32).shape == (3, 32, 32)


def test_the_cached_dataset_holds_rectangles(strips):
    from dtrain.data.config import DataConfig
    from dtrain.data.datasets import open_split

    cfg = DataConfig(root=str(strips), image_size=32, image_width=96, cache_decoded=True, augment=True, shift=0.125)
    ds = open_split(cfg, "train", train=True)
    assert ds._cache is not None and tuple(ds._cache.shape[1:]) == (3, 32, 96)
    torch.manual_seed(0)
    assert {tuple(ds[i][0].shape) for i in range(40)} == {(3, 32, 96)}


def test_the_augmentation_draws_the_rectangles_four_symmetries_only():
    from dtrain.data.transforms import InspectionAugment

    img = torch.arange(2 * 3, dtype=torch.uint8).reshape(1, 2, 3).expand(3, -1, -1).contiguous() * 40
    aug = InspectionAugment(brightness=0.0, contrast=0.0)
    seen = set()
    torch.manual_seed(0)
    for _ in range(200):
        out = aug(img)
        assert out.shape == img.shape
        seen.add(tuple(out[0].flatten().tolist()))
    expected = {tuple(t[0].flatten().tolist()) for t in (img, img.flip(-1), img.flip(-2), img.flip(-1, -2))}
    assert seen == expected


def test_views_of_a_rectangle_stop_at_four():
    from dtrain.models.views import ViewAverage, views

    x = torch.randn(2, 3, 8, 16)
    assert [tuple(v.shape) for v in views(x, 4)] == [(2, 3, 8, 16)] * 4
    with pytest.raises(ValueError, match="square input"):
        views(x, 8)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    assert ViewAverage(net, 4)(x).shape == (2, 4)


def test_the_config_refuses_a_tall_input_and_eight_views_of_a_rectangle():
    from pydantic import ValidationError

    from dtrain.data.config import DataConfig
    from dtrain.train.config import TrainConfig

    with pytest.raises(ValidationError, match="long side runs across"):
        DataConfig(image_size=96, image_width=32)
    assert DataConfig(image_size=64, image_width=64).image_width is None  # a square, said once
    with pytest.raises(ValidationError, match="needs a square input"):
        TrainConfig.model_validate({"data": {"image_size": 32, "image_width": 96}, "model": {"views": 8}})


def test_the_budget_prices_a_rectangle_by_its_pixels():
    from dtrain.recipe.budget import probe, probe_batch, scaled

    cost = scaled(3e-3, 64, lambda side: 3 * side)  # probed at 64 x 192
    assert cost(64) == pytest.approx(3e-3) and cost(128) == pytest.approx(12e-3)
    assert scaled(1e-3, 64)(128) == pytest.approx(4e-3)  # a square, as before
    assert probe_batch(320, 960) < probe_batch(320) == 16  # the probe's pixels per step stay capped
    net = {"arch": "small_resnet", "pool": "avgmax", "input_norm": "per_image"}
    assert 0 < probe(net, 32, 3, precision="fp32", ranks=1, batch=4, width=96) < 5


@pytest.mark.slow
def test_a_wide_set_trains_exports_and_inspects_as_rectangles(strips, tmp_path, dtrain_cmd, dtrain_home):
    work = tmp_path / "qs"
    proc = quickstart_data(dtrain_cmd, strips, work, epochs=2)
    assert "recipe: data.image_width = 96" in proc.stdout and "recipe: model.views = 4" in proc.stdout
    assert "timing a few training steps at 32 x 96 px" in proc.stdout  # the rectangle is probed as it trains
    cfg = yaml.safe_load((work / "train.yaml").read_text())
    assert (cfg["data"]["image_size"], cfg["data"]["image_width"]) == (32, 96)
    report = json.loads((work / "report.json").read_text())
    assert (report["image_size"], report["image_width"]) == (32, 96)

    model = tmp_path / "model"
    best = work / "train" / "checkpoints" / "best.pt"
    proc = subprocess.run([*dtrain_cmd, "export", str(best), "--out", str(model), "--format", "onnx", "--quantize", "none"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    card = json.loads((model / "model.json").read_text())
    assert (card["preprocessing"]["image_size"], card["preprocessing"]["image_width"]) == (32, 96)

    out = tmp_path / "verdicts.csv"
    proc = subprocess.run([*dtrain_cmd, "inspect", str(model), str(strips / "test"), str(strips / "upright"), "-o", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {str(Path(r["path"]).resolve()): r for r in csv.DictReader(out.open())}
    assert not [r for r in rows.values() if r["error"]]
    uprights = sorted((strips / "upright").glob("*.png"))
    assert len(uprights) >= 4
    for path in uprights:  # an upright copy is judged exactly as the wide strip it was turned from
        cls, _, name = path.name.partition("_")
        wide = rows[str((strips / "test" / cls / name).resolve())]
        assert float(rows[str(path.resolve())]["p_defect"]) == pytest.approx(float(wide["p_defect"]), abs=1e-4), path.name


def test_out_of_fold_scores_read_16_bit_images_as_the_model_was_trained(trained_checkpoint, synth_data, tmp_path):
    """recipe/oof.predict_held_out builds its own DataConfig: it must take the checkpoint's
    sample_bits (and input size) with it, as evaluation and export do (a 12-bit set's held-out
    parts were read by their high byte before)."""
    from dtrain.recipe.oof import HELD_OUT, predict_held_out
    from tests.image_fixtures import png16_of

    ckpt = torch.load(trained_checkpoint, map_location="cpu", weights_only=False)
    ckpt["config"]["data"]["sample_bits"] = 12
    twelve = tmp_path / "twelve.pt"
    torch.save(ckpt, twelve)
    folds = {}
    for name, bits in (("eight", 8), ("sixteen", 16)):
        for p in sorted((synth_data / "test").rglob("*.png"))[:12]:
            out = tmp_path / name / "src" / p.parent.name / p.name
            out.parent.mkdir(parents=True, exist_ok=True)
            grey = np.asarray(Image.open(p).convert("L"), dtype=np.uint16)
            if bits == 8:
                Image.fromarray(grey.astype(np.uint8)).save(out)
            else:
                out.write_bytes(png16_of(grey * 16 + 15))  # a 12-bit camera's values, as they come
            link = tmp_path / name / "fold" / HELD_OUT / p.parent.name / p.name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(out)
        folds[name] = predict_held_out(twelve, tmp_path / name / "fold")
    assert np.abs(folds["eight"].probs - folds["sixteen"].probs).max() < 1e-5
