"""A self-contained HTML report of a training + evaluation run.

Every figure and sample image is embedded as a data URI, so the one file can be mailed
or attached to a ticket and still shows everything.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from dtrain.models.config import SCORE_CLASSIFIER, SCORE_POOLED

# How many missed / falsely alarmed test images the report shows.
MAX_SAMPLES = 12


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a torn last line (a killed writer) is skipped."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _data_uri(path: Path, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _img(path: Path, alt: str, cls: str = "") -> str:
    if not path.is_file():
        return f"<p class=missing>({html.escape(alt)}: {html.escape(str(path))} not found)</p>"
    return f'<img class="{cls}" alt="{html.escape(alt)}" src="{_data_uri(path)}">'


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100.0 * x:.2f} %"


def _row(*cells: Any, head: bool = False) -> str:
    tag = "th" if head else "td"
    return "<tr>" + "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in cells) + "</tr>"


_CALIBRATION_TEXT = {
    "rate": "its miss rate within target",
    "bound95": "the 95 % upper bound of its miss rate within target",
}


def _is_classification(report: dict[str, Any]) -> bool:
    return report.get("negative_class", "") is None


def _classification_rows(report: dict[str, Any]) -> list[tuple[str, Any, str]]:
    val = report.get("validation", {})
    return [
        ("test images", report["n_images"], f"{len(report['classes'])} classes, none of them defect-free"),
        ("accuracy", _pct(report["accuracy"]), "most likely class (argmax)"),
        ("validation accuracy", _pct(val.get("accuracy")), f"{val.get('n_images', 0)} images"),
    ]


def _inspection_rows(report: dict[str, Any]) -> list[tuple[str, Any, str]]:
    target = report["target_miss_rate"]
    return [
        ("test images", report["n_images"], f"{report['n_defective']} defective, {report['n_ok']} OK"),
        ("accuracy (at the threshold)", _pct(report["accuracy"]), f"argmax {_pct(report.get('accuracy_argmax'))}, "
         f"OK/defect {_pct(report.get('binary_accuracy'))}"),
        ("miss rate", _pct(report["miss_rate"]), f"{report['n_missed']} of {report['n_defective']} defective judged OK; "
         f"target {_pct(target)}"),
        ("miss rate, 95 % upper bound", _pct(report["miss_rate_upper95"]), "one-sided Clopper-Pearson"),
        ("false-alarm rate", _pct(report["false_alarm_rate"]), f"{report['n_false_alarms']} of {report['n_ok']} OK judged defective"),
        ("decision threshold on P(defect)", f"{report['threshold']:.4f}",
         f"chosen on the {(report.get('threshold_basis') or {}).get('source', 'validation split')} "
         f"({_CALIBRATION_TEXT.get(report.get('calibration', 'rate'), '')})"),
        *_basis_rows(report.get("threshold_basis")),
    ]


def _basis_rows(basis: dict[str, Any] | None) -> list[tuple[str, Any, str]]:
    """What the threshold rests on (evaluate's `threshold_basis`); older reports have none."""
    if not basis:
        return []
    return [
        ("threshold chosen on", basis["source"], f"{basis['n_defective']} defective, {basis['n_ok']} OK images; rule: "
         f"{basis['calibration']}, {basis['rule']}"),
        ("best miss-rate bound these defects can show", _pct(basis["achievable_miss_rate_upper95"]),
         f"95 % upper bound with {basis['n_missed']} of {basis['n_defective']} missed; the target needs "
         f"{basis['defective_needed_for_target']} defective images with none missed"),
        ("false alarms it costs", _pct(basis["false_alarm_rate"]), f"on the {basis['n_ok']} OK images of the same scores"),
    ]


def _summary(report: dict[str, Any]) -> str:
    rows = _classification_rows(report) if _is_classification(report) else _inspection_rows(report)
    rows += _run_rows(report)
    if "train_time_s" in report:
        rows.append(("training time", f"{report['train_time_s']:.0f} s", f"{report.get('train_images_per_s', 0):.0f} images/s"))
    if "total_time_s" in report:
        rows.append(("whole quickstart", f"{report['total_time_s']:.0f} s", "data + training + evaluation"))
    body = "".join(_row(*r) for r in rows)
    return f"<table class=summary>{_row('figure', 'value', 'detail', head=True)}{body}</table>"


def _run_rows(report: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """What trained the model: a bf16 run and an fp32 run of one recipe score differently."""
    run = report.get("run")
    if not run:
        return [("trained with", "unknown", "the checkpoint predates run facts")]
    if run.get("device") == "cuda":
        device = ("device", "cuda", run.get("gpu", ""))
    else:
        features = ", ".join(f"{k}: {'yes' if run.get(k) else 'no'}" for k in ("avx512_bf16", "amx"))
        device = ("device", "cpu", f"{run.get('cpu', '')}; {features}")
    emulated = " (emulated: this CPU has no native bf16)" if run.get("bf16_native") is False else ""
    score = report.get("score", SCORE_CLASSIFIER)  # reports before the field: the classifier's
    return [
        ("training precision", run.get("precision"), f"resolved from the config's precision{emulated}"),
        device,
        ("DDP world size", run.get("world_size"), report.get("backend", "")),
        ("seed", run.get("seed"), f"torch {run.get('torch', '')}"),
        ("evaluated on", report.get("eval_device", ""), "fp32"),
        ("P(defect) from", score, SCORE_DETAIL.get(score, "")),
    ]


# Why a reader should care which score decided (dtrain/models/defect_score.py).
SCORE_DETAIL = {
    SCORE_CLASSIFIER: "the class probabilities alone",
    SCORE_POOLED: "the classifier's P(defect) pooled with the mask head's most defective cell",
}


def _per_class(report: dict[str, Any]) -> str:
    classes = report["classes"]
    rows = [_row(name, f"{v['precision']:.3f}", f"{v['recall']:.3f}", v["support"]) for name, v in report["per_class"].items()]
    cm_rows = [_row(classes[i], *r) for i, r in enumerate(report["confusion_matrix"])]
    return (
        "<div class=pair><table>" + _row("class", "precision", "recall", "support", head=True) + "".join(rows) + "</table>"
        "<table>" + _row("true \\ predicted", *classes, head=True) + "".join(cm_rows) + "</table></div>"
    )


def _samples(title: str, errors: list[dict[str, Any]], classes: list[str]) -> str:
    if not errors:
        return f"<h3>{html.escape(title)}</h3><p>none</p>"
    cells = []
    for e in errors[:MAX_SAMPLES]:
        path = Path(e["path"])
        label = classes[e["label"]] if 0 <= e["label"] < len(classes) else e["label"]
        if "predicted" in e:  # a classification error: which class it was taken for
            caption = f"{label} judged {classes[e['predicted']]} (p {e['p']:.3f})"
        else:
            caption = f"{label}, P(defect) {e['p_defect']:.3f}"
        if "false_alarm_rate_if_caught" in e:  # a threshold setter: what keeping it caught costs
            caption += (f"; {'caught' if e['caught'] else 'let through'}; catching it flags "
                        f"{_pct(e['false_alarm_rate_if_caught'])} of good parts")
        cells.append(f"<figure>{_img(path, path.name, 'sample')}<figcaption>{html.escape(caption)}<br>"
                     f"<small>{html.escape(path.name)}</small></figcaption></figure>")
    more = f"<p>{len(errors) - MAX_SAMPLES} more in report.json</p>" if len(errors) > MAX_SAMPLES else ""
    return f"<h3>{html.escape(title)} ({len(errors)})</h3><div class=samples>{''.join(cells)}</div>{more}"


_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.5em 1.5em 1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f2f2f2}.pass{color:#17743a}.fail{color:#b00020}.warn{background:#fff4d6;padding:0.5em 1em}
.pair{display:flex;flex-wrap:wrap}.plots img{max-width:48%;margin:0.3em}img.curves{max-width:100%}
.samples{display:flex;flex-wrap:wrap}figure{margin:0.3em;text-align:center;font-size:0.8em;max-width:200px}
img.sample{width:128px;height:128px;image-rendering:pixelated;border:1px solid #999}
pre{background:#f7f7f7;padding:0.6em;overflow:auto;font-size:0.8em}
"""


def render_html(report: dict[str, Any], eval_dir: Path, curves_png: Path | None = None, title: str = "dtrain report") -> str:
    """The report page; figures are read from `eval_dir` (the files evaluate wrote)."""
    if _is_classification(report):
        verdict = f"<p><b>classification: accuracy {_pct(report['accuracy'])}</b> (no defect-free class, so no miss rate)</p>"
        errors = [_samples("Misclassified test images", report.get("errors", []), report["classes"])]
    else:
        ok = report["miss_rate"] <= report["target_miss_rate"]
        verdict = (f"<p class={'pass' if ok else 'fail'}><b>miss rate {_pct(report['miss_rate'])} "
                   f"{'meets' if ok else 'misses'} the {_pct(report['target_miss_rate'])} target</b>; "
                   f"accuracy {_pct(report['accuracy'])}</p>")
        source = (report.get("threshold_basis") or {}).get("source", "validation split")
        errors = [
            _samples(f"The faintest defects of the {source}: they set the threshold", report.get("threshold_setters", []),
                     report["classes"]),
            _samples("Missed defects (defective judged OK)", report.get("misses", []), report["classes"]),
            _samples("False alarms (OK judged defective)", report.get("false_alarms", []), report["classes"]),
        ]
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in report.get("warnings", []))
    plots = report.get("plots", {})
    parts = [
        f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        verdict,
        f"<div class=warn><b>Warnings</b><ul>{warnings}</ul></div>" if warnings else "",
        "<h2>Summary</h2>", _summary(report),
        "<h2>Training</h2>",
        _img(curves_png, "training curves", "curves") if curves_png else "<p>no training metrics log</p>",
        "<h2>Evaluation on the test split</h2>",
        "<div class=plots>" + "".join(_img(eval_dir / f, name) for name, f in plots.items()) + "</div>",
        _per_class(report),
        "<h2>Errors</h2>",
        *errors,
    ]
    if report.get("recipe"):  # dtrain quickstart --data: what the recipe decided from the data, and why
        rows = "".join(_row(d["field"], d["value"], d["reason"]) for d in report["recipe"])
        parts += ["<h2>Recipe</h2>", f"<table>{_row('field', 'value', 'reason', head=True)}{rows}</table>"]
    if report.get("config"):
        parts += ["<h2>Configuration</h2>", f"<pre>{html.escape(json.dumps(report['config'], indent=2))}</pre>"]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(
    out_dir: Path, report: dict[str, Any], eval_dir: Path, metrics_jsonl: Path | None = None, title: str = "dtrain report"
) -> tuple[Path, Path]:
    """Write `out_dir/report.json` and `out_dir/report.html` (+ training_curves.png)."""
    from dtrain.evaluation import plots
    from dtrain.evaluation.evaluate import json_safe

    out_dir.mkdir(parents=True, exist_ok=True)
    curves = None
    if metrics_jsonl is not None:
        curves = eval_dir / "training_curves.png"
        if not plots.training_curves(read_jsonl(metrics_jsonl), curves):
            curves = None
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(json_safe(report), indent=2) + "\n")
    html_path = out_dir / "report.html"
    # A file name of bytes that are not UTF-8 (a Windows zip's) is kept by Python as surrogates, which
    # a UTF-8 write refuses: shown as a replacement character rather than losing the report at the end of a run.
    html_path.write_text(render_html(report, eval_dir, curves, title), encoding="utf-8", errors="replace")
    return json_path, html_path
