"""The recipe for a user's own images: statistics -> TrainConfig fields with reasons,
and `dtrain quickstart --data ROOT` end to end (tiny)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml

from dtrain.configio import validate
from dtrain.data.config import DataConfig
from dtrain.data.layouts import scan
from dtrain.errors import DtrainError
from dtrain.quickstart import TRAIN, _merged
from dtrain.recipe import decide as D
from dtrain.recipe.stats import DataStats, detect_layout, gather
from dtrain.train.config import TrainConfig
from dtrain.train.trainer import loss_weights
from tests.quickstart_helpers import quickstart_data


def _stats(side=256, counts=None, val=None, grey=0.0, aspect=1.0, negative="ok") -> DataStats:
    counts = counts or {"ok": 1500, "scratch": 80, "pit": 30}
    return DataStats(
        classes=sorted(counts), negative_class=negative, train_counts=counts,
        val_counts=val if val is not None else {k: max(1, v // 3) for k, v in counts.items()},
        short_sides=[side] * 9, aspect_ratios=[aspect] * 9, grey_share=grey,
    )


# (native, input side): half the native side for the blocks; from 128 px of blocks the stem
# strides, and the input takes the pictures' own pixels (up to twice the blocks' side).
@pytest.mark.parametrize("native, side", [(32, 32), (64, 64), (190, 96), (200, 192), (512, 512), (1200, 640)])
def test_input_side_halves_native_within_bounds_and_never_upsamples(native, side):
    d = D.input_side(_stats(side=native))
    assert d.field == "data.image_size" and d.value == side and side <= native
    assert ("capped" in d.reason) == (native == 1200)
    assert ("the stem's stride" in d.reason) == (side >= D.STRIDED_STEM_FROM)


def test_larger_pictures_never_reach_the_blocks_smaller():
    """What the blocks see (input side / stem stride) grows with the pictures, and is half the
    native side (on the 32 px grid) up to the cap: a strided stem must not halve it a second time."""
    seen = []
    for native in range(32, 1300, 2):
        side = D.input_side(_stats(side=native)).value
        blocks = side // D.stem(side).value
        assert blocks >= min(native // D.SIDE_STEP * D.SIDE_STEP / 2, D.MAX_SIDE, native), native
        seen.append(blocks)
    assert seen == sorted(seen)


def test_wide_images_get_a_rectangle_of_their_proportions():
    wide = _stats(aspect=2.5)
    side = D.input_side(wide).value
    width = D.input_width(wide, side)
    assert width.field == "data.image_width" and width.value == round(side * 2.5 / 32) * 32 and "2.50:1" in width.reason
    assert "rectangle" in D.input_side(wide).reason
    assert D.input_width(_stats(aspect=1.2), side).value is None
    # most pictures, not a few, decide: 4 wide of 9 keep the square
    mixed = DataStats(**{**_stats().__dict__, "aspect_ratios": [3.0] * 4 + [1.0] * 5})
    assert D.aspect(mixed) is None and D.aspect(DataStats(**{**mixed.__dict__, "aspect_ratios": [3.0] * 5 + [1.0] * 4})) == 3.0
    # a near-square proportion still widens by one step (a rectangle is never silently a square)
    assert D.width_for(1.51, 64) == 96
    cfg = validate(TrainConfig, _merged(TRAIN, D.as_config(D.plan(wide) + [D.inference_views(10, 1e-3, 1800, square=False)])),
                   "recipe")
    assert cfg.data.input_hw == (side, width.value) and cfg.model.views == 4
    # the augmentation's reason counts the symmetries a rectangle keeps
    assert "(4 symmetries" in D.augmentation(wide)[0].reason and "(8 symmetries)" in D.augmentation(_stats())[0].reason


def test_rare_classes_are_drawn_more_often_and_named_in_a_note():
    sampling, weights = D.sampling(_stats())
    assert (sampling.field, sampling.value) == ("data.sampling", "sqrt_inverse") and "pit has 30" in sampling.reason
    assert weights.value == "none"
    assert [d.value for d in D.sampling(_stats(counts={"a": 100, "b": 60, "c": 40}))] == ["uniform", "none"]
    assert any("few training images" in n and "crack (12)" in n for n in D.notes(_stats(counts={"ok": 500, "crack": 12})))


def test_epochs_from_a_budget_of_images_seen():
    assert D.epochs(1800).value == 50  # 90000 / 1800
    assert D.epochs(600_000).value == D.MIN_EPOCHS
    assert D.epochs(150).value == D.MAX_EPOCHS
    # A wall-clock cut below the budget wins over MIN_EPOCHS (floor, at least 1).
    assert D.epochs(1800, 9000).value == 5 and D.epochs(600_000, 9000).value == 1
    assert "wall-clock" in D.epochs(1800, 9000).reason
    # 270 images, a budget of 41 518 seen: the epoch cap binds, and the reason says so
    capped = D.epochs(270, 41_518)
    assert capped.value == D.MAX_EPOCHS and "at most 100 epochs" in capped.reason and "wall-clock" not in capped.reason
    # A cut plan may be raised by the run towards the data's wish (not under k-fold: its runs train alike)
    assert D.max_epochs(1800, 5, kfold=False).value == 50
    assert D.max_epochs(1800, 50, kfold=False) is None and D.max_epochs(1800, 5, kfold=True) is None


def test_transplants_raise_the_epoch_cap_of_a_small_set():
    """With transplants each pass shows new composites: a small masked set may take up to
    MAX_EPOCHS_TRANSPLANTED passes (its images_seen budget still bounds it); a set without masks
    keeps MAX_EPOCHS, and a large set is bounded by the images-seen budget either way."""
    import dataclasses

    from dtrain.recipe import budget as B

    types = {"crack": 32, "dent": 54, "pit": 35, "scratch": 81, "stain": 68}  # 270, no defect-free class
    plain = _stats(counts=types, negative=None)
    masked = dataclasses.replace(plain, masked_defects=270)
    assert D.epoch_cap(plain) == D.MAX_EPOCHS < D.epoch_cap(masked) == D.MAX_EPOCHS_TRANSPLANTED
    by_field = lambda stats: {d.field: d for d in D.plan(stats)}  # noqa: E731
    assert by_field(plain)["epochs"].value == D.MAX_EPOCHS
    raised = by_field(masked)["epochs"]
    assert raised.value == min(D.MAX_EPOCHS_TRANSPLANTED, -(-D.BUDGET_IMAGES // 270)) > D.MAX_EPOCHS
    assert "transplants make each pass new" in raised.reason
    assert D.epochs(270, 41_518, cap=D.epoch_cap(masked)).value == 41_518 // 270  # the clock's cut, below the cap
    short = D.epochs(100, 41_518, cap=D.epoch_cap(masked))  # a budget short of BUDGET_IMAGES binds at the raised cap
    assert short.value == D.MAX_EPOCHS_TRANSPLANTED and "transplants make each pass new" in short.reason
    assert B.images_needed(270, D.epoch_cap(masked)) == 270 * D.MAX_EPOCHS_TRANSPLANTED
    assert D.max_epochs(270, 100, kfold=False, cap=D.epoch_cap(masked)).value == D.MAX_EPOCHS_TRANSPLANTED
    large = dataclasses.replace(_stats(), masked_defects=110)  # 1610 images: 56 passes buy the budget
    assert by_field(large)["epochs"].value == by_field(_stats())["epochs"].value == 56


def test_validation_and_negative_class_decisions():
    fields = {d.field: d.value for d in D.plan(_stats())}
    assert fields["val_every_epoch"] is True and fields["keep_best"] is True
    none = {d.field: d.value for d in D.plan(_stats(val={}, negative=None))}
    assert none["val_every_epoch"] is False and none["keep_best"] is False and none["data.negative_class"] is None
    augment, shift = D.augmentation(_stats(grey=1.0))
    assert "grey" in augment.reason and augment.value is True
    assert shift.field == "data.shift" and 0 < shift.value <= 0.25


def test_the_batch_fits_every_ranks_share_of_the_smallest_training_set():
    """A 50-image sample on 2 ranks: 25 each, under the 32 of a batch, and the loader drops a
    ragged batch: the old recipe's run refused to start ("no full step per epoch")."""
    assert D.batch_size(5000, 2).value == D.BATCH_SIZE
    small = D.batch_size(50, 2)
    assert small.value == 16 and "25 training images per rank" in small.reason
    assert D.batch_size(3, 2).value == 1 and D.batch_size(64, 2).value == 32 and D.batch_size(63, 2).value == 16
    tiny = {"ok": 40, "scratch": 6, "pit": 4}
    fields = {d.field: d.value for d in D.plan(_stats(counts=tiny), ranks=2)}
    assert fields["batch_size"] == 16  # 50 // 2 = 25
    # under k-fold a fold model learns from fewer images than the final one: its share decides
    kfold = {d.field: d.value for d in D.plan(_stats(counts=tiny), n_train=200, kfold=True, ranks=2, n_smallest=30)}
    assert kfold["batch_size"] == 8


