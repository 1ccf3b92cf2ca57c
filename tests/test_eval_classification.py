"""Data without a defect-free class is a classification task: it trains, evaluates
(accuracy, per-class figures, confusion matrix; no miss rates), exports and inspects."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtrain.data.layouts import resolve_negative
from dtrain.errors import DtrainError
from dtrain.evaluation.evaluate import NO_NEGATIVE_NOTE, summarise
from dtrain.evaluation.predict import Predictions
from dtrain.serve.predictor import judge

REPO = Path(__file__).resolve().parents[1]
TYPES = ["crazing", "inclusion", "patches"]


def test_negative_class_resolution(tmp_path):
    assert resolve_negative(TYPES, None, tmp_path) is None
    # The default "ok" finds its synonyms, and means "none" when there is none of them.
    assert resolve_negative(["defect", "normal"], "ok", tmp_path) == 1
    assert resolve_negative(TYPES, "ok", tmp_path) is None
    assert resolve_negative(TYPES, "good", tmp_path) is None
    with pytest.raises(DtrainError, match="not one of the classes"):
        resolve_negative(TYPES, "patches_free", tmp_path)


@pytest.mark.parametrize("names, negative", [
    (["MT_Blowhole", "MT_Crack", "MT_Free"], "MT_Free"),  # magnetic tiles
    (["def_front", "ok_front"], "ok_front"),  # cast impellers
    (["crack", "no_defect"], "no_defect"),
    (["Defect-free", "scratch"], "Defect-free"),
    (["GOOD", "bad"], "GOOD"),
    (["non_defective", "defective"], "non_defective"),
    (["Negative", "Positive"], "Negative"),  # cracked concrete
])
def test_a_class_named_like_defect_free_parts_is_the_negative_class(names, negative, tmp_path):
    assert resolve_negative(sorted(names), "ok", tmp_path) == sorted(names).index(negative)


@pytest.mark.parametrize("names", [
    ["not_ok", "scratch"], ["ok_bad", "dent"], ["nok", "pit"], ["defect", "freeform"], ["positive_crack", "dent"], TYPES,
])
def test_names_of_rejected_parts_are_not_taken_for_defect_free(names, tmp_path):
    assert resolve_negative(names, "ok", tmp_path) is None


def test_two_classes_named_like_defect_free_parts_ask_which(tmp_path):
    with pytest.raises(DtrainError, match="ok_back, ok_front") as err:
        resolve_negative(["dent", "ok_back", "ok_front"], "ok", tmp_path)
    assert "data.negative_class=ok_back" in err.value.hint
    # An exact synonym needs no guessing.
    assert resolve_negative(["ok", "ok_front"], "ok", tmp_path) == 0


def _preds(probs, targets) -> Predictions:
    return Predictions(np.asarray(probs, float), np.asarray(targets), [f"img{i}.png" for i in range(len(targets))], [])


def test_summary_of_a_classifier_has_no_miss_figures():
    val = _preds([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1]], [0, 1])
    test = _preds([[0.9, 0.05, 0.05], [0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.2, 0.1, 0.7]], [0, 1, 2, 0])
    r = summarise(TYPES, None, val, test, 0.005)
    assert r["task"] == "classification" and r["negative_class"] is None
    assert not {"miss_rate", "false_alarm_rate", "threshold"} & set(r)
    assert r["accuracy"] == 0.5 and r["confusion_matrix"] == [[1, 0, 1], [1, 0, 0], [0, 0, 1]]
    assert r["per_class"]["crazing"] == {"precision": 0.5, "recall": 0.5, "support": 2}
    assert r["validation"] == {"n_images": 2, "accuracy": 1.0}
    # The most confident mistake first: img3 (0.7 for patches) before img1 (0.6 for crazing).
    assert [(e["path"], TYPES[e["predicted"]]) for e in r["errors"]] == [("img3.png", "patches"), ("img1.png", "crazing")]
    assert r["warnings"][0] == NO_NEGATIVE_NOTE


def test_dtrain_eval_prints_a_classifier_without_miss_rows():
    import io

    from rich.console import Console

    from dtrain.cli.eval_cmd import print_summary

    test = _preds([[0.9, 0.05, 0.05], [0.1, 0.2, 0.7]], [0, 2])
    out = io.StringIO()
    print_summary(summarise(TYPES, None, test, test, 0.005), None, Console(file=out, width=200))
    text = out.getvalue()
    assert "100.00 %" in text and "argmax over 3 classes" in text and "miss rate" not in text.split("warning")[0]
    assert "no defect-free class" in text


def test_a_classifier_verdict_is_its_class():
    logits = np.array([[3.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    verdicts = judge(logits, TYPES, None, 0.5)
    assert [(v.verdict, v.cls, v.p_defect) for v in verdicts] == [("defect", "crazing", 1.0), ("defect", "patches", 1.0)]


@pytest.fixture(scope="module")
def types_only(synth_data, tmp_path_factory) -> Path:
    """The synthetic set with its OK images removed: five defect types, no defect-free class."""
    root = tmp_path_factory.mktemp("types_only") / "data"
    shutil.copytree(synth_data, root, ignore=shutil.ignore_patterns("ok", "manifest.json"))
    return root


@pytest.mark.slow
def test_training_names_the_class_it_took_for_defect_free_parts(synth_data, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(synth_data, root, ignore=shutil.ignore_patterns("manifest.json"))
    for split in ("train", "val", "test"):
        (root / split / "ok").rename(root / split / "ok_front")
    sets = {"data.root": root, "data.image_size": 16, "data.num_workers": 0, "max_steps": 1, "batch_size": 8,
            "precision": "fp32", "output_dir": tmp_path / "run", "device": "cpu", "threads": 1, "val_every_epoch": False}
    argv = [sys.executable, "-m", "dtrain.train"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "negative class: ok_front" in proc.stderr + proc.stdout
    import torch

    blob = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert blob["negative_class"] == "ok_front"  # what evaluation and export measure misses against


@pytest.mark.slow
def test_types_only_data_trains_evaluates_exports_and_inspects(types_only, tmp_path, dtrain_cmd):
    from dtrain.evaluation.evaluate import evaluate
    from dtrain.evaluation.html_report import render_html
    from dtrain.serve.export import ExportOptions, export
    from dtrain.serve.model_dir import load_card

    sets = {
        "data.root": types_only, "data.image_size": 32, "data.num_workers": 0, "epochs": 1, "batch_size": 16,
        "precision": "fp32", "optim.warmup_steps": 2, "output_dir": tmp_path / "run", "device": "cpu", "threads": 1,
        "model.arch": "small_resnet",
    }
    argv = [sys.executable, "-m", "dtrain.train"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no class name reads as defect-free" in proc.stderr + proc.stdout
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"

    result = evaluate(checkpoint, types_only, 0.005, out_dir=tmp_path / "eval")
    assert result["task"] == "classification" and "miss_rate" not in result
    assert np.array(result["confusion_matrix"]).shape == (5, 5) and result["n_images"] == sum(
        1 for _ in (types_only / "test").rglob("*.png"))
    assert result["plots"] == {"confusion_matrix": "confusion_matrix.png"}
    page = render_html(result, tmp_path / "eval")
    assert "classification: accuracy" in page and "Misclassified test images" in page

    model = tmp_path / "model"
    export(ExportOptions(checkpoint=str(checkpoint), out=str(model), format="onnx", quantize="none",
                         data=str(types_only), measure_seconds=0.2))
    card = load_card(model)
    assert card.negative_class is None and card.negative_index is None
    assert card.verification["ort-fp32"].verdict_agreement >= 0.99
    out = tmp_path / "rows.csv"
    proc = subprocess.run(dtrain_cmd + ["inspect", str(model), str(types_only / "test"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == result["n_images"] and {r["verdict"] for r in rows} == {"defect"}
    assert {r["class"] for r in rows} <= set(result["classes"])
    # The service's class is the checkpoint's argmax, image by image.
    predicted = {Path(e["path"]).name: result["classes"][e["predicted"]] for e in result["errors"]}
    by_name = {Path(r["path"]).name: r["class"] for r in rows}
    assert sum(by_name[name] == cls for name, cls in predicted.items()) >= 0.95 * len(predicted)
