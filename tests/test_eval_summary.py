"""The evaluation dict from known predictions: keys, threshold on val, figures on test, plots."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtrain.evaluation.evaluate import summarise, write_outputs
from dtrain.evaluation.predict import Predictions

CLASSES = ["dent", "ok", "scratch"]  # the negative class need not be first
OK = 1
DESIGN_KEYS = {"classes", "accuracy", "miss_rate", "miss_rate_upper95", "false_alarm_rate", "threshold",
               "per_class", "confusion_matrix", "n_images"}


def _preds(rows: list[tuple[float, float, float, int]]) -> Predictions:
    probs = np.array([r[:3] for r in rows], dtype=np.float64)
    targets = np.array([r[3] for r in rows])
    return Predictions(probs=probs, targets=targets, paths=[f"img{i}.png" for i in range(len(rows))], bad_files=[])


# Validation: defects with P(defect) = 1 - p_ok of .9, .8, .6; OK images at .3 and .1.
# Target 10 % of 3 defects -> 0 misses allowed -> highest threshold .6, OK score below it
# .3 -> threshold .45.
VAL = _preds([
    (0.6, 0.1, 0.3, 0),
    (0.1, 0.2, 0.7, 2),
    (0.3, 0.4, 0.3, 0),
    (0.1, 0.7, 0.2, 1),
    (0.05, 0.9, 0.05, 1),
])
# Test: P(defect) of the rows: .95 dent, .5 scratch (shown as dent: 0.3 > 0.2),
# .4 dent (missed at .45), .6 OK (false alarm), .2 OK, .05 OK.
TEST = _preds([
    (0.9, 0.05, 0.05, 0),
    (0.3, 0.5, 0.2, 2),
    (0.3, 0.6, 0.1, 0),
    (0.5, 0.4, 0.1, 1),
    (0.1, 0.8, 0.1, 1),
    (0.0, 0.95, 0.05, 1),
])


def test_summary_by_hand():
    r = summarise(CLASSES, OK, VAL, TEST, 0.10)
    assert DESIGN_KEYS <= set(r)
    assert r["threshold"] == pytest.approx(0.45)
    assert r["threshold_highest"] == pytest.approx(0.6)
    assert r["validation"]["miss_rate"] == 0.0
    assert (r["n_defective"], r["n_ok"], r["n_images"]) == (3, 3, 6)
    assert (r["n_missed"], r["miss_rate"]) == (1, pytest.approx(1 / 3))
    assert (r["n_false_alarms"], r["false_alarm_rate"]) == (1, pytest.approx(1 / 3))
    # Rows predicted: dent, dent, ok, dent, ok, ok -> correct: rows 0, 4, 5 -> 3/6.
    assert r["confusion_matrix"] == [[1, 1, 0], [1, 2, 0], [1, 0, 0]]
    assert r["accuracy"] == pytest.approx(3 / 6)
    # Argmax alone: dent, ok, ok, dent, ok, ok -> rows 0, 4, 5 correct.
    assert r["accuracy_argmax"] == pytest.approx(3 / 6)
    # Binary verdicts at .45: D D O D O O vs truth D D D O O O -> 4/6.
    assert r["binary_accuracy"] == pytest.approx(4 / 6)
    assert r["per_class"]["scratch"] == {"precision": 0.0, "recall": 0.0, "support": 1}
    assert r["per_class"]["dent"]["precision"] == pytest.approx(1 / 3)
    assert r["misses"] == [{"path": "img2.png", "label": 0, "p_defect": pytest.approx(0.4)}]
    assert [e["path"] for e in r["false_alarms"]] == ["img3.png"]
    # 3 defective test images can never support a 10 % target (needs 29).
    assert any("29" in w for w in r["warnings"])


def test_write_outputs_json_and_plots(tmp_path):
    r = summarise(CLASSES, OK, VAL, TEST, 0.10)
    write_outputs(tmp_path, r, TEST)
    saved = json.loads((tmp_path / "evaluation.json").read_text())
    assert DESIGN_KEYS <= set(saved)
    for name in saved["plots"].values():
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 2000
    scores = np.load(tmp_path / "scores.npz")
    assert scores["probs"].shape == (6, 3)


def test_empty_split_is_a_user_error():
    from dtrain.errors import DtrainError

    empty = Predictions(np.zeros((0, 3)), np.zeros(0, dtype=int), [], ["bad.png"])
    with pytest.raises(DtrainError, match="validation split has no readable images"):
        summarise(CLASSES, OK, empty, TEST, 0.1)


def _binary(defect_scores: list[float], ok_scores: list[float]) -> Predictions:
    p = np.array(defect_scores + ok_scores)
    probs = np.stack([1 - p, p], axis=1)  # classes ok, scratch
    targets = np.array([1] * len(defect_scores) + [0] * len(ok_scores))
    return Predictions(probs=probs, targets=targets, paths=[f"val{i}.png" for i in range(len(p))], bad_files=[])


OK_SCORES = [i / 20 for i in range(20)]  # 0.00, 0.05, ..., 0.95


def test_the_faintest_defects_are_named_with_what_catching_each_costs_and_one_outlier_is_called_out():
    val = _binary([0.9, 0.12, 0.95, 0.62], OK_SCORES)
    r = summarise(["ok", "scratch"], 0, val, val, 0.10)
    setters = r["threshold_setters"]
    assert [s["path"] for s in setters] == ["val1.png", "val3.png", "val0.png", "val2.png"]  # faintest first
    # OK scores at or above each: 0.15.. (17 of 20), 0.65.. (7), 0.9, 0.95 (2), 0.95 (1)
    assert [s["false_alarm_rate_if_caught"] for s in setters] == pytest.approx([0.85, 0.35, 0.10, 0.05])
    assert all(s["caught"] for s in setters) and setters[0]["label"] == 1
    assert r["threshold_basis"]["false_alarm_rate"] == pytest.approx(0.85)  # the first one's price is the threshold's
    called = [w for w in r["warnings"] if w.startswith("One defect sets the threshold")]
    assert len(called) == 1
    assert "val1.png (validation split) scores P(defect) 0.120" in called[0]
    assert "85.0%" in called[0] and "next faintest would cost 35.0%" in called[0]


def test_no_defect_is_called_out_when_the_faintest_ones_cost_alike_or_little():
    alike = summarise(["ok", "scratch"], 0, _binary([0.12, 0.13, 0.9], OK_SCORES), _binary([0.5], [0.1]), 0.10)
    cheap = summarise(["ok", "scratch"], 0, _binary([0.97, 0.99], OK_SCORES), _binary([0.5], [0.1]), 0.10)
    for r in (alike, cheap):
        assert not any(w.startswith("One defect sets the threshold") for w in r["warnings"])
    assert [s["false_alarm_rate_if_caught"] for s in cheap["threshold_setters"]] == [0.0, 0.0]


def test_a_defect_the_rule_lets_through_is_named_as_not_caught():
    # 40 defects at a 10 % target: the rate rule allows 4 misses; good parts just under the fifth
    # faintest put the threshold between them and it, so the 4 faintest are let through
    val = _binary([0.01 * (i + 1) for i in range(40)], [0.045] * 10)
    r = summarise(["ok", "scratch"], 0, val, val, 0.10)
    assert [s["caught"] for s in r["threshold_setters"]] == [False] * 4 + [True]
    assert not any(w.startswith("One defect sets the threshold") for w in r["warnings"])


def test_the_console_summary_lists_the_faintest_defects_by_folder_and_file():
    import io

    from rich.console import Console

    from dtrain.cli.eval_cmd import print_summary

    val = _binary([0.9, 0.12, 0.95, 0.62], OK_SCORES)
    val.paths[1] = "/data/val/[scratch]/p1.png"  # markup-like characters print as they are
    out = io.StringIO()
    print_summary(summarise(["ok", "scratch"], 0, val, val, 0.10), None, Console(file=out, width=200))
    text = out.getvalue()
    assert "faintest defects of the validation split: they set the threshold" in text
    row = next(line for line in text.splitlines() if "p1.png" in line)
    assert "[scratch]/p1.png" in row and "0.1200" in row and "85.00 %" in row and "yes" in row