def test_blends_of_images_only_without_a_defect_free_class():
    """A scratch blended into a good part is still a scratch: mixup only among defect types."""
    types = {d.field: d for d in D.plan(_stats(negative=None, counts={"crack": 300, "pit": 250}))}
    with_ok = {d.field: d for d in D.plan(_stats())}
    assert types["mixup_alpha"].value == D.MIXUP_ALPHA and "defect types only" in types["mixup_alpha"].reason
    assert with_ok["mixup_alpha"].value is None and "defect-free class" in with_ok["mixup_alpha"].reason
    cfg = validate(TrainConfig, _merged(TRAIN, D.as_config(list(types.values()))), "the recipe")
    assert cfg.mixup_alpha == D.MIXUP_ALPHA


def test_every_decision_is_a_trainconfig_field():
    decisions = D.plan(_stats())
    assert all(d.reason for d in decisions)
    cfg = validate(TrainConfig, _merged(TRAIN, D.as_config(decisions)), "the recipe")
    assert cfg.data.image_size == 256 and cfg.data.sampling == "sqrt_inverse" and cfg.keep_best
    assert cfg.model.input_norm == "per_image" and cfg.model.pool == "avgmax"
    assert cfg.data.augment and cfg.data.shift == D.SHIFT
    assert cfg.model.stem_stride == 2  # 256 px pictures: the blocks see 128 px


