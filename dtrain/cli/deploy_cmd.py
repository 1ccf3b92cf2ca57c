"""`dtrain export`, `dtrain inspect`, `dtrain serve`: the model leaves the cluster.

Only typer and the standard library at module level; everything heavy is imported in
the command bodies so that `dtrain --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer


def export(
    checkpoint: Path = typer.Argument(..., help="A dtrain checkpoint (OUTPUT/checkpoints/last.pt)."),
    out: Path = typer.Option(..., "--out", "-o", help="The model directory to write (replaced if it holds a model)."),
    format: str = typer.Option("all", "--format", help="Networks to write: onnx, torch (a torch.export program), or all."),
    quantize: str = typer.Option(
        "auto", "--quantize",
        help="auto (int8, and bf16 where the machine has it, each kept only within target), none, int8 or bf16 (each required).",
    ),
    data: str | None = typer.Option(None, "--data", help="Data root whose val split verifies the export (default: the training run's)."),
    calibration: str | None = typer.Option(None, "--calibration", help="Images (dir or glob) to calibrate int8 on (default: 256 of the val split)."),
    target_miss_rate: float | None = typer.Option(
        None, "--target-miss-rate", help="The threshold keeps the val miss rate at or under this (default: the report's "
        "with --threshold-from, else 0.005).",
    ),
    threshold_rule: str = typer.Option(
        "bound95", "--threshold-rule",
        help="bound95: the val miss rate's 95 % upper bound <= target; rate: the val miss rate itself (as `dtrain eval --calibration`).",
    ),
    threshold_from: Path | None = typer.Option(
        None, "--threshold-from", help="Take the threshold of this report (WORKDIR/report.json of `dtrain quickstart`, "
        "needed for its k-fold final model) instead of choosing it on the val split.",
    ),
    threshold: float | None = typer.Option(None, "--threshold", help="Take this threshold on P(defect), 0 < P < 1, instead of choosing it."),
    backends: str | None = typer.Option(None, "--backends", help="Comma-separated backends to verify and time (default: all that apply)."),
) -> None:
    """Export a checkpoint to a verified, self-contained model directory."""
    from rich.console import Console

    from dtrain.configio import validate
    from dtrain.extras import require

    if format != "torch":  # a torch.export program needs nothing beyond torch
        require("serve", f"dtrain export --format {format}", ("onnx", "onnxscript", "onnxruntime"))
    from dtrain.serve.export import ExportOptions
    from dtrain.serve.export import export as run_export

    opts = validate(ExportOptions, {
        "checkpoint": str(checkpoint), "out": str(out), "format": format, "quantize": quantize, "data": data,
        "calibration": calibration, "target_miss_rate": target_miss_rate,
        "threshold_rule": threshold_rule, "threshold": threshold,
        "threshold_from": None if threshold_from is None else str(threshold_from),
        "backends": [b.strip() for b in backends.split(",") if b.strip()] if backends else None,
    }, "the command line")
    console = Console(stderr=True)
    if not console.is_terminal:
        # A pipe or log file has no width: 80 columns would fold the table's headers and
        # cut backend names; a terminal keeps its own width.
        console.width = max(console.width, 120)
    with console.status("exporting") as status:
        card = run_export(opts, step=lambda msg: status.update(msg))
    _print_card(console, card, out)


def _print_card(console, card, out: Path) -> None:
    from rich.table import Table

    choice = next(c for c in card.machine_choices.values() if c.source == "export")
    table = Table(title=f"{out}: the checkpoint's threshold {card.threshold:.4f} for a target miss rate of {card.target_miss_rate:.2%} "
                        f"({card.threshold_rule})")
    split = next(iter(card.verification.values())).split  # every backend is verified on the same images
    for col in ("backend", "threshold", "verdict agreement", f"{split} miss rate", f"images/s @ {choice.batch}", "chosen"):
        table.add_column(col)
    for row in sorted(choice.rows, key=lambda r: -(r.images_per_s or -1.0)):
        chosen = "chosen" if row.backend == choice.backend else ("" if row.eligible else row.note)
        table.add_row(row.backend, "-" if row.threshold is None else f"{row.threshold:.4f}", _pct(row.verdict_agreement),
                      _pct(row.miss_rate), "-" if row.images_per_s is None else f"{row.images_per_s:.1f}", chosen)
    console.print(table)
    console.print(f"threshold: {card.threshold_source}", highlight=False, soft_wrap=True)
    for note in card.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def inspect(
    model_dir: Path = typer.Argument(..., help="A model directory from `dtrain export`."),
    inputs: list[str] = typer.Argument(..., help="Image files, directories (searched recursively) or quoted globs."),
    out: Path | None = typer.Option(None, "--out", "-o", help="results.csv or results.jsonl (format by extension)."),
    batch: int = typer.Option(32, "--batch", min=1, help="Images per inference batch."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Decoding threads (default: one per core)."),
    backend: str | None = typer.Option(None, "--backend", help="Override the model directory's preferred backend."),
    json_summary: bool = typer.Option(False, "--json", help="Also print the summary (counts, images/s, stages) as JSON on stdout."),
) -> None:
    """Inspect images offline: a verdict per image, to CSV/JSONL, and a summary."""
    import json

    from rich.console import Console
    from rich.markup import escape

    from dtrain.cores import usable_cores
    from dtrain.errors import ExitStatus
    from dtrain.printable import printable
    from dtrain.serve.inspect_batch import check_output, collect_inputs
    from dtrain.serve.predictor import Predictor

    if out is not None:
        check_output(out)
    skipped: dict[str, str] = {}
    paths = collect_inputs(inputs, skipped)
    predictor = Predictor(model_dir, backend)
    console = Console(stderr=True)
    if skipped:
        path, why = next(iter(skipped.items()))
        console.print(f"note: {len(skipped)} ground-truth mask{'s' if len(skipped) != 1 else ''} beside the photos "
                      f"not inspected (e.g. {printable(path)}: {why})", markup=False, highlight=False)
    try:
        summary = _inspect_with_bar(console, predictor, paths, out, batch, workers or usable_cores())
    except KeyboardInterrupt as exc:
        # Typer turns a Ctrl-C into a bare exit 130 before dtrain's main sees it: the note
        # saying where the rows judged so far are would never be printed.
        for line in ("dtrain: interrupted", *getattr(exc, "__notes__", ())):
            console.print(printable(line), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(int(ExitStatus.INTERRUPTED)) from None
    # Paths are the user's: never read as markup, never broken across lines (soft_wrap),
    # so a piped or logged summary can be searched and copied.
    console.print(
        f"{summary.images} images: [green]{summary.ok} ok[/], [red]{summary.defect} defect[/], "
        f"[yellow]{summary.errors} unreadable[/] in {summary.seconds:.1f} s "
        f"({summary.images_per_s:.0f} images/s, backend {predictor.backend})"
        + (f" -> {escape(str(out))}" if out else ""), soft_wrap=True,
    )
    console.print(f"time per stage (thread-seconds): {summary.stages.describe()}", highlight=False, soft_wrap=True)
    for path in summary.error_paths[:10]:
        console.print(f"  unreadable: {printable(str(path))}", markup=False, highlight=False, soft_wrap=True)
    if json_summary:
        typer.echo(json.dumps({**summary.as_json(), "backend": predictor.backend, "out": str(out) if out else None}))


def _inspect_with_bar(console, predictor, paths: list[Path], out: Path | None, batch: int, workers: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dtrain.serve.inspect_batch import run_inspection

    columns = (TextColumn("inspecting"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn())
    # Rich draws the bar only on a terminal; piped or in a log, the summary alone is printed.
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("inspect", total=len(paths), rate="")

        def advance(n: int) -> None:
            bar.advance(task, n)
            speed = bar.tasks[task].speed
            bar.update(task, rate=f"{speed:.0f} images/s" if speed else "")

        return run_inspection(predictor, paths, out, batch=batch, workers=workers, progress=advance)


def serve(
    model_dir: Path = typer.Argument(..., help="A model directory from `dtrain export`."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on (0: any free one, printed)."),
    max_batch: int = typer.Option(32, "--max-batch", min=1, help="Largest micro-batch."),
    max_wait_ms: float = typer.Option(
        0.0, "--max-wait-ms", min=0.0,
        help="How long an image reaching an idle network waits for batch mates (under load, batches form while it runs).",
    ),
    max_body_mb: float = typer.Option(64.0, "--max-body-mb", min=0.001, help="Largest request body."),
    max_megapixels: float = typer.Option(40.0, "--max-megapixels", min=0.001, help="Largest image, checked before decoding."),
    max_decode_mb: float = typer.Option(160.0, "--max-decode-mb", min=0.001,
                                        help="Largest decoded image (pixels x bytes per pixel), checked before decoding."),
    decode_budget_mb: float = typer.Option(320.0, "--decode-budget-mb", min=0.001,
                                           help="Decoded pixels in flight, all requests together (large images take turns)."),
    request_timeout_s: float = typer.Option(60.0, "--request-timeout-s", min=0.001, help="A request gets a 504 after this."),
    client_timeout_s: float = typer.Option(
        10.0, "--client-timeout-s", min=0.001,
        help="A connection whose request head takes longer is closed; an upload silent this long gets a 408.",
    ),
    backend: str | None = typer.Option(None, "--backend", help="Override the model directory's preferred backend."),
) -> None:
    """Serve the model over HTTP: POST /inspect, /healthz, /metrics, /openapi.json."""
    from dtrain.extras import require

    require("serve", "dtrain serve", ("fastapi", "uvicorn", "python_multipart"))
    import uvicorn

    from dtrain.configio import validate
    from dtrain.errors import DtrainError
    from dtrain.serve.app import ServeLimits, create_app
    from dtrain.serve.listen import listen
    from dtrain.serve.slow_clients import head_deadline_protocol, raise_open_file_limit
    from dtrain.serve.predictor import Predictor

    limits = validate(ServeLimits, {
        "max_batch": max_batch, "max_wait_ms": max_wait_ms, "max_body_bytes": int(max_body_mb * 1024 * 1024),
        "max_pixels": int(max_megapixels * 1_000_000), "max_decode_bytes": int(max_decode_mb * 1_000_000),
        "decode_budget_bytes": int(decode_budget_mb * 1_000_000), "request_timeout_s": request_timeout_s,
        "client_timeout_s": client_timeout_s,
    }, "the command line")
    predictor = Predictor(model_dir, backend)
    # Bound here, before uvicorn starts, so that "serving on" is only ever printed for a
    # socket that listens, with the real port when --port 0 asked for any.
    try:
        sock = listen(host, port)
    except OSError as exc:
        raise DtrainError(f"cannot listen on {_in_url(host)}:{port}: {exc.strerror or exc}",
                          "choose another --port (or --host), or stop what listens there") from None
    bound = sock.getsockname()[1]
    # SIGTERM and Ctrl-C: uvicorn stops accepting, gives running requests a few seconds, then ends.
    raise_open_file_limit()  # each client holds a descriptor: as many as the system allows, not a shell's 1024
    server = uvicorn.Server(uvicorn.Config(create_app(predictor, limits), log_level="warning", timeout_graceful_shutdown=5,
                                           http=head_deadline_protocol(limits.client_timeout_s)))
    typer.echo(f"serving {model_dir} on http://{_in_url(host)}:{bound} (backend {predictor.backend}; API at /openapi.json)", err=True)
    server.run(sockets=[sock])


def _in_url(host: str) -> str:
    """An IPv6 address in brackets, as a URL writes it: http://[::1]:8000."""
    return f"[{host}]" if ":" in host else host


def register(app: typer.Typer) -> None:
    app.command(name="export")(export)
    app.command(name="inspect")(inspect)
    app.command(name="serve")(serve)
