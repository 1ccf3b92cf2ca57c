"""Evaluate a checkpoint for inspection: threshold on validation, figures on test.

`evaluate` returns the evaluation dict of DESIGN.md. Its accuracy figures:
- `accuracy`: multi-class accuracy with the decision threshold applied (an image is
  predicted OK when P(defect) < threshold, otherwise as its most likely defect class);
  the class-level confusion matrix and per-class figures use the same predictions.
- `accuracy_argmax`: plain argmax accuracy, no threshold.
- `binary_accuracy`: OK-vs-defect verdicts at the threshold, whatever the defect class.

`task` is "inspection" there. A model trained without a defect-free class
(`negative_class` None) is a classifier: `task` "classification", argmax accuracy,
per-class figures, the confusion matrix and the misclassified images, and no miss,
false-alarm or threshold figures (a note in `warnings` says why).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dtrain.data.masks import mark_output
from dtrain.errors import DtrainError
from dtrain.evaluation import metrics as M
from dtrain.printable import printable

if TYPE_CHECKING:  # torch is imported only once there is something to predict
    from dtrain.evaluation.predict import Predictions

# How many misclassified test images the evaluation names (the report shows them).
MAX_LISTED_ERRORS = 24


NO_NEGATIVE_NOTE = (
    "no defect-free class (negative_class is null): a classification task; miss-rate, false-alarm "
    "and threshold figures are left out, since a miss is a defective part judged OK"
)


def summarise(
    classes: list[str],
    negative_index: int | None,
    val: Predictions,
    test: Predictions,
    target_miss_rate: float,
    calibration: str = "rate",
    source: str = "validation split",
) -> dict[str, Any]:
    """The evaluation dict from validation and test predictions (pure: no I/O).

    `val` is what the threshold is chosen on: the validation split's predictions, or the
    out-of-fold scores of k-fold training (`source` says which, in words)."""
    if len(val) == 0 or len(test) == 0:
        empty = "validation" if len(val) == 0 else "test"
        raise DtrainError(f"the {empty} split has no readable images", "check the data set (dtrain data synth OUT makes one)")
    if negative_index is None:
        return summarise_classification(classes, val, test)
    val_p_def = M.p_defect(val.probs, negative_index)
    choice = M.choose_threshold(val_p_def, val.targets != negative_index, target_miss_rate, calibration)
    t = choice.threshold
    p_def = M.p_defect(test.probs, negative_index)
    is_defect = test.targets != negative_index
    pred = M.decide(test.probs, negative_index, t)
    cm = M.confusion_matrix(test.targets, pred, len(classes))
    argmax_cm = M.confusion_matrix(test.targets, test.probs.argmax(axis=1), len(classes))
    miss = M.miss_rate(p_def, is_defect, t)
    alarm = M.false_alarm_rate(p_def, is_defect, t)
    basis = M.threshold_basis(choice, target_miss_rate, calibration, source)
    # The basis's warning says what choose_threshold's does, and what it costs, in plainer words.
    warnings = [basis["warning"]] if basis["warning"] else list(choice.warnings)
    setters = M.threshold_setters(val_p_def, val.targets != negative_index, t)
    if (called_out := M.setter_warning(setters, lambda i: printable(val.paths[i]), source)) is not None:
        warnings.append(called_out)
    support = M.support_warning(miss.n, target_miss_rate)
    if support:
        warnings.append(support)
    elif miss.upper95 > target_miss_rate:
        warnings.append(
            f"the 95% upper bound on the test miss rate ({miss.upper95:.2%}) is above the "
            f"{target_miss_rate:.2%} target: {miss.k} of {miss.n} defective test images were missed"
        )
    if test.bad_files or val.bad_files:
        warnings.append(f"{len(test.bad_files) + len(val.bad_files)} unreadable images were skipped (see bad_files)")
    missed_idx = np.flatnonzero(is_defect & (p_def < t))
    alarm_idx = np.flatnonzero(~is_defect & (p_def >= t))
    return {
        "task": "inspection",
        "classes": list(classes),
        "negative_class": classes[negative_index],
        "accuracy": M.accuracy(cm),
        "accuracy_argmax": M.accuracy(argmax_cm),
        "binary_accuracy": float(np.mean((p_def >= t) == is_defect)),
        "miss_rate": miss.rate,
        "miss_rate_upper95": miss.upper95,
        "n_missed": miss.k,
        "false_alarm_rate": alarm.rate,
        "false_alarm_rate_upper95": alarm.upper95,
        "n_false_alarms": alarm.k,
        "threshold": t,
        "threshold_highest": choice.highest,
        "target_miss_rate": target_miss_rate,
        "calibration": calibration,
        "min_defective_for_target": M.min_defective_for_target(target_miss_rate),
        "per_class": M.per_class(cm, classes),
        "confusion_matrix": cm.tolist(),
        "n_images": len(test),
        "n_defective": miss.n,
        "n_ok": alarm.n,
        "threshold_basis": basis,
        "validation": {
            "n_images": len(val),
            "n_defective": choice.val_miss.n,
            "miss_rate": choice.val_miss.rate,
            "false_alarm_rate": choice.val_false_alarm.rate,
        },
        # The faintest defects the threshold was chosen on, and what keeping each caught costs.
        "threshold_setters": [{**_error(val, x.index, val_p_def), "false_alarm_rate_if_caught": x.false_alarm_rate,
                               "caught": x.caught} for x in setters],
        "misses": [_error(test, i, p_def) for i in _worst(missed_idx, p_def, ascending=True)],
        "false_alarms": [_error(test, i, p_def) for i in _worst(alarm_idx, p_def, ascending=False)],
        "bad_files": sorted(test.bad_files + val.bad_files),
        "warnings": warnings,
    }


def summarise_classification(classes: list[str], val: Predictions, test: Predictions) -> dict[str, Any]:
    """The evaluation dict of a model without a negative class: which class, how often right."""
    pred = test.probs.argmax(axis=1)
    cm = M.confusion_matrix(test.targets, pred, len(classes))
    confidence = test.probs.max(axis=1)
    wrong = np.flatnonzero(pred != test.targets)
    # Most confident mistakes first: those are the ones a second look at the labels needs.
    wrong = wrong[np.argsort(-confidence[wrong], kind="stable")][:MAX_LISTED_ERRORS]
    warnings = [NO_NEGATIVE_NOTE]
    if test.bad_files or val.bad_files:
        warnings.append(f"{len(test.bad_files) + len(val.bad_files)} unreadable images were skipped (see bad_files)")
    return {
        "task": "classification",
        "classes": list(classes),
        "negative_class": None,
        "accuracy": M.accuracy(cm),
        "accuracy_argmax": M.accuracy(cm),
        "per_class": M.per_class(cm, classes),
        "confusion_matrix": cm.tolist(),
        "n_images": len(test),
        "validation": {
            "n_images": len(val),
            "accuracy": float(np.mean(val.probs.argmax(axis=1) == val.targets)),
        },
        "errors": [
            {"path": test.paths[i], "label": int(test.targets[i]), "predicted": int(pred[i]), "p": float(confidence[i])}
            for i in wrong
        ],
        "bad_files": sorted(test.bad_files + val.bad_files),
        "warnings": warnings,
    }


def _worst(idx: np.ndarray, p_def: np.ndarray, *, ascending: bool) -> list[int]:
    order = np.argsort(p_def[idx], kind="stable")
    if not ascending:
        order = order[::-1]
    return [int(i) for i in idx[order][:MAX_LISTED_ERRORS]]


def _error(pred: Predictions, i: int, p_def: np.ndarray) -> dict[str, Any]:
    return {"path": pred.paths[i], "label": int(pred.targets[i]), "p_defect": float(p_def[i])}


def evaluate(
    checkpoint: str | Path,
    data: Any,
    target_miss_rate: float = 0.005,
    *,
    calibration: str = "rate",
    out_dir: str | Path | None = None,
    batch_size: int = 256,
    device: str | None = None,
    num_workers: int = 1,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
    threshold_scores: Predictions | None = None,
    threshold_source: str = "out-of-fold scores",
) -> dict[str, Any]:
    """Evaluate `checkpoint` on the val and test splits of `data` (a DataConfig or a data root).

    With `threshold_scores` (out-of-fold predictions of k-fold training, see
    dtrain/recipe/folds.py) the threshold is chosen on those instead, and only the test
    split is predicted: a model trained on train + val has seen the validation split.

    `progress(split, total)` returns a per-batch callback (the CLI shows a bar).
    With `out_dir`, also writes `evaluation.json` and the PNG plots there.
    """
    if not 0.0 < target_miss_rate < 1.0:
        raise DtrainError(f"target miss rate must be between 0 and 1, got {target_miss_rate}", "e.g. --target-miss-rate 0.005")
    if calibration not in M.CALIBRATIONS:
        raise DtrainError(f"unknown calibration {calibration!r}", f"choose one of: {', '.join(M.CALIBRATIONS)}")
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise DtrainError(f"checkpoint not found: {checkpoint}", "train one with `dtrain train CONFIG` (it writes OUTPUT/checkpoints/last.pt)")
    _check_root(str(getattr(data, "root", data)))

    import torch

    from dtrain.data.datasets import open_split
    from dtrain.evaluation.predict import predict_split
    from dtrain.train.checkpoint import load_for_inference

    model, meta = load_for_inference(str(checkpoint), map_location="cpu")
    cfg = _data_config(data, meta)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    classes = list(meta["classes"])
    negative_index = None if meta["negative_class"] is None else classes.index(meta["negative_class"])
    if threshold_scores is None and not cfg.val_split:
        raise DtrainError(
            f"{checkpoint} was trained without a validation split (k-fold: on all of train + val), so there is none to "
            "choose the threshold on", "pass the out-of-fold scores: --threshold-scores WORKDIR/eval/oof_scores.npz",
        )
    preds: dict[str, Predictions] = {}
    for split in (cfg.test_split,) if threshold_scores is not None else (cfg.val_split, cfg.test_split):
        ds = open_split(cfg, split, train=False)
        if list(ds.classes) != classes:
            raise DtrainError(
                f"the data set's classes {list(ds.classes)} differ from the model's {classes}",
                "evaluate on a data set with the classes the model was trained on",
            )
        callback = progress(split, len(ds)) if progress else None
        preds[split] = predict_split(
            model, ds, mean=meta["mean"], std=meta["std"], batch_size=batch_size,
            device=dev, num_workers=num_workers, progress=callback,
        )
    if threshold_scores is None:
        result = summarise(classes, negative_index, preds[cfg.val_split], preds[cfg.test_split], target_miss_rate, calibration)
    else:
        result = summarise(classes, negative_index, threshold_scores, preds[cfg.test_split], target_miss_rate, calibration,
                           threshold_source)
    result["checkpoint"] = str(checkpoint)
    result["data_root"] = cfg.root
    result["image_size"] = int(meta["image_size"])
    result["image_width"] = meta.get("image_width")  # None: a square
    # What trained the model (precision, device, processor, world size, seed, torch) and
    # where this evaluation ran (always fp32: predict_split uses no autocast).
    result["run"] = meta.get("run")
    result["eval_device"] = _device_name(dev)
    result["score"] = meta["score"]  # what P(defect) is: the classifier's, or pooled with its mask head
    if out_dir is not None:
        write_outputs(Path(out_dir), result, preds[cfg.test_split])
    return result


def _device_name(dev) -> str:
    import torch

    from dtrain.train.facts import cpu_model

    return f"cuda ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else f"cpu ({cpu_model()})"


def _data_config(data: Any, meta: dict[str, Any]):
    """A DataConfig for evaluation: the given one, or the training run's settings at the given root; the model's image size."""
    from dtrain.data.config import DataConfig
    from dtrain.evaluation.run_data import run_data_config
    from dtrain.train.checkpoint import input_fields

    if isinstance(data, DataConfig):
        return data.model_copy(update=input_fields(meta))
    return run_data_config(meta, str(data))


def _check_root(root: str) -> None:
    if "://" not in root and not Path(root).is_dir():
        raise DtrainError(f"data directory not found: {root}", "create one with `dtrain data synth DIR`, or pass the right path")


def write_outputs(out_dir: Path, result: dict[str, Any], test: Predictions) -> None:
    """evaluation.json, the PNG plots, and the raw test scores (scores.npz) in `out_dir`."""
    from dtrain.evaluation import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    mark_output(out_dir)
    negative = result["negative_class"]
    negative_index = None if negative is None else result["classes"].index(negative)
    result["plots"] = plots.write_eval_plots(out_dir, result, test.probs, test.targets, negative_index)
    np.savez_compressed(out_dir / "scores.npz", probs=test.probs, targets=test.targets)
    (out_dir / "evaluation.json").write_text(json.dumps(json_safe(result), indent=2) + "\n")


def json_safe(obj: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def save_scores(path: Path, pred: Predictions) -> None:
    """Predictions (e.g. out-of-fold scores) -> an .npz that `load_scores` and `dtrain eval --threshold-scores` read."""
    np.savez_compressed(path, probs=pred.probs, targets=pred.targets, paths=np.asarray(pred.paths, dtype=str),
                        bad_files=np.asarray(pred.bad_files, dtype=str))


def load_scores(path: Path) -> Predictions:
    from dtrain.evaluation.predict import Predictions

    if not Path(path).is_file():
        raise DtrainError(f"scores file not found: {path}", "dtrain quickstart --data writes WORKDIR/eval/oof_scores.npz")
    with np.load(path) as z:
        bad = [str(p) for p in z["bad_files"]] if "bad_files" in z.files else []  # absent in files from before it was kept
        return Predictions(probs=z["probs"], targets=z["targets"], paths=[str(p) for p in z["paths"]], bad_files=bad)
