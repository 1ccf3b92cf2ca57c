"""Inspection metrics against values worked out by hand on small fixtures."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dtrain.evaluation import metrics as m


def test_clopper_pearson_zero_events_closed_form():
    # k = 0: 1 - 0.05^(1/n). n = 100 -> 1 - exp(ln 0.05 / 100) = 0.029513...
    assert m.clopper_pearson_upper(0, 100) == pytest.approx(0.0295130, abs=1e-6)
    assert m.clopper_pearson_upper(0, 1) == pytest.approx(0.95)
    assert m.clopper_pearson_upper(0, 600) == pytest.approx(1 - 0.05 ** (1 / 600))


def test_clopper_pearson_general_case_matches_known_values():
    # Exact one-sided 95 % bounds, also obtainable from the binomial CDF: the p where
    # P(X <= k | n, p) = 0.05. For k=1, n=10 solve (1-p)^10 + 10p(1-p)^9 = 0.05.
    p = m.clopper_pearson_upper(1, 10)
    assert (1 - p) ** 10 + 10 * p * (1 - p) ** 9 == pytest.approx(0.05, abs=1e-9)
    assert p == pytest.approx(0.39416, abs=1e-5)
    # k=2, n=100: P(X <= 2) = sum_j C(100, j) p^j (1-p)^(100-j) = 0.05 at p = 0.0616.
    p = m.clopper_pearson_upper(2, 100)
    cdf = sum(math.comb(100, j) * p**j * (1 - p) ** (100 - j) for j in range(3))
    assert cdf == pytest.approx(0.05, abs=1e-9)
    assert p == pytest.approx(0.0616, abs=1e-4)
    assert m.clopper_pearson_upper(5, 5) == 1.0
    with pytest.raises(ValueError):
        m.clopper_pearson_upper(3, 2)


def test_min_defective_for_target():
    # ln(0.05) / ln(0.995) = 597.6 -> 598 defective images with 0 misses.
    assert m.min_defective_for_target(0.005) == 598
    assert m.clopper_pearson_upper(0, 598) <= 0.005 < m.clopper_pearson_upper(0, 597)
    assert m.min_defective_for_target(0.05) == math.ceil(math.log(0.05) / math.log(0.95))


def test_miss_and_false_alarm_rates_by_hand():
    # 4 defective (scores .9 .6 .3 .1) and 4 OK (scores .7 .2 .1 0): at threshold 0.5
    # the defects at .3 and .1 are missed (2/4) and the OK at .7 is a false alarm (1/4).
    p = np.array([0.9, 0.6, 0.3, 0.1, 0.7, 0.2, 0.1, 0.0])
    d = np.array([1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
    miss = m.miss_rate(p, d, 0.5)
    fa = m.false_alarm_rate(p, d, 0.5)
    assert (miss.k, miss.n, miss.rate) == (2, 4, 0.5)
    assert (fa.k, fa.n, fa.rate) == (1, 4, 0.25)
    # A score equal to the threshold is a defect verdict.
    assert m.miss_rate(p, d, 0.6).k == 2
    assert m.false_alarm_rate(p, d, 0.7).k == 1


def test_decide_uses_threshold_then_argmax_over_defect_classes():
    classes = ["ok", "scratch", "dent"]
    probs = np.array(
        [
            [0.50, 0.30, 0.20],  # P(defect) .5: defect at t=.4, shown as scratch
            [0.70, 0.05, 0.25],  # P(defect) .3: ok at t=.4
            [0.10, 0.20, 0.70],  # dent
        ]
    )
    assert m.decide(probs, classes.index("ok"), 0.4).tolist() == [1, 0, 2]
    assert m.decide(probs, 0, 0.6).tolist() == [0, 0, 2]
    np.testing.assert_allclose(m.p_defect(probs, 0), [0.5, 0.3, 0.9])


def test_confusion_matrix_accuracy_and_per_class():
    y_true = [0, 0, 0, 1, 1, 2]
    y_pred = [0, 0, 1, 1, 2, 2]
    cm = m.confusion_matrix(y_true, y_pred, 3)
    assert cm.tolist() == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert m.accuracy(cm) == pytest.approx(4 / 6)
    pc = m.per_class(cm, ["ok", "scratch", "dent"])
    assert pc["ok"] == {"precision": 1.0, "recall": pytest.approx(2 / 3), "support": 3}
    assert pc["scratch"] == {"precision": 0.5, "recall": 0.5, "support": 2}
    assert pc["dent"] == {"precision": 0.5, "recall": 1.0, "support": 1}


def test_choose_threshold_no_miss_allowed_takes_the_gap_below_the_faintest_defect():
    # 10 defective, target 5 %: floor(0.5) = 0 misses allowed -> the highest threshold is
    # the faintest defect score .40; the largest OK score below it is .20 -> midpoint .30.
    defects = [0.95, 0.9, 0.9, 0.85, 0.8, 0.7, 0.66, 0.6, 0.5, 0.4]
    oks = [0.45, 0.2, 0.1, 0.05, 0.0]
    p = np.array(defects + oks)
    d = np.array([True] * 10 + [False] * 5)
    choice = m.choose_threshold(p, d, 0.05)
    assert choice.highest == 0.4
    assert choice.threshold == pytest.approx(0.3)
    assert choice.val_miss.k == 0
    # The OK image at .45 sits above the faintest defect: an unavoidable false alarm.
    assert (choice.val_false_alarm.k, choice.val_false_alarm.n) == (1, 5)
    assert choice.warnings  # 10 defects cannot support a 5 % target


def test_choose_threshold_allows_floor_target_times_n_misses():
    # 200 defective with scores 0.005, 0.010, ..., 1.0 and target 1 %: 2 misses allowed,
    # so the highest threshold is the third-lowest defect score, 0.015; no OK scores
    # below it except 0.0 -> threshold (0 + .015) / 2.
    defects = np.arange(1, 201) * 0.005
    oks = np.array([0.0, 0.5, 0.02])
    p = np.concatenate([defects, oks])
    d = np.concatenate([np.ones(200, bool), np.zeros(3, bool)])
    choice = m.choose_threshold(p, d, 0.01)
    assert choice.highest == pytest.approx(0.015)
    assert choice.threshold == pytest.approx(0.0075)
    assert choice.val_miss.k == 1  # only 0.005 lies below 0.0075
    assert choice.val_miss.rate <= 0.01
    assert choice.val_false_alarm.k == 2  # 0.5 and 0.02
    assert not choice.warnings


def test_choose_threshold_maximises_specificity_subject_to_target():
    rng = np.random.default_rng(0)
    p = np.concatenate([rng.beta(5, 1, 400), rng.beta(1, 5, 400)])
    d = np.concatenate([np.ones(400, bool), np.zeros(400, bool)])
    target = 0.02
    choice = m.choose_threshold(p, d, target)
    assert choice.val_miss.rate <= target
    # No threshold with a miss rate within target has fewer false alarms.
    for t in np.unique(p):
        if m.miss_rate(p, d, t).rate <= target:
            assert m.false_alarm_rate(p, d, t).k >= choice.val_false_alarm.k
    # Any threshold above `highest` exceeds the target.
    assert m.miss_rate(p, d, np.nextafter(choice.highest, 2.0)).rate > target


def test_operating_curve_endpoints_and_monotone():
    p = np.array([0.9, 0.6, 0.3, 0.7, 0.2, 0.1])
    d = np.array([1, 1, 1, 0, 0, 0], dtype=bool)
    t, miss, fa = m.operating_curve(p, d)
    assert miss[0] == 0.0 and fa[0] == 1.0  # threshold 0: everything defective
    assert miss[-1] == 1.0 and fa[-1] == 0.0  # above 1: everything OK
    assert np.all(np.diff(miss) >= 0) and np.all(np.diff(fa) <= 0)
    i = int(np.searchsorted(t, 0.6))
    assert (miss[i], fa[i]) == (pytest.approx(1 / 3), pytest.approx(1 / 3))


def test_support_warning():
    assert m.support_warning(598, 0.005) is None
    msg = m.support_warning(300, 0.005)
    assert msg is not None and "300" in msg and "598" in msg


def test_allowed_misses_rate_and_bound():
    assert m.allowed_misses(660, 0.005, "rate") == 3  # floor(3.3)
    # 660 defects: 0 misses -> bound 1 - 0.05^(1/660) = 0.45 % <= 0.5 %; 1 miss -> 0.72 %.
    assert m.allowed_misses(660, 0.005, "bound95") == 0
    # 2000 defects: the bound stays <= 0.5 % up to 4 misses (0.457 %), not 5 (0.525 %).
    assert m.allowed_misses(2000, 0.005, "bound95") == 4
    assert m.clopper_pearson_upper(4, 2000) <= 0.005 < m.clopper_pearson_upper(5, 2000)
    assert m.allowed_misses(100, 0.005, "bound95") == 0  # too few: no miss at all
    with pytest.raises(ValueError, match="bound95"):
        m.allowed_misses(10, 0.1, "bogus")


def test_choose_threshold_bound_calibration_is_stricter():
    # 700 defects scored 0.001 .. 0.7: "rate" may miss floor(3.5) = 3, "bound95" none.
    defects = np.arange(1, 701) * 0.001
    p = np.concatenate([defects, [0.0]])
    d = np.concatenate([np.ones(700, bool), [False]])
    assert m.choose_threshold(p, d, 0.005, "rate").highest == pytest.approx(0.004)
    strict = m.choose_threshold(p, d, 0.005, "bound95")
    assert strict.highest == pytest.approx(0.001) and strict.val_miss.k == 0


def test_class_names_are_drawn_as_written_not_as_formulas(tmp_path):
    """A class folder may be named `a$\\x$b` or `x^2$_$`: matplotlib's mathtext read two "$"
    as a formula and raised (after the whole training run, in its report) or typeset it."""
    from dtrain.evaluation import plots

    classes = ["ok", "a$\\x$b", "x^2$_$", "cost $5 or $6"]
    cm = np.diag([5, 1, 1, 1])
    result = {"confusion_matrix": cm.tolist(), "classes": classes, "threshold": 0.5}
    probs = np.full((8, 4), 0.25)
    targets = np.array([0, 0, 0, 0, 0, 1, 2, 3])
    result.update(false_alarm_rate=0.0, miss_rate=0.0, target_miss_rate=0.005)
    files = plots.write_eval_plots(tmp_path, result, probs, targets, 0)
    assert all((tmp_path / f).stat().st_size > 0 for f in files.values())
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    label = ax.text(0, 0, classes[3])
    assert label.get_parse_math() is False  # "cost $5 or $6" shows its dollars
    plt.close(fig)
