"""`dtrain quickstart --data` on a tiny plant-profile set with few defective validation images:
k fold runs + the final run (real processes), each with the photos' masks, the threshold
from out-of-fold scores, and a report that says what it rests on. Checks the flow and the report, not the accuracy."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import numpy as np
import pytest
import yaml

from dtrain.recipe.folds import MAX_FOLDS, MIN_FOLDS

pytestmark = pytest.mark.slow


def test_quickstart_kfold_threshold_from_out_of_fold_scores(tmp_path, dtrain_cmd, dtrain_home):
    data, work = tmp_path / "plant", tmp_path / "qs"
    synth = subprocess.run([*dtrain_cmd, "data", "synth", str(data), "--profile", "plant", "--images", "130", "--size", "64",
                            "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert synth.returncode == 0, synth.stderr[-2000:]
    manifest = json.loads((data / "manifest.json").read_text())
    counts = {c: manifest["counts"]["train"][c] + manifest["counts"]["val"][c] for c in manifest["counts"]["train"]}
    n_defective = sum(v for c, v in counts.items() if c != "ok")

    # --folds 2 and --epochs 1 keep it to three short runs (the recipe would train 4 or 5 fold models; its rule is
    # checked in tests/test_recipe_threshold.py, and named in the decision below). A budget no load can exhaust.
    argv = [*dtrain_cmd, "quickstart", "--data", str(data), "--workdir", str(work), "--epochs", "1", "--nproc", "1",
            "--budget-minutes", "6000", "--folds", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((work / "report.json").read_text())
    decision = next(d for d in report["recipe"] if d["field"] == "threshold k-fold")
    k, recipe_k = decision["value"], max(MIN_FOLDS, min(MAX_FOLDS, min(v for c, v in counts.items() if c != "ok")))
    assert k == 2 and f"--folds 2 overrides the recipe's {recipe_k}" in decision["reason"]
    assert proc.stdout.count("folds: fold ") == k and "out-of-fold scores" in proc.stdout
    # The photos' masks (the plant profile writes them) reach every run, the fold runs' folders of links included.
    masked = [int(n) for n in re.findall(r"mask loss 1 on (\d+) photos' masks", proc.stdout + proc.stderr)]
    assert len(masked) >= k + 1 and min(masked) > 0, masked

    basis = report["threshold_basis"]
    assert basis["source"] == f"out-of-fold scores of {k} fold models over train + val"
    assert basis["n_defective"] == n_defective and basis["n_ok"] == counts["ok"]  # every labelled image scored once
    assert basis["achievable_miss_rate_upper95"] == pytest.approx(1 - 0.05 ** (1 / n_defective), rel=1e-6) or basis["n_missed"]
    assert not basis["target_shown"] and basis["warning"] in report["warnings"]
    oof = np.load(work / "eval" / "oof_scores.npz")
    assert len(oof["targets"]) == sum(counts.values()) and len(set(oof["paths"].tolist())) == sum(counts.values())

    cfg = yaml.safe_load((work / "train.yaml").read_text())  # the final model: all of train + val, fixed epochs
    assert cfg["data"]["root"] == str(work / "folds" / "all") and cfg["keep_best"] is False
    assert report["evaluated_checkpoint"] == "last.pt" and report["n_images"] == sum(manifest["counts"]["test"].values())
    page = (work / "report.html").read_text()
    assert "best miss-rate bound these defects can show" in page and "not proven" in page

    # The printed export command ships the report's threshold (the final model has no val split to choose one on).
    hint = shlex.split(next(line for line in proc.stdout.splitlines() if line.startswith("export: ")).removeprefix("export: "))
    assert hint[:2] == ["dtrain", "export"] and hint[hint.index("--threshold-from") + 1] == str(work / "report.json")
    exported = subprocess.run([*dtrain_cmd, *hint[1:], "--format", "torch", "--quantize", "none", "--backends", "torch-eager"],
                              capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    card = json.loads((work / "model" / "model.json").read_text())
    assert card["threshold"] == report["threshold"] and basis["source"] in card["threshold_source"]
    assert card["verification"]["torch-eager"]["split"] == "train" and "training images" in card["notes"][0]

    # The same threshold from `dtrain eval --threshold-scores`.
    again = subprocess.run([*dtrain_cmd, "eval", str(work / "train" / "checkpoints" / "last.pt"), str(data), "--json",
                            "--calibration", "bound95", "--threshold-scores", str(work / "eval" / "oof_scores.npz"),
                            "--out", str(tmp_path / "eval")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["threshold"] == pytest.approx(report["threshold"])
    # Without them there is no split to choose it on (the final model has seen val): said so, with the fix.
    plain = subprocess.run([*dtrain_cmd, "eval", str(work / "train" / "checkpoints" / "last.pt"), str(data)],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode != 0 and "--threshold-scores" in plain.stderr + plain.stdout
