"""`dtrain data synth --profile plant`: sizes, grey and colour parts, OK-heavy with rare
classes, small local defects, several on one part, deterministic bytes."""

from __future__ import annotations

import json
import subprocess

import numpy as np
from PIL import Image

from dtrain.data import synth_plant as plant
from dtrain.data.synth import CLASSES, PROFILES, plan_counts, synthesize
from dtrain.data.synth_surface import blank_canvas


def test_default_counts_are_ok_heavy_with_rare_classes():
    counts = plan_counts(plant.IMAGES, (0.6, 0.2, 0.2), plant.OK_FRACTION, plant.class_weights)
    train = counts["train"]
    assert abs(train["ok"] / sum(train.values()) - 0.85) < 0.01
    rare = sorted(train[name] for name in CLASSES[1:])[:2]
    assert all(20 <= n <= 40 for n in rare), train
    assert max(train[name] for name in CLASSES[1:]) >= 2 * min(rare)


def test_sides_cameras_and_determinism(tmp_path):
    for name in ("a", "b"):
        synthesize(tmp_path / name, images=60, size=96, seed=3, profile="plant", workers=1)
    files = sorted((tmp_path / "a").rglob("*.png"))
    assert all(f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes() for f in files)
    # The profile writes a mask beside every defective picture, and only there.
    pictures = [f for f in files if not f.stem.endswith("_mask")]
    masks = {f.name for f in files} - {f.name for f in pictures}
    assert len(pictures) == 60
    assert masks == {f"{f.stem}_mask.png" for f in pictures if f.parent.name != "ok"} and masks
    modes, sides = set(), set()
    for f in pictures:
        with Image.open(f) as im:
            modes.add(im.mode)
            assert im.width == im.height and 48 <= im.width <= 96
            sides.add(im.width)
    assert modes == {"L", "RGB"} and len(sides) > 5
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["profile"] == "plant" and manifest["size"] == 96 and manifest["ok_fraction"] == 0.85
    assert "most severe" in manifest["label_rule"]


def test_defects_are_small_and_local():
    changed = []
    for cls in range(1, len(CLASSES)):
        for number in range(2):
            args = (0, 0, cls, number, 256, 0.0)
            with_it = plant.render_plant_image(*args).astype(np.int16)
            without = plant.render_plant_image(*args, with_defect=False).astype(np.int16)
            diff = np.abs(with_it - without).reshape(with_it.shape[0], with_it.shape[1], -1).max(axis=2)
            assert diff.max() >= 12, (CLASSES[cls], number, diff.max())
            changed.append((diff > 6).mean())
    # A defect window is at most 55 % of the side: ~30 % of the picture, and mostly far less.
    assert max(changed) < 0.3 and np.median(changed) < 0.05


def test_stamp_fades_out_at_its_window_border():
    rng = np.random.default_rng(0)
    c = blank_canvas(200)
    plant.stamp(rng, c, "stain", 1.0)
    touched = np.abs(c.albedo - 1) > 1e-6
    ys, xs = np.nonzero(touched)
    assert touched.any() and touched.mean() < 0.3
    # The picture's outermost changed pixels change by almost nothing: no straight cut.
    edge = np.concatenate([np.abs(c.albedo[ys.min(), :] - 1), np.abs(c.albedo[:, xs.min()] - 1)])
    assert edge.max() < 0.02


def test_the_label_is_the_most_severe_defect():
    parts = [plant.defects_on_part(np.random.default_rng(k), CLASSES[1 + k % 5], 0.7) for k in range(400)]
    multi = [p for p in parts if len(p) == 2]
    assert all(p[0][0] == CLASSES[1 + k % 5] for k, p in enumerate(parts))
    assert 0.15 < len(multi) / len(parts) < 0.35
    assert all(second != first and v2 < v1 for (first, v1), (second, v2) in multi)


def test_cli_plant_profile(tmp_path, dtrain_cmd):
    out = tmp_path / "plant"
    done = subprocess.run(dtrain_cmd + ["data", "synth", str(out), "--profile", "plant", "--images", "40", "--size", "64"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "40 images of 32-64 px (plant profile)" in done.stdout
    pictures = [f for f in out.rglob("*.png") if not f.stem.endswith("_mask")]
    assert len(pictures) == 40 and sum(1 for _ in out.rglob("*_mask.png")) == sum(f.parent.name != "ok" for f in pictures)
    plain = subprocess.run(dtrain_cmd + ["data", "synth", str(tmp_path / "plain"), "--profile", "plant", "--images", "40",
                                         "--size", "64", "--no-masks"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert sum(1 for _ in (tmp_path / "plain").rglob("*.png")) == 40
    assert "masks" not in json.loads((tmp_path / "plain" / "manifest.json").read_text())
    bad = subprocess.run(dtrain_cmd + ["data", "synth", str(tmp_path / "x"), "--profile", "fab"], capture_output=True, text=True)
    assert bad.returncode != 0 and "quickstart, plant" in bad.stderr
    assert set(PROFILES) == {"quickstart", "plant"}
