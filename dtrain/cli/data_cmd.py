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
    profile: str = typer.Option(
        "quickstart", "--profile",
        help="quickstart: 64 px colour tiles, 45 % OK, equal classes. plant: 256-512 px grey and colour parts, "
             "~85 % OK, rare classes, small faint defects, several on one part (dtrain/data/synth_plant.py).",
    ),
    images: int | None = typer.Option(None, "--images", "-n", help="Total number of images over all splits [profile: 3000]."),
    size: int | None = typer.Option(None, "--size", help="Image side in pixels; plant: the largest side [profile: 64 / 512]."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same bytes."),
    difficulty: float | None = typer.Option(None, "--difficulty", help="0 = bold defects .. 1 = many faint, small ones [profile: 0.5 / 0.7]."),
    ok_fraction: float | None = typer.Option(None, "--ok-fraction", help="Share of defect-free images in every split [profile: 0.45 / 0.85]."),
    workers: int = typer.Option(0, "--workers", help="Processes to render with (0 = one per CPU core)."),
    force: bool = typer.Option(False, "--force", help="Replace a data set already in OUT."),
    masks: bool | None = typer.Option(None, "--masks/--no-masks", help="Write each defective picture's defect mask "
                                      "beside it (<name>_mask.png: the pixels its defects changed), as segmentation "
                                      "sets ship them [profile: plant yes, quickstart no]."),
    grid: Path | None = typer.Option(None, "--grid", help="Also write a sample grid PNG (one row per class) here."),
) -> None:
    """Generate a deterministic synthetic surface-defect data set (metal textures, 6 classes)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dtrain.data.synth import PROFILES, sample_grid, synthesize
    from dtrain.errors import DtrainError

    if profile not in PROFILES:
        raise DtrainError(f"unknown profile {profile!r}", f"choose one of: {', '.join(PROFILES)}")
    images = images or PROFILES[profile].images

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
            profile=profile,
            difficulty=difficulty,
            ok_fraction=ok_fraction,
            workers=workers or None,
            force=force,
            masks=masks,
        )
    per_split = ", ".join(f"{split} {sum(c.values())}" for split, c in manifest["counts"].items())
    sides = f"{manifest['size'] // 2}-{manifest['size']}" if "sides" in manifest else manifest["size"]
    typer.echo(f"wrote {images} images of {sides} px ({profile} profile) to {out} ({per_split}); manifest: {out / 'manifest.json'}")
    if grid is not None:
        typer.echo(f"sample grid: {sample_grid(grid, seed=seed, difficulty=manifest['difficulty'], profile=profile)}")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