def test_the_stem_strides_only_when_the_data_wants_a_downscale_to_128_px_or_more():
    assert D.stem(D.STRIDED_STEM_FROM).value == 2 and D.stem(320).value == 2
    kept = D.stem(96)  # 192 px pictures: a strided stem would leave the blocks at 48 px
    assert kept.value == 1 and f"under {D.MIN_SIDE} px" in kept.reason
    # The data's side picks it, not the side the budget cut to: the probe timed that network.
    models = {d.field: d.value for d in D.network(128, wanted=192)}
    assert models["model.stem_stride"] == 2 and models["model.arch"] == "small_resnet"


def test_gather_reads_counts_sizes_and_colour(synth_data):
    from dtrain.data.config import DataConfig

    manifest = json.loads((synth_data / "manifest.json").read_text())
    stats = gather(DataConfig(root=str(synth_data)))
    assert stats.train_counts == manifest["counts"]["train"] and stats.val_counts == manifest["counts"]["val"]
    assert stats.negative_class == "ok" and set(stats.short_sides) == {32} and stats.grey_share == 0.0


def test_gather_finds_grey_images(tmp_path):
    from PIL import Image

    from dtrain.data.config import DataConfig

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("crazing", "pitted"):
            (tmp_path / split / cls).mkdir(parents=True)
            for k in range(3):
                grey = rng.integers(0, 255, (40, 60), dtype=np.uint8)
                img = Image.fromarray(grey) if k else Image.fromarray(np.stack([grey] * 3, axis=2))  # grey stored as RGB
                img.save(tmp_path / split / cls / f"{k}.png")
    stats = gather(DataConfig(root=str(tmp_path)))
    assert stats.grey_share == 1.0 and stats.negative_class is None and stats.short_sides[0] == 40


@pytest.mark.parametrize(("top", "fmt", "bits"), [(4095, "PNG", 12), (4095, "TIFF", 12), (1500, "PNG", 12), (900, "PNG", 10),
                                                  (200, "TIFF", 8), (60000, "PNG", None)])
