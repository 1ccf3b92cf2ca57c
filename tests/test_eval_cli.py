"""`dtrain eval` on a real checkpoint (the trained_checkpoint fixture) and data set."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

DESIGN_KEYS = {"classes", "accuracy", "miss_rate", "miss_rate_upper95", "false_alarm_rate", "threshold",
               "per_class", "confusion_matrix", "n_images"}


@pytest.fixture(scope="module")
def eval_run(trained_checkpoint, synth_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    argv = [*_dtrain(), "eval", str(trained_checkpoint), str(synth_data), "--json", "--out", str(out), "--target-miss-rate", "0.05"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), out, synth_data


def _dtrain() -> list[str]:
    import sys

    return [sys.executable, "-m", "dtrain"]


def test_eval_json_has_the_design_keys(eval_run):
    result, out, data = eval_run
    manifest = json.loads((data / "manifest.json").read_text())
    n_test = sum(manifest["counts"]["test"].values())
    assert DESIGN_KEYS | {"target_miss_rate", "n_defective", "n_ok", "warnings"} <= set(result)
    assert result["n_images"] == n_test == result["n_defective"] + result["n_ok"]
    assert result["n_ok"] == manifest["counts"]["test"]["ok"]
    assert sorted(result["classes"]) == sorted(manifest["classes"])
    cm = np.array(result["confusion_matrix"])
    assert cm.shape == (6, 6) and cm.sum() == n_test
    assert result["accuracy"] == pytest.approx(np.trace(cm) / n_test)
    assert 0.0 <= result["miss_rate"] <= result["miss_rate_upper95"] <= 1.0
    assert result["target_miss_rate"] == 0.05
    # A tiny split cannot support the target: the warning says how many defects it needs.
    assert any("59" in w for w in result["warnings"])


def test_eval_writes_json_and_plots(eval_run):
    result, out, _ = eval_run
    saved = json.loads((out / "evaluation.json").read_text())
    assert saved["threshold"] == pytest.approx(result["threshold"])
    for name in ("confusion_matrix.png", "score_histogram.png", "miss_vs_false_alarm.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")


def test_eval_threshold_is_recomputable_from_the_saved_scores(eval_run):
    """The reported test miss rate follows from the saved scores and the threshold."""
    result, out, _ = eval_run
    scores = np.load(out / "scores.npz")
    neg = result["classes"].index(result["negative_class"])
    p_def = 1.0 - scores["probs"][:, neg]
    defect = scores["targets"] != neg
    assert np.sum(p_def[defect] < result["threshold"]) == result["n_missed"]
    assert np.sum(p_def[~defect] >= result["threshold"]) == result["n_false_alarms"]
