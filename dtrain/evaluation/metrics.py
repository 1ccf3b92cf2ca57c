"""Inspection metrics: pure functions of scores and labels (numpy + scipy, no torch).

Vocabulary (DESIGN.md): P(defect) = 1 - softmax probability of the negative class.
A part is judged defective iff P(defect) >= threshold; the class shown for a defective
verdict is the most likely defect class. A *miss* is a defective part judged OK; a
*false alarm* is an OK part judged defective. Without a negative class
(`negative_index` None: defect types only, a classification task) every part is
defective by definition: P(defect) is 1 and the verdict's class is the argmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


def clopper_pearson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided upper confidence bound on a binomial rate after k events in n trials.

    With k = 0 this is 1 - (1 - confidence)^(1/n) (the "rule of three" is its
    approximation); in general the `confidence` quantile of Beta(k + 1, n - k).
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0 or k == n:
        return 1.0
    if k == 0:
        return 1.0 - (1.0 - confidence) ** (1.0 / n)
    # Imported here: the inspection runtime uses this module's verdict functions and
    # must not load scipy (tests/test_runtime_imports.py).
    from scipy.stats import beta

    return float(beta.ppf(confidence, k + 1, n - k))


def min_defective_for_target(target_miss_rate: float, confidence: float = 0.95) -> int:
    """Fewest defective images for which 0 misses puts the upper bound at or under target.

    Solves 1 - (1 - confidence)^(1/n) <= t, i.e. n >= ln(1 - confidence) / ln(1 - t).
    For t = 0.5 % and 95 % confidence that is 598.
    """
    if not 0.0 < target_miss_rate < 1.0:
        raise ValueError(f"target miss rate must be in (0, 1), got {target_miss_rate}")
    n = math.ceil(math.log(1.0 - confidence) / math.log(1.0 - target_miss_rate))
    # Guard the float edge where the ceiling lands one short.
    while clopper_pearson_upper(0, n, confidence) > target_miss_rate:
        n += 1
    return n


def p_defect(probs: np.ndarray, negative_index: int | None) -> np.ndarray:
    """P(defect) per row of class probabilities [N, C] (1 without a negative class)."""
    probs = np.asarray(probs, dtype=np.float64)
    if negative_index is None:
        return np.ones(len(probs))
    return 1.0 - probs[:, negative_index]


def decide(probs: np.ndarray, negative_index: int | None, threshold: float) -> np.ndarray:
    """Predicted class per image with the decision threshold applied.

    Defective verdict (P(defect) >= threshold) -> the argmax over the defect classes;
    otherwise the negative class. At threshold 0.5 on two classes this is plain argmax.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if negative_index is None:
        return probs.argmax(axis=1)
    defect_probs = probs.copy()
    defect_probs[:, negative_index] = -np.inf
    pred = defect_probs.argmax(axis=1)
    pred[p_defect(probs, negative_index) < threshold] = negative_index
    return pred


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> np.ndarray:
    """cm[i, j] = number of images of true class i predicted as class j."""
    y_true = np.asarray(y_true, dtype=np.int64)
    y_pred = np.asarray(y_pred, dtype=np.int64)
    cm = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(cm, (y_true, y_pred), 1)
    return cm


def accuracy(cm: np.ndarray) -> float:
    total = int(cm.sum())
    return float(np.trace(cm)) / total if total else 0.0


def per_class(cm: np.ndarray, classes: list[str]) -> dict[str, dict[str, float | int]]:
    """Precision, recall and support per class (0.0 where undefined: nothing predicted / no support)."""
    out: dict[str, dict[str, float | int]] = {}
    for i, name in enumerate(classes):
        tp = int(cm[i, i])
        predicted = int(cm[:, i].sum())
        support = int(cm[i, :].sum())
        out[name] = {
            "precision": tp / predicted if predicted else 0.0,
            "recall": tp / support if support else 0.0,
            "support": support,
        }
    return out


@dataclass(frozen=True)
class Rate:
    """k events out of n, with the rate and its one-sided 95 % upper bound."""

    k: int
    n: int

    @property
    def rate(self) -> float:
        return self.k / self.n if self.n else 0.0

    @property
    def upper95(self) -> float:
        return clopper_pearson_upper(self.k, self.n, 0.95)


def miss_rate(p_def: np.ndarray, is_defect: np.ndarray, threshold: float) -> Rate:
    """Defective images judged OK (P(defect) < threshold) out of all defective images."""
    p_def, is_defect = np.asarray(p_def), np.asarray(is_defect, dtype=bool)
    return Rate(int(np.sum(p_def[is_defect] < threshold)), int(is_defect.sum()))


def false_alarm_rate(p_def: np.ndarray, is_defect: np.ndarray, threshold: float) -> Rate:
    """OK images judged defective (P(defect) >= threshold) out of all OK images."""
    p_def, is_defect = np.asarray(p_def), np.asarray(is_defect, dtype=bool)
    return Rate(int(np.sum(p_def[~is_defect] >= threshold)), int((~is_defect).sum()))