def test_16_bit_images_that_use_fewer_bits_set_sample_bits(tmp_path, top, fmt, bits):
    """A 12-bit camera's values stored as they come (0..4095) would keep 16 grey levels in
    the decoder's high byte: the recipe sets data.sample_bits to the camera depth their
    largest value needs (a dark sample's 11 bits round up to 12); values that fill the
    16 bits get no decision. The images then decode to the whole 8-bit range."""
    from PIL import Image

    from dtrain.data.config import DataConfig
    from dtrain.data.datasets import open_split
    from dtrain.recipe.decide import as_config, notes, plan

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("crazing", "pitted"):
            (tmp_path / split / cls).mkdir(parents=True)
            for k in range(3):
                values = rng.integers(0, top + 1, (40, 40), dtype=np.uint16)  # square: no resize below
                values[0, 0] = top
                Image.fromarray(values).save(tmp_path / split / cls / f"{k}.{fmt.lower()}", fmt)

    stats = gather(DataConfig(root=str(tmp_path)))
    decided = [d for d in plan(stats) if d.field == "data.sample_bits"]
    assert not [n for n in notes(stats) if "16-bit" in n]  # a decision now, not a note
    if bits is None:
        assert decided == []
        return
    assert [d.value for d in decided] == [bits]
    assert decided[0].reason.startswith(f"the 6 sampled 16-bit images use at most {int(top).bit_length()} bits")
    assert f"{2 ** (bits - 8)} of 256 grey levels" in decided[0].reason
    data = DataConfig(root=str(tmp_path), image_size=40, **{k: v for k, v in as_config(decided)["data"].items()})
    brightest = max(int(open_split(data, "train", train=False)[i][0].max()) for i in range(6))
    assert brightest == top >> (bits - 8)  # 4095 -> 255: the range is used


def test_16_bit_colour_tiff_gives_no_bits_decision(tmp_path):
    """Pillow reads a 16-bit colour TIFF's high bytes only: no evidence of the low ones, so
    no data.sample_bits (a decision from the high bytes would claim 4 bits)."""
    from dtrain.data.config import DataConfig
    from dtrain.data.decode import decode
    from dtrain.recipe.decide import plan
    from tests.image_fixtures import tiff16_rgb

    values = np.zeros((8, 8, 3), np.uint16)
    values[...] = (0x9A1, 0x123, 0xFFF)
    assert decode(tiff16_rgb(values))[:, 0, 0].tolist() == [0x09, 0x01, 0x0F]  # the high bytes
    for split in ("train", "val"):
        for cls in ("crazing", "pitted"):
            (tmp_path / split / cls).mkdir(parents=True)
            (tmp_path / split / cls / "a.tif").write_bytes(tiff16_rgb(values))
    stats = gather(DataConfig(root=str(tmp_path)))
    assert stats.deep_bits == [] and not [d for d in plan(stats) if d.field == "data.sample_bits"]


def test_layout_detection(synth_data, tmp_path):
    from dtrain.errors import DtrainError
    from dtrain.recipe.stats import detect_layout

    assert detect_layout(synth_data) == {"layout": "imagefolder", "val_split": "val"}
    (tmp_path / "bottle" / "train" / "good").mkdir(parents=True)
    assert detect_layout(tmp_path) == {"layout": "mvtec"} and detect_layout(tmp_path / "bottle") == {"layout": "mvtec"}
    with pytest.raises(DtrainError, match="none of: ImageFolder"):
        detect_layout(tmp_path / "bottle" / "train")  # one empty class folder: nothing to train on
    with pytest.raises(DtrainError, match="not found"):
        detect_layout(tmp_path / "absent")
    other = tmp_path / "other"
    for split, cls in (("train", "crack"), ("valid", "crack"), ("test", "crack")):
        (other / split / cls).mkdir(parents=True)
    assert detect_layout(other) == {"layout": "imagefolder", "val_split": "valid"}
    (other / "valid" / "crack").rmdir()
    (other / "valid").rmdir()
    assert detect_layout(other) == {"layout": "imagefolder", "val_from_train": 0.25}
    (other / "test").rename(other / "valid")  # train/ + valid/ only: valid/ is the test split
    assert detect_layout(other) == {"layout": "imagefolder", "test_split": "valid", "val_split": "val-from-train",
                                    "val_from_train": 0.25}
    flat = tmp_path / "flat"
    for cls in ("ok", "dent"):
        (flat / cls).mkdir(parents=True)
        shutil.copy(next((synth_data / "train" / cls).glob("*.png")), flat / cls / "a.png")
    assert detect_layout(flat) == {"layout": "classfolders"}


