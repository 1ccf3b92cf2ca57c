"""PNG figures of an evaluation (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dtrain.evaluation import metrics as M


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # never needs a display, safe in workers and CI
    # Class and metric names are the user's and are drawn as given: with mathtext on, a name
    # holding two "$" was typeset as a formula, or raised and ended the evaluation.
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def write_eval_plots(
    out_dir: Path, result: dict[str, Any], probs: np.ndarray, targets: np.ndarray, negative_index: int | None
) -> dict[str, str]:
    """Write the evaluation figures; returns {figure: file name in out_dir}. A classification
    task (no negative class) has only the confusion matrix: there is no P(defect) to plot."""
    if negative_index is None:
        confusion_matrix(np.asarray(result["confusion_matrix"]), result["classes"], out_dir / "confusion_matrix.png", "predicted")
        return {"confusion_matrix": "confusion_matrix.png"}
    p_def = M.p_defect(probs, negative_index)
    is_defect = targets != negative_index
    files = {
        "confusion_matrix": "confusion_matrix.png",
        "score_histogram": "score_histogram.png",
        "miss_vs_false_alarm": "miss_vs_false_alarm.png",
    }
    confusion_matrix(np.asarray(result["confusion_matrix"]), result["classes"], out_dir / files["confusion_matrix"])
    score_histogram(p_def, is_defect, result["threshold"], out_dir / files["score_histogram"])
    miss_vs_false_alarm(p_def, is_defect, result, out_dir / files["miss_vs_false_alarm"])
    return files


def confusion_matrix(cm: np.ndarray, classes: list[str], path: Path, xlabel: str = "predicted (at the threshold)") -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(classes), 0.6 + 0.8 * len(classes)), dpi=110)
    # Log colour scale: the diagonal has hundreds, the errors that matter have one or two.
    ax.imshow(np.log1p(cm), cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("true")
    top = np.log1p(cm.max()) if cm.size else 1.0
    for (i, j), v in np.ndenumerate(cm):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=8,
                color="white" if np.log1p(v) > 0.6 * top else ("crimson" if v and i != j else "black"))
    ax.set_title("test confusion matrix")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def score_histogram(p_def: np.ndarray, is_defect: np.ndarray, threshold: float, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    bins = np.linspace(0.0, 1.0, 51)
    ax.hist(p_def[~is_defect], bins=bins, alpha=0.6, label=f"OK ({int((~is_defect).sum())})", color="tab:green")
    ax.hist(p_def[is_defect], bins=bins, alpha=0.6, label=f"defective ({int(is_defect.sum())})", color="tab:red")
    ax.axvline(threshold, color="black", linestyle="--", label=f"threshold {threshold:.3f}")
    ax.set_yscale("log")  # the tails near the threshold are what matter
    ax.set_xlabel("P(defect)")
    ax.set_ylabel("test images")
    ax.legend(fontsize=8)
    ax.set_title("P(defect) on the test split")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def miss_vs_false_alarm(p_def: np.ndarray, is_defect: np.ndarray, result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    _, miss, alarm = M.operating_curve(p_def, is_defect)
    fig, ax = plt.subplots(figsize=(5, 4), dpi=110)
    ax.step(alarm, miss, where="post", color="tab:blue", label="test split, every threshold")
    ax.plot([result["false_alarm_rate"]], [result["miss_rate"]], "o", color="black",
            label=f"operating point (t={result['threshold']:.3f})")
    ax.axhline(result["target_miss_rate"], color="tab:red", linestyle=":", label="target miss rate")
    # Linear near zero so a 0 % rate is on the chart, logarithmic beyond.
    lin = 1.0 / max(int(is_defect.sum()), int((~is_defect).sum()), 10)
    ax.set_xscale("symlog", linthresh=lin)
    ax.set_yscale("symlog", linthresh=lin)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("false-alarm rate (OK judged defective)")
    ax.set_ylabel("miss rate (defective judged OK)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def training_curves(records: list[dict[str, Any]], path: Path) -> bool:
    """Loss / accuracy / learning rate over steps from the trainer's JSONL records.

    Numeric fields are plotted against `step`; returns False when there is nothing to plot.
    """
    series: dict[str, tuple[list[float], list[float]]] = {}
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, (int, float)):
            continue
        # The trainer's rows carry kind "train" or "val" (dtrain.train.logs).
        prefix = f"{rec['kind']}_" if isinstance(rec.get("kind"), str) else ""
        for key, value in rec.items():
            if key in ("step", "epoch", "time", "samples") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            xs, ys = series.setdefault(prefix + key, ([], []))
            xs.append(float(step))
            ys.append(float(value))
    groups = {
        "loss": [k for k in series if "loss" in k],
        "accuracy": [k for k in series if "acc" in k],
        "learning rate": [k for k in series if k.endswith("lr")],
    }
    groups = {name: keys for name, keys in groups.items() if keys}
    if not groups:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), dpi=110, squeeze=False)
    for ax, (name, keys) in zip(axes[0], groups.items()):
        for key in sorted(keys):
            xs, ys = series[key]
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set_xlabel("step")
        ax.set_title(name)
        if name == "loss":
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
