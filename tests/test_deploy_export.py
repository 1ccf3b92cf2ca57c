"""export -> inspect against the checkpoint itself, on the synthetic test split."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.deploy_fixtures import TARGET_MISS_RATE


def _read_rows(path):
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_model_dir_is_self_contained(exported_model):
    from dtrain.serve.model_dir import load_card, sha256_file

    card = load_card(exported_model)
    assert card.preprocessing.image_size == 32 and card.preprocessing.colour == "RGB"
    assert card.classes[card.negative_index] == card.negative_class == "ok"
    assert card.target_miss_rate == TARGET_MISS_RATE and 0.0 <= card.threshold <= 1.0
    assert card.threshold_rule == "bound95"  # the default, as the quickstart evaluates
    assert card.preferred_backend in card.backends and card.preferred_backend in card.throughput_images_per_s
    assert set(card.files) == {"model.onnx", "recheck_sample.npz"}
    assert card.files["model.onnx"] == sha256_file(exported_model / "model.onnx")
    check = card.verification["ort-fp32"]
    assert check.verdict_agreement == 1.0 and check.max_abs_p_defect_diff < 1e-4
    assert check.miss_rate <= card.target_miss_rate


@pytest.mark.slow
def test_inspect_reproduces_checkpoint_verdicts(exported_model, synth_data, checkpoint_test_scores, tmp_path, dtrain_cmd):
    """The acceptance check: >= 99.5 % of the checkpoint's test verdicts, and no more misses."""
    from dtrain.evaluation.metrics import miss_rate
    from dtrain.serve.model_dir import load_card

    card = load_card(exported_model)
    out = tmp_path / "results.csv"
    proc = subprocess.run(dtrain_cmd + ["inspect", str(exported_model), str(synth_data / "test"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "images/s" in proc.stderr
    rows = {str(Path(r["path"]).resolve()): r for r in _read_rows(out)}
    assert set(rows) == set(checkpoint_test_scores) and all(not r["error"] for r in rows.values())
    paths = sorted(rows)
    ref = np.array([checkpoint_test_scores[p] for p in paths])
    ours = np.array([float(rows[p]["p_defect"]) for p in paths])
    agree = np.mean((ours >= card.threshold) == (ref >= card.threshold))
    assert agree >= 0.995, f"verdict agreement {agree:.4f}"
    assert all(rows[p]["verdict"] == ("defect" if float(rows[p]["p_defect"]) >= card.threshold else "ok") for p in paths)
    is_defect = np.array(["/ok/" not in p for p in paths])
    assert miss_rate(ours, is_defect, card.threshold).k <= miss_rate(ref, is_defect, card.threshold).k
    assert card.verification["ort-fp32"].miss_rate <= card.target_miss_rate


@pytest.mark.slow
def test_inspect_reports_unreadable_images_and_writes_jsonl(exported_model, synth_data, tmp_path, dtrain_cmd):
    good = sorted((synth_data / "test" / "ok").glob("*.png"))[:3]
    folder = tmp_path / "imgs"
    folder.mkdir()
    for p in good:
        shutil.copy(p, folder / p.name)
    (folder / "truncated.png").write_bytes(good[0].read_bytes()[:200])
    (folder / "notes.png").write_text("not an image at all")
    out = tmp_path / "r.jsonl"
    proc = subprocess.run(dtrain_cmd + ["inspect", str(exported_model), str(folder / "*.png"), "--out", str(out), "--batch", "2",
                                        "--workers", "2", "--backend", "ort-fp32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {json.loads(line)["path"].rsplit("/", 1)[-1]: json.loads(line) for line in out.read_text().splitlines()}
    assert len(rows) == 5
    assert "corrupt or truncated" in rows["truncated.png"]["error"] and rows["truncated.png"]["verdict"] == ""
    assert "not an image" in rows["notes.png"]["error"]
    for p in good:
        assert rows[p.name]["error"] is None and rows[p.name]["verdict"] in ("ok", "defect")
    assert "2 unreadable" in proc.stderr


@pytest.mark.slow
def test_tampered_model_is_refused(exported_model, tmp_path, dtrain_cmd, synth_data):
    copy = tmp_path / "model"
    shutil.copytree(exported_model, copy)
    with open(copy / "model.onnx", "r+b") as f:
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = subprocess.run(dtrain_cmd + ["inspect", str(copy), str(synth_data / "test")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "does not match its checksum" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_unknown_backend_lists_the_valid_ones(exported_model):
    from dtrain.errors import DtrainError
    from dtrain.serve.predictor import Predictor

    with pytest.raises(DtrainError) as err:
        Predictor(exported_model, "ort-fp23")
    assert "ort-fp32" in str(err.value)
    with pytest.raises(DtrainError, match="no network"):
        Predictor(exported_model, "torch-eager")


def test_export_errors_are_one_line(trained_checkpoint, tmp_path, capsys):
    from dtrain.cli.app import main

    out = tmp_path / "m"
    assert main(["export", str(trained_checkpoint), "--out", str(out), "--format", "torchscript"]) != 0
    err = capsys.readouterr().err
    assert "format" in err and "'onnx', 'torch' or 'all'" in err and "Traceback" not in err
    assert main(["export", str(tmp_path / "nope.pt"), "--out", str(out)]) != 0
    assert "checkpoint not found" in capsys.readouterr().err
    assert main(["export", str(trained_checkpoint), "--out", str(out), "--backends", "ort-fp32,onnx"]) != 0
    assert "unknown backend 'onnx'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_that_scores_nan_is_refused_before_anything_is_written(trained_checkpoint, synth_data, tmp_path, capsys):
    import torch

    from dtrain.cli.app import main

    # A diverged run's weights: the export would choose a NaN threshold and write a model.json no loader reads.
    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=True)
    blob["model"]["fc.bias"] = torch.full_like(blob["model"]["fc.bias"], float("nan"))
    broken = tmp_path / "diverged.pt"
    torch.save(blob, broken)
    out = tmp_path / "m"
    assert main(["export", str(broken), "--out", str(out), "--format", "onnx", "--data", str(synth_data)]) != 0
    err = capsys.readouterr().err
    assert "as NaN or infinite" in err and "earlier checkpoint" in err and "Traceback" not in err
    assert not out.exists()
