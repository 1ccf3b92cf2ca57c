"""`dtrain eval` and `dtrain quickstart`: evaluation for a target miss rate, and the whole recipe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
    app.command("quickstart")(quickstart_command)


def eval_command(
    checkpoint: Path = typer.Argument(..., help="A checkpoint written by `dtrain train` (OUTPUT/checkpoints/last.pt)."),
    data: str = typer.Argument(..., help="The data set root (with val and test splits), or a storage URL."),
    target_miss_rate: float = typer.Option(0.005, "--target-miss-rate", help="The miss rate the threshold must meet on validation."),
    calibration: str = typer.Option(
        "rate", "--calibration",
        help="rate: validation miss rate <= target; bound95: its 95 % upper bound <= target (stricter, fewer test misses).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the evaluation JSON to stdout instead of a table."),
    out: Path | None = typer.Option(None, "--out", help="Where to write evaluation.json and the plots (default: RUN/eval next to RUN/checkpoints)."),
    batch_size: int = typer.Option(256, "--batch-size", min=1, help="Images per inference batch."),
    threshold_scores: Path | None = typer.Option(
        None, "--threshold-scores", help="Choose the threshold on these scores (an .npz such as the out-of-fold "
        "WORKDIR/eval/oof_scores.npz of `dtrain quickstart --data`) instead of the validation split.",
    ),
) -> None:
    """Accuracy, miss rate with its 95 % upper bound, false-alarm rate, threshold and plots for a checkpoint."""
    from dtrain.evaluation.evaluate import evaluate, json_safe, load_scores
    from dtrain.progress import progress_bars

    out_dir = out or default_eval_dir(checkpoint)
    # Bars on stderr: with --json, stdout carries only the JSON.
    with progress_bars(sys.stderr) as bars:
        result = evaluate(
            checkpoint, data, target_miss_rate, calibration=calibration, out_dir=out_dir, batch_size=batch_size,
            progress=lambda split, total: bars(f"predict {split}", total),
            threshold_scores=load_scores(threshold_scores) if threshold_scores else None,
        )
    if as_json:
        typer.echo(json.dumps(json_safe(result), indent=2))
    else:
        print_summary(result, out_dir)


def default_eval_dir(checkpoint: Path) -> Path:
    """RUN/eval for RUN/checkpoints/last.pt; next to the file otherwise."""
    parent = checkpoint.resolve().parent
    return (parent.parent if parent.name == "checkpoints" else parent) / "eval"


def print_summary(result: dict, out_dir: Path | None = None, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    pct = lambda x: f"{100 * x:.2f} %"  # noqa: E731
    table = Table(title="test split", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("detail")
    if result["negative_class"] is None:  # a classifier: no miss rate to show (see its warning)
        table.add_row("accuracy", pct(result["accuracy"]), f"argmax over {len(result['classes'])} classes, {result['n_images']} images")
    else:
        _inspection_rows(table, result, pct)
    from dtrain.train.facts import describe

    table.add_row("trained with", "", describe(result.get("run")))
    for key in ("train_time_s", "total_time_s"):
        if key in result:
            value = result[key]
            table.add_row(key.replace("_", " "), f"{value:.0f}" if isinstance(value, float) else str(value), "")
    console.print(table)
    if result.get("threshold_setters"):
        console.print(_setters_table(result, pct))
    for warning in result.get("warnings", []):  # may name paths: no markup, no line breaks inside
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    if out_dir is not None:
        console.print(f"plots and evaluation.json in {out_dir}", markup=False, soft_wrap=True)


def _setters_table(result: dict, pct):
    """The faintest defects the threshold was chosen on: which photos decide the false alarms."""
    from rich.markup import escape
    from rich.table import Table

    from dtrain.printable import printable

    source = (result.get("threshold_basis") or {}).get("source", "validation split")
    table = Table(title=f"faintest defects of the {source}: they set the threshold", show_header=True)
    for name, justify in (("image", "left"), ("P(defect)", "right"), ("false alarms to catch it", "right"), ("caught", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for s in result["threshold_setters"]:
        where = "/".join(Path(s["path"]).parts[-2:])  # class folder and file: enough to find it
        table.add_row(escape(printable(where)), f"{s['p_defect']:.4f}", pct(s["false_alarm_rate_if_caught"]), "yes" if s["caught"] else "no")
    return table


def _inspection_rows(table, result: dict, pct) -> None:
    table.add_row("accuracy", pct(result["accuracy"]),
                  f"argmax {pct(result['accuracy_argmax'])}, OK/defect {pct(result['binary_accuracy'])}")
    ok = result["miss_rate"] <= result["target_miss_rate"]
    table.add_row("miss rate", f"[{'green' if ok else 'red'}]{pct(result['miss_rate'])}[/]",
                  f"{result['n_missed']}/{result['n_defective']} defective judged OK (target {pct(result['target_miss_rate'])})")
    table.add_row("miss rate 95 % upper", pct(result["miss_rate_upper95"]), "one-sided Clopper-Pearson")
    table.add_row("false-alarm rate", pct(result["false_alarm_rate"]), f"{result['n_false_alarms']}/{result['n_ok']} OK judged defective")
    basis = result.get("threshold_basis") or {"source": "validation split", "n_defective": result["validation"]["n_defective"]}
    table.add_row("threshold", f"{result['threshold']:.4f}",
                  f"on P(defect), chosen on {basis['source']} ({basis['n_defective']} defective)")


def quickstart_command(
    workdir: Path = typer.Option(Path("runs/quickstart"), "--workdir", help="Where data, checkpoints and the report go."),
    images: int | None = typer.Option(None, "--images", min=60, help="Images to synthesise (default: the recipe's, in dtrain/quickstart.py)."),
    epochs: int | None = typer.Option(None, "--epochs", min=1, help="Training epochs (default: the recipe's)."),
    nproc: int | None = typer.Option(None, "--nproc", min=1, help="DDP processes (default: one per GPU, else 2, capped by the cores)."),
    image_size: int | None = typer.Option(None, "--image-size", min=16, max=512, help="Image side in pixels (default: the recipe's)."),
    data: Path | None = typer.Option(
        None, "--data", help="Your own labelled images: ImageFolder ROOT/{train,val,test}/<class>, class folders ROOT/<class>, "
        "MVTec-AD, photos beside their masks (KolektorSDD2's 10000.png + 10000_GT.png) or a table of file and class "
        "(labels.csv); the layout is found and printed. "
        "The recipe decides input size, how the network sees and pools, sampling of rare classes and the training budget from them, and says why.",
    ),
    budget_minutes: float = typer.Option(
        30.0, "--budget-minutes", min=1.0, help="With --data: the whole run's wall-clock budget; a timed probe of "
        "this machine sets the input size and the images seen to fit it.",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic set and of the training (data order, augmentation, init)."),
    precision: str = typer.Option(
        "auto", "--precision", help="Training precision: auto = bf16 where the CPU (AVX512-BF16/AMX) or GPU has it, else fp32 (fp16 on older GPUs).",
    ),
    folds: int | None = typer.Option(
        None, "--folds", min=0, help="With --data: k-fold training for the threshold, 0 = none, at least 2 "
        "(default: the recipe decides from the defective validation images and the budget: 4 or 5 folds, or none).",
    ),
    fresh: bool = typer.Option(
        False, "--fresh", help="Start over. Without it, an unfinished run in WORKDIR (Ctrl-C, a crash) is continued when "
        "the options are the same: finished fold runs are kept, training resumes from its last checkpoint.",
    ),
) -> None:
    """The whole recipe on this machine: synthesise data (or use --data), train with DDP, evaluate, write report.json + report.html."""
    from dtrain.errors import DtrainError
    from dtrain.quickstart import QuickstartOptions, run_quickstart
    from dtrain.train.config import PRECISIONS

    if precision not in PRECISIONS:
        raise DtrainError(f"unknown precision {precision!r}", f"choose one of {', '.join(PRECISIONS)}")
    if folds == 1:
        raise DtrainError("--folds 1 holds nothing out", "use --folds 0 (the threshold from validation) or 2 and more")
    if data is not None and (images is not None or image_size is not None):
        raise DtrainError("--images and --image-size are for the synthetic run", "with --data the recipe decides the "
                          "input size (written to WORKDIR/train.yaml: edit it and run `dtrain train` to override)")
    options = QuickstartOptions(workdir=workdir, images=images, epochs=epochs, nproc=nproc, data=data,
                                budget_minutes=budget_minutes, folds=folds, seed=seed, precision=precision, fresh=fresh)
    if image_size is not None:
        options.image_size = image_size
    result = run_quickstart(options, stream=sys.stdout)
    from rich.console import Console

    console = Console()
    print_summary(result, None, console)
    console.print(f"report: {workdir / 'report.html'}  (JSON: {workdir / 'report.json'})", markup=False, soft_wrap=True)
    console.print(f"export: {export_command(result, workdir)}", markup=False, highlight=False, soft_wrap=True)


def export_command(result: dict, workdir: Path) -> str:
    """`dtrain export` of the evaluated checkpoint with the report's threshold: a k-fold final
    model has no validation split to choose one on, and the report's figures hold for it."""
    import shlex

    argv = ["dtrain", "export", result["checkpoint"], "--out", str(workdir / "model")]
    if result.get("task") != "classification":  # a classifier has no threshold
        argv += ["--threshold-from", str(workdir / "report.json")]
    return shlex.join(argv)
