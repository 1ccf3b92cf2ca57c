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