@dataclass(frozen=True)
class ThresholdChoice:
    threshold: float
    # The highest threshold with the same validation figures; `threshold` sits in the
    # middle of the score gap below it, so unseen defects a little fainter than the
    # faintest validation defect are still caught at no cost in validation false alarms.
    highest: float
    val_miss: Rate
    val_false_alarm: Rate
    warnings: list[str] = field(default_factory=list)


# How the validation split sets the threshold (see allowed_misses).
CALIBRATIONS = ("rate", "bound95")


def allowed_misses(n_defective: int, target_miss_rate: float, calibration: str = "rate") -> int:
    """How many validation misses a threshold may make.

    "rate": the miss rate itself stays within target (floor(target * n)).
    "bound95": the one-sided 95 % Clopper-Pearson upper bound stays within target, so a
    threshold that meets it on validation is likely to meet it on new parts too; 0 when
    even no miss cannot bring the bound under target (too few defective images).
    """
    if calibration == "rate":
        return math.floor(target_miss_rate * n_defective + 1e-9)
    if calibration == "bound95":
        k = 0
        while k + 1 < n_defective and clopper_pearson_upper(k + 1, n_defective) <= target_miss_rate:
            k += 1
        return k
    raise ValueError(f"unknown calibration {calibration!r}; valid: {', '.join(CALIBRATIONS)}")


def choose_threshold(
    p_defect_val: np.ndarray, is_defect_val: np.ndarray, target_miss_rate: float, calibration: str = "rate"
) -> ThresholdChoice:
    """The decision threshold that keeps validation misses within target with the fewest false alarms.

    With defect scores sorted d_0 <= d_1 <= ..., at most m misses are allowed (see
    `allowed_misses`; for "rate" m = floor(target * n)); the highest threshold missing
    no more than m is d_m (a score equal to the threshold counts as defective). Every
    threshold in (o, d_m], where o is the largest OK score below d_m, gives the same
    validation misses and false alarms; we return the midpoint of that gap (see
    ThresholdChoice.highest).
    """
    scores = np.asarray(p_defect_val, dtype=np.float64)
    is_defect = np.asarray(is_defect_val, dtype=bool)
    if not 0.0 < target_miss_rate < 1.0:
        raise ValueError(f"target miss rate must be in (0, 1), got {target_miss_rate}")
    defect_scores = np.sort(scores[is_defect])
    warnings: list[str] = []
    if defect_scores.size == 0:
        highest = threshold = 0.5
        warnings.append("the validation split has no defective images; threshold left at 0.5")
    else:
        allowed = allowed_misses(defect_scores.size, target_miss_rate, calibration)
        highest = float(defect_scores[allowed])
        ok_below = scores[~is_defect][scores[~is_defect] < highest]
        low = float(ok_below.max()) if ok_below.size else 0.0
        threshold = (low + highest) / 2.0
        if allowed == 0 and clopper_pearson_upper(0, defect_scores.size) > target_miss_rate:
            warnings.append(
                f"the validation split has only {defect_scores.size} defective images: too few to "
                f"calibrate a {target_miss_rate:.2%} miss rate; the threshold allows no validation miss"
            )
    return ThresholdChoice(
        threshold=threshold,
        highest=highest,
        val_miss=miss_rate(scores, is_defect, threshold),
        val_false_alarm=false_alarm_rate(scores, is_defect, threshold),
        warnings=warnings,
    )


# How many of the lowest-scored defects of the threshold's basis the evaluation names.
SETTERS = 5
# The faintest defect is called out when keeping it caught costs at least this share of
# good parts (a line's usual tolerance for re-inspection) and twice what the next one would.
SETTER_ALARM = 0.05


@dataclass(frozen=True)
class Setter:
    """One of the lowest-scored defects the threshold was chosen on: `index` into the scores,
    its score, and the false alarms (on the same scores' good parts) of the highest threshold
    that still catches it, which is what keeping it caught costs."""

    index: int
    score: float
    false_alarm_rate: float
    caught: bool  # by the chosen threshold


def threshold_setters(p_def: np.ndarray, is_defect: np.ndarray, threshold: float, n: int = SETTERS) -> list[Setter]:
    """The `n` lowest-scored defects, faintest first. On a small validation split the
    threshold sits just under the faintest, so one faint (or mislabelled) defect can set the
    false alarms of the whole line: naming them, with their price, says which photos to look at."""
    p_def = np.asarray(p_def, dtype=np.float64)
    is_defect = np.asarray(is_defect, dtype=bool)
    ok = np.sort(p_def[~is_defect])
    idx = np.flatnonzero(is_defect)
    lowest = idx[np.argsort(p_def[idx], kind="stable")][:n]
    # A threshold at a defect's score catches it (>= is defective) and flags every OK score at or above it.
    alarms = (ok.size - np.searchsorted(ok, p_def[lowest], side="left")) / max(ok.size, 1)
    return [Setter(int(i), float(p_def[i]), float(a), bool(p_def[i] >= threshold)) for i, a in zip(lowest, alarms)]


