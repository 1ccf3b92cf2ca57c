"""`dtrain export --threshold-from REPORT / --threshold P`: the k-fold quickstart's final model
(trained on train + val, no validation split left) exports with the threshold its report chose.

Fast: the workdir is built by hand the way a k-fold quickstart leaves it (a checkpoint whose
config has `val_split: ""` and points at a merged train-only folder, and report.json), with an
untrained small_resnet whose head is biased towards the defect classes, so that every image
is judged defective at moderate thresholds. The export is the real one (torch.export, the
torch-eager backend). tests/test_quickstart_kfold.py runs the real quickstart end to end.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dtrain.cli.app import main

CLASSES = ["dent", "ok", "scratch"]
SIZE = 32
BASIS = "out-of-fold scores of 3 fold models over train + val"


def _images(root: Path, split: str, per_class: int = 4) -> None:
    rng = np.random.default_rng(0)
    for cls in CLASSES:
        folder = root / split / cls
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def _checkpoint(path: Path, data_root: Path, seed: int) -> None:
    from dtrain.models import ModelConfig, build_model

    torch.manual_seed(seed)
    net = build_model(ModelConfig(arch="small_resnet"), len(CLASSES))
    with torch.no_grad():
        net.fc.bias.copy_(torch.tensor([4.0, -4.0, 4.0]))  # P(defect) ~ 0.9998 for any image
    data = {"root": str(data_root), "layout": "imagefolder", "train_split": "train", "val_split": "", "negative_class": "ok"}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({
        "model": net.state_dict(), "config": {"model": {"arch": "small_resnet"}, "data": data}, "classes": CLASSES,
        "negative_class": "ok", "image_size": SIZE, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "epoch": 1, "step": 3,
    }, path)


def _report(work: Path, **changes) -> Path:
    report = {
        "task": "inspection", "classes": CLASSES, "negative_class": "ok", "threshold": 0.3, "target_miss_rate": 0.05,
        "calibration": "bound95", "threshold_basis": {"source": BASIS, "calibration": "bound95"},
        "checkpoint": str(work / "train" / "checkpoints" / "last.pt"), "workdir": str(work), "image_size": SIZE,
        "config": {"model": {"arch": "small_resnet"}},
    }
    report.update(changes)
    path = work / "report.json"
    path.write_text(json.dumps(report))
    return path


@pytest.fixture(scope="module")
def kfold_work(tmp_path_factory) -> Path:
    """WORK/{report.json, train/checkpoints/last.pt, folds/all/train/<class>/*.png}, as a k-fold quickstart leaves it."""
    work = tmp_path_factory.mktemp("kfold") / "qs"
    _images(work / "folds" / "all", "train")
    _checkpoint(work / "train" / "checkpoints" / "last.pt", work / "folds" / "all", seed=0)
    _report(work)
    return work


def _export(work: Path, out: Path, *extra: str) -> int:
    return main(["export", str(work / "train" / "checkpoints" / "last.pt"), "--out", str(out), "--format", "torch",
                 "--quantize", "none", "--backends", "torch-eager", *extra])


def test_kfold_model_exports_with_the_reports_threshold(kfold_work, tmp_path, capsys):
    from dtrain.serve.model_dir import load_card

    out = tmp_path / "model"
    assert _export(kfold_work, out, "--threshold-from", str(kfold_work / "report.json")) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    card = load_card(out)
    assert card.threshold == 0.3 and card.target_miss_rate == 0.05 and card.threshold_rule == "bound95"
    assert BASIS in card.threshold_source and str(kfold_work / "report.json") in card.threshold_source
    check = card.verification["torch-eager"]
    assert (check.split, check.n_images, check.n_defective) == ("train", 12, 8)
    assert check.verdict_agreement == 1.0 and check.miss_rate == 0.0
    assert len(card.notes) == 1 and "its training images" in card.notes[0] and "without a validation split" in card.notes[0]
    assert BASIS in err and "note:" in err and "its training images" in err


def test_a_bare_threshold_verifies_on_the_val_split_of_data(kfold_work, tmp_path, capsys):
    from dtrain.serve.model_dir import load_card

    other = tmp_path / "data"
    _images(other, "val", per_class=2)
    out = tmp_path / "model"
    assert _export(kfold_work, out, "--threshold", "0.31", "--data", str(other)) == 0, capsys.readouterr().err
    card = load_card(out)
    assert card.threshold == 0.31 and card.threshold_source == "--threshold 0.31" and card.threshold_rule == "given"
    assert card.target_miss_rate == 0.005  # no report: the default target
    assert card.verification["torch-eager"].split == "val" and card.verification["torch-eager"].n_images == 6
    assert len(card.notes) == 1 and f"'val' split of {other}" in card.notes[0]


def test_without_a_threshold_a_model_without_val_split_says_what_to_pass(kfold_work, tmp_path, capsys):
    out = tmp_path / "model"
    assert _export(kfold_work, out) != 0
    err = capsys.readouterr().err
    assert "without a validation split" in err and "--threshold-from WORKDIR/report.json" in err and "Traceback" not in err
    assert not out.exists()


def test_no_images_at_all_says_to_pass_data(kfold_work, tmp_path, capsys):
    work = tmp_path / "qs"
    _checkpoint(work / "train" / "checkpoints" / "last.pt", tmp_path / "gone", seed=0)
    assert _export(work, tmp_path / "model", "--threshold", "0.3") != 0
    err = capsys.readouterr().err
    assert f"data directory not found: {tmp_path / 'gone'}" in err and "--data ROOT" in err


@pytest.mark.parametrize("changes, says", [
    ({"classes": ["dent", "good", "scratch"]}, "classes"),
    ({"negative_class": "dent"}, "negative class"),
    ({"task": "classification", "negative_class": None}, "classification task"),
    ({"image_size": 64}, "image size"),
    ({"config": {"model": {"arch": "resnet18"}}}, "architecture"),
    ({"threshold": None}, "holds no threshold"),
])
def test_a_report_of_another_model_is_refused(kfold_work, tmp_path, capsys, changes, says):
    work = tmp_path / "qs"
    shutil.copytree(kfold_work, work, symlinks=True)
    out = tmp_path / "model"
    assert _export(work, out, "--threshold-from", str(_report(work, **changes))) != 0
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not out.exists()


def test_the_reports_checkpoint_is_found_where_the_report_lies(kfold_work, tmp_path):
    """A report names its checkpoint under its workdir; copied elsewhere, the copy's checkpoint counts."""
    from dtrain.errors import DtrainError
    from dtrain.serve.given_threshold import from_report
    from dtrain.train.checkpoint import load_for_inference

    ckpt = kfold_work / "train" / "checkpoints" / "last.pt"
    _, meta = load_for_inference(ckpt)
    copy = tmp_path / "elsewhere" / "last.pt"
    copy.parent.mkdir()
    shutil.copy(ckpt, copy)
    assert from_report(kfold_work / "report.json", copy, meta).threshold == 0.3  # the same file's content

    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(kfold_work / "report.json", moved / "report.json")
    _checkpoint(moved / "train" / "checkpoints" / "last.pt", kfold_work / "folds" / "all", seed=1)  # another model
    with pytest.raises(DtrainError, match="evaluated .*moved/train/checkpoints/last.pt, not"):
        from_report(moved / "report.json", ckpt, meta)


@pytest.mark.parametrize("args, says", [
    (["--threshold", "1.0"], "threshold: Input should be less than 1"),
    (["--threshold", "0"], "threshold: Input should be greater than 0"),
    (["--threshold", "0.3", "--threshold-from", "REPORT"], "pass one of them"),
    (["--threshold-from", "REPORT", "--target-miss-rate", "0.01"], "chosen for a target miss rate of 5.00%"),
    (["--threshold-from", "nowhere.json"], "report not found"),
])
def test_bad_threshold_arguments_are_refused(kfold_work, tmp_path, capsys, args, says):
    args = [str(kfold_work / "report.json") if a == "REPORT" else a for a in args]
    assert _export(kfold_work, tmp_path / "model", *args) != 0
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_backends_are_held_to_the_checkpoints_own_misses_at_a_given_threshold(kfold_work, tmp_path, capsys):
    """At a given threshold the checkpoint may itself miss more than the target (the report's test
    figures say so); the export then says it and holds each backend to missing no more."""
    from dtrain.serve.model_dir import load_card

    out = tmp_path / "model"
    assert _export(kfold_work, out, "--threshold", "0.999999") == 0, capsys.readouterr().err
    card = load_card(out)
    assert card.reference_val_miss_rate == 1.0 and card.verification["torch-eager"].miss_rate == 1.0
    assert "the checkpoint itself misses 100.00%" in card.notes[-1] and "the checkpoint itself misses" in capsys.readouterr().err


def test_quickstart_prints_the_export_command_with_its_report():
    from dtrain.cli.eval_cmd import export_command

    work = Path("runs/my qs")
    inspection = export_command({"task": "inspection", "checkpoint": "runs/my qs/train/checkpoints/last.pt"}, work)
    assert inspection == "dtrain export 'runs/my qs/train/checkpoints/last.pt' --out 'runs/my qs/model' " \
                         "--threshold-from 'runs/my qs/report.json'"
    classifier = export_command({"task": "classification", "checkpoint": "c.pt"}, work)
    assert "--threshold-from" not in classifier
