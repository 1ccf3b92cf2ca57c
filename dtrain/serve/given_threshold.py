"""A threshold the export takes instead of choosing: from a report.json, or a bare number.

A k-fold quickstart (dtrain/recipe/oof.py) chooses its threshold on out-of-fold scores
and then trains the final model on train + val merged: no labelled image is left that
the final model has not seen, so its export must take the report's threshold rather
than choose one on its own training images. A report is taken only for the model it
evaluated: same task, classes, negative class, input size and architecture, and, when
the report's checkpoint is still where the report says, the same checkpoint file, and the
same P(defect) score.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError
from dtrain.models.config import SCORE_CLASSIFIER

OTHER_REPORT_HINT = "pass the report.json of the run that trained this checkpoint, or --threshold P to take a number as it is"


@dataclass(frozen=True)
class GivenThreshold:
    threshold: float
    rule: str  # model.json threshold_rule
    source: str  # model.json threshold_source: where the number came from, in words
    target_miss_rate: float | None  # what it was chosen for, when the source says
    # Chosen on the checkpoint's own validation split (a quickstart without k-fold): the
    # export may choose a quantised backend's threshold there by the same rule and target.
    on_validation: bool = False


def from_number(p: float) -> GivenThreshold:
    return GivenThreshold(threshold=p, rule="given", source=f"--threshold {p:g}", target_miss_rate=None)


def from_report(path: Path, checkpoint: Path, meta: dict[str, Any]) -> GivenThreshold:
    """The threshold of `path` (a quickstart report.json or an evaluation.json) for the
    checkpoint at `checkpoint` (its inference `meta`); refused if the report is of another model."""
    report = _read(path)
    if report.get("task") == "classification" or report.get("negative_class") is None:
        raise DtrainError(f"{path} is the report of a classification task (no defect-free class): it has no threshold",
                          "export without --threshold-from: a classifier's verdict is its most likely class")
    theirs_ours = [
        ("classes", report.get("classes"), list(meta["classes"])),
        ("negative class", report.get("negative_class"), meta["negative_class"]),
        ("image size", report.get("image_size", meta["image_size"]), int(meta["image_size"])),
        ("image width", report.get("image_width"), meta.get("image_width")),
        ("architecture", ((report.get("config") or {}).get("model") or {}).get("arch", _arch(meta)), _arch(meta)),
        # A threshold is a point on one score's scale: the classifier's P(defect) or the
        # one pooled with the mask head (model.score_with_mask). Reports before the field: the classifier's.
        ("P(defect) score", report.get("score", SCORE_CLASSIFIER), meta.get("score", SCORE_CLASSIFIER)),
    ]
    for what, theirs, ours in theirs_ours:
        if theirs != ours:
            raise DtrainError(f"{path} is the report of another model ({what}: {theirs!r} there, {ours!r} in the checkpoint)",
                              OTHER_REPORT_HINT)
    evaluated = _evaluated_checkpoint(report, path)
    if evaluated is not None and evaluated.is_file() and not _same_file(evaluated, checkpoint):
        raise DtrainError(f"{path} evaluated {evaluated}, not {checkpoint}: its threshold was set for that checkpoint",
                          f"export {evaluated}, or {OTHER_REPORT_HINT}")
    threshold = report.get("threshold")
    if not isinstance(threshold, (int, float)) or not 0.0 < threshold < 1.0:
        raise DtrainError(f"{path} holds no threshold between 0 and 1 (threshold: {threshold!r})",
                          "pass the report.json or evaluation.json of an inspection run, or --threshold P")
    basis = report.get("threshold_basis") or {}
    rule = basis.get("calibration") or report.get("calibration") or "rate"
    source = f"{basis.get('source', 'validation split')}, rule {rule}, from {path.resolve()}"
    return GivenThreshold(threshold=float(threshold), rule=rule, source=source, target_miss_rate=report.get("target_miss_rate"),
                          on_validation=basis.get("source") == "validation split" and rule in ("rate", "bound95"))


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DtrainError(f"report not found: {path}", "dtrain quickstart writes WORKDIR/report.json; dtrain eval --out DIR "
                          "writes DIR/evaluation.json")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DtrainError(f"{path} is not a JSON report: {exc}", "pass WORKDIR/report.json of dtrain quickstart") from None
    if not isinstance(report, dict):
        raise DtrainError(f"{path} is not a report (a JSON object)", "pass WORKDIR/report.json of dtrain quickstart")
    return report


def _arch(meta: dict[str, Any]) -> str | None:
    return ((meta.get("config") or {}).get("model") or {}).get("arch")


def _evaluated_checkpoint(report: dict[str, Any], path: Path) -> Path | None:
    """Where the report's checkpoint is now: a quickstart report names it under its workdir,
    which may have been moved or copied together with report.json since."""
    if not report.get("checkpoint"):
        return None
    named = Path(report["checkpoint"])
    workdir = report.get("workdir")
    if workdir is not None and named.is_relative_to(workdir):
        return path.parent / named.relative_to(workdir)
    return named


def _same_file(a: Path, b: Path) -> bool:
    from dtrain.serve.model_dir import sha256_file

    return a.resolve() == b.resolve() or sha256_file(a) == sha256_file(b)