def setter_warning(setters: list[Setter], name: Callable[[int], str], source: str) -> str | None:
    """Plain words when one defect sets most of the false alarms: which one, and what to do."""
    if len(setters) < 2 or not setters[0].caught:
        return None
    first, second = setters[0], setters[1]
    if first.false_alarm_rate < SETTER_ALARM or second.false_alarm_rate > first.false_alarm_rate / 2:
        return None
    return (
        f"One defect sets the threshold: {name(first.index)} ({source}) scores P(defect) {first.score:.3f}, lower "
        f"than {first.false_alarm_rate:.1%} of the good parts score, and the threshold that catches it flags them "
        f"all; the next faintest would cost {second.false_alarm_rate:.1%}. Look at it: if it is not a defect, or "
        f"within specification, "
        f"correct its label; if it is one, the model needs more labelled defects like it (the report lists the "
        f"faintest {len(setters)})."
    )


def operating_curve(p_def: np.ndarray, is_defect: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(thresholds, miss rates, false-alarm rates) at every distinct score, ascending thresholds."""
    p_def = np.asarray(p_def, dtype=np.float64)
    is_defect = np.asarray(is_defect, dtype=bool)
    thresholds = np.unique(np.concatenate([p_def, [0.0, 1.0 + 1e-12]]))
    d = np.sort(p_def[is_defect])
    o = np.sort(p_def[~is_defect])
    # Misses: defect scores strictly below t; false alarms: OK scores at or above t.
    misses = np.searchsorted(d, thresholds, side="left") / max(d.size, 1)
    alarms = (o.size - np.searchsorted(o, thresholds, side="left")) / max(o.size, 1)
    return thresholds, misses, alarms


def support_warning(n_defective: int, target_miss_rate: float, confidence: float = 0.95) -> str | None:
    """A plain warning when the split is too small for the bound ever to reach the target."""
    need = min_defective_for_target(target_miss_rate, confidence)
    if n_defective >= need:
        return None
    return (
        f"the test split has {n_defective} defective images; even with 0 misses the {confidence:.0%} "
        f"upper bound on the miss rate cannot go below {target_miss_rate:.2%} with fewer than {need}"
    )


# What the threshold rule promises, in words (report.json and the HTML say it).
RULE_TEXT = {
    "rate": "the miss rate on the scored defects stays within target",
    "bound95": "the 95 % upper bound of the miss rate on the scored defects stays within target "
               "(no miss at all when there are too few defects for any miss to be allowed)",
}


def threshold_basis(choice: ThresholdChoice, target_miss_rate: float, calibration: str, source: str) -> dict:
    """What the threshold rests on: the rule, the defects it was chosen on, the best miss-rate
    bound those defects can show (e.g. about 3/n for no miss out of n), and the false alarms
    it costs on the same scores; `source` says where the scores came from, in words."""
    n, m = choice.val_miss.n, choice.val_miss.k
    need = min_defective_for_target(target_miss_rate)
    bound = clopper_pearson_upper(m, n)
    basis = {
        "source": source,
        "calibration": calibration,
        "rule": RULE_TEXT[calibration],
        "n_defective": n,
        "n_ok": choice.val_false_alarm.n,
        "n_missed": m,
        "achievable_miss_rate_upper95": bound,
        "false_alarm_rate": choice.val_false_alarm.rate,
        "defective_needed_for_target": need,
        "target_shown": bound <= target_miss_rate,
    }
    basis["warning"] = None if basis["target_shown"] else _not_shown(basis, target_miss_rate)
    return basis


def _not_shown(b: dict, target: float) -> str:
    """The plain-words warning for a quality engineer: what is and is not proven, and what it costs."""
    if b["n_defective"] == 0:
        return (f"There is no defective image in the {b['source']}, so nothing is known about how many defects the "
                f"threshold lets through. Label at least {b['defective_needed_for_target']} defective images.")
    missed = "lets none of them through" if b["n_missed"] == 0 else f"lets {b['n_missed']} of them through"
    return (
        f"The {target:.1%} miss-rate target is not proven. The threshold rests on {b['n_defective']} defective "
        f"images ({b['source']}) and {missed}. With that many, the data can show only that fewer than "
        f"{b['achievable_miss_rate_upper95']:.1%} of defects are missed (95 % confidence); showing {target:.1%} needs "
        f"at least {b['defective_needed_for_target']} defective images with none missed. Keeping the scored defects "
        f"caught flags {b['false_alarm_rate']:.1%} of good parts as defective. Collect about "
        f"{b['defective_needed_for_target'] - b['n_defective']} more labelled defective images before relying on "
        f"the {target:.1%} figure."
    )