def test_sqrt_inverse_loss_weights():
    class Train:
        targets = [0] * 400 + [1] * 100 + [2] * 25

    w = loss_weights("sqrt_inverse", Train(), 4, torch.device("cpu"))
    assert w.tolist() == pytest.approx([1.0, 2.0, 4.0, 1.0])  # class 3 has no image: weight 1
    assert loss_weights("none", Train(), 4, torch.device("cpu")) is None


@pytest.mark.slow
def test_quickstart_data_decides_trains_and_reports(synth_data, tmp_path, dtrain_cmd, dtrain_home):
    work = tmp_path / "qs"
    proc = quickstart_data(dtrain_cmd, synth_data, work, epochs=2)
    assert "recipe: data.image_size = 32" in proc.stdout and "recipe: epochs = 2  (--epochs)" in proc.stdout
    assert "recipe: threshold k-fold = 0" in proc.stdout and "--folds 0 overrides" in proc.stdout
    cfg = yaml.safe_load((work / "train.yaml").read_text())
    assert cfg["data"]["root"] == str(synth_data) and cfg["keep_best"] is True and cfg["val_every_epoch"] is True
    assert cfg["model"]["views"] == 8 and "recipe: model.views = 8" in proc.stdout  # a budget of days scores 8 views
    best = torch.load(work / "train" / "checkpoints" / "best.pt", map_location="cpu", weights_only=False)
    val = [json.loads(line) for line in (work / "train" / "metrics.jsonl").read_text().splitlines() if '"val"' in line]
    assert len(val) == 2 and best["epoch"] == min(val, key=lambda r: r["loss"])["epoch"]
    assert best["best_val_loss"] == pytest.approx(min(r["loss"] for r in val))
    report = json.loads((work / "report.json").read_text())
    assert report["evaluated_checkpoint"] == "best.pt"
    assert {d["field"] for d in report["recipe"]} >= {"data.image_size", "epochs", "loss_class_weights", "keep_best"}
    assert "<h2>Recipe</h2>" in (work / "report.html").read_text()
    assert not (work / "data").exists()  # nothing synthesised


@pytest.mark.slow
def test_quickstart_data_on_bare_class_folders_splits_trains_and_reports(class_folders_data, tmp_path, dtrain_cmd,
                                                                         dtrain_home):
    """ROOT/<class>/* without split folders: the recipe splits it, and evaluation reads the
    same test split back from the checkpoint's config."""
    flat = class_folders_data
    work = tmp_path / "qs"
    proc = quickstart_data(dtrain_cmd, flat, work, epochs=1)
    assert "every class split 60/20/20 % into train/val/test" in proc.stdout
    cfg = yaml.safe_load((work / "train.yaml").read_text())
    assert cfg["data"]["layout"] == "classfolders" and cfg["data"]["root"] == str(flat)
    report = json.loads((work / "report.json").read_text())
    total = sum(1 for _ in flat.glob("*/*.png"))
    assert abs(report["n_images"] - 0.2 * total) <= len(list(flat.iterdir())), report["n_images"]


