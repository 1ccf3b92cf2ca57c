"""`dtrain data ...`: create and look at data sets.

`data_app` is shared: the storage commands (push/verify/info) are added to it by
dtrain/cli/storage_cmd.py, whose register() runs after this one.
"""

from __future__ import annotations

from pathlib import Path

import typer

data_app = typer.Typer(help="Create, pack and inspect data sets.", no_args_is_help=True)


@data_app.command()
def synth(
    out: Path = typer.Argument(..., help="Directory to write OUT/{train,val,test}/<class>/*.png into."),
    images: int = typer.Option(3000, "--images", "-n", help="Total number of images over all splits."),
    size: int = typer.Option(64, "--size", help="Image side in pixels."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same bytes."),
    difficulty: float = typer.Option(0.5, "--difficulty", help="0 = bold defects .. 1 = many faint, small ones."),
    ok_fraction: float = typer.Option(0.45, "--ok-fraction", help="Share of defect-free images in every split."),
    workers: int = typer.Option(0, "--workers", help="Processes to render with (0 = one per CPU core)."),
    force: bool = typer.Option(False, "--force", help="Replace a data set already in OUT."),
    grid: Path | None = typer.Option(None, "--grid", help="Also write a sample grid PNG (one row per class) here."),
) -> None:
    """Generate a deterministic synthetic surface-defect data set (metal textures, 6 classes)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dtrain.data.synth import sample_grid, synthesize

    console = Console(stderr=True)
    columns = (TextColumn("synth"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("synth", total=images)
        manifest = synthesize(
            out,
            images=images,
            size=size,
            seed=seed,
            progress=lambda k: bar.advance(task, k),
            difficulty=difficulty,
            ok_fraction=ok_fraction,
            workers=workers or None,
            force=force,
        )
    per_split = ", ".join(f"{split} {sum(c.values())}" for split, c in manifest["counts"].items())
    typer.echo(f"wrote {images} images of {size} px to {out} ({per_split}); manifest: {out / 'manifest.json'}")
    if grid is not None:
        typer.echo(f"sample grid: {sample_grid(grid, seed=seed, difficulty=difficulty)}")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