def test_an_mvtec_category_lends_test_images_to_train_so_the_classifier_sees_defects(synth_data, tmp_path):
    """MVTec-AD's train/ holds good parts only: trained as it is, a classifier never sees a defect."""
    import io

    from dtrain.quickstart import QuickstartOptions, recipe_config

    base = tmp_path / "bottle"
    for sub, (split, cls, n) in {"train/good": ("train", "ok", 20), "test/good": ("test", "ok", 10),
                                 "test/crack": ("test", "crack", 8), "test/dent": ("test", "dent", 8)}.items():
        (base / sub).mkdir(parents=True)
        for p in sorted((synth_data / split / cls).glob("*.png"))[:n]:
            shutil.copy(p, base / sub / p.name)
    out = io.StringIO()
    recipe = recipe_config(QuickstartOptions(data=base, folds=0), base, tmp_path / "train", out,
                           seconds_per_image=lambda side: 1e-5)
    assert "recipe: data.mvtec_train_fraction = 0.5  (train/ holds only good parts (MVTec-AD's layout" in out.getvalue()
    assert recipe.cfg["data"]["mvtec_train_fraction"] == 0.5 and recipe.data.mvtec_train_fraction == 0.5
    stats = gather(recipe.data)
    assert stats.train_counts == {"crack": 4, "dent": 4, "good": 25}  # half of every test class, good parts too
    # where train/ already holds defects (a supervised copy of the layout), nothing is lent
    (base / "train" / "crack").mkdir()
    shutil.copy(next((synth_data / "train" / "crack").glob("*.png")), base / "train" / "crack" / "x.png")
    again = recipe_config(QuickstartOptions(data=base, folds=0), base, tmp_path / "train2", io.StringIO(),
                          seconds_per_image=lambda side: 1e-5)
    assert "mvtec_train_fraction" not in again.cfg["data"]


def test_an_anomaly_set_whose_good_parts_are_called_ok_is_read_as_mvtec_and_lends_test_images(synth_data, tmp_path):
    """BTAD's shape: 01/train/ok/, 01/test/{ok,ko}/, 01/ground_truth/ko/. Read as an ImageFolder
    (before), its training split held no defect at all."""
    import io

    from dtrain.quickstart import QuickstartOptions, recipe_config

    root = tmp_path / "btad"
    base = root / "01"
    for sub, (split, cls, n) in {"train/ok": ("train", "ok", 20), "test/ok": ("test", "ok", 10),
                                 "test/ko": ("test", "crack", 8)}.items():
        (base / sub).mkdir(parents=True)
        for p in sorted((synth_data / split / cls).glob("*.png"))[:n]:
            shutil.copy(p, base / sub / p.name)
    assert detect_layout(base) == {"layout": "mvtec"}
    with pytest.raises(DtrainError, match="several MVTec categories"):  # its three products: say which
        (root / "02" / "train" / "ok").mkdir(parents=True)
        (root / "02" / "test").mkdir()
        assert detect_layout(root) == {"layout": "mvtec"}
        scan(DataConfig(root=str(root), layout="mvtec"), "train")
    recipe = recipe_config(QuickstartOptions(data=base, folds=0), base, tmp_path / "train", io.StringIO(),
                           seconds_per_image=lambda side: 1e-5)
    assert recipe.cfg["data"]["mvtec_train_fraction"] == 0.5
    assert gather(recipe.data).train_counts == {"ko": 4, "ok": 25}


def test_the_views_are_priced_at_the_scoring_cost_or_a_third_of_a_given_training_cost(synth_data, tmp_path):
    """The views' reason states what scoring will take: at the measured cost per view
    (budget.probe_scoring, fp32, where training may run bf16), and where a caller gives only a
    training cost, at a third of it (a forward pass at the training's precision)."""
    import io

    from dtrain.data.config import DataConfig
    from dtrain.quickstart import QuickstartOptions, recipe_config
    from dtrain.recipe.stats import detect_layout, gather

    def views(**costs) -> dict:
        recipe = recipe_config(QuickstartOptions(data=synth_data, folds=0), synth_data, tmp_path / "train", io.StringIO(),
                               seconds_per_image=lambda side: 3e-3, **costs)
        return next(d for d in recipe.decisions if d["field"] == "model.views")

    n_scored = 2 * gather(DataConfig(root=str(synth_data), **detect_layout(synth_data))).n_val  # validation + test
    measured = views(seconds_per_view=lambda side: 0.02)
    assert measured["value"] == 8 and f"~{n_scored * 8 * 0.02:.0f} s" in measured["reason"]
    assert f"~{n_scored * 8 * 1e-3:.0f} s" in views()["reason"]


def test_the_scoring_probe_returns_a_time_per_view_and_leaves_grad_mode_as_it_was():
    import torch

    from dtrain.recipe import budget

    cfg = {"arch": "small_resnet", "input_norm": "per_image", "pool": "avgmax"}
    grad, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    assert 0 < budget.probe_scoring(cfg, 32, 3) < 1.0
    assert torch.is_grad_enabled() == grad and torch.get_default_dtype() == dtype  # nothing left changed
