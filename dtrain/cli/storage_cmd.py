"""`dtrain data push | verify | info`: put a data set on shared storage and check it.

Added to the `data` group of dtrain/cli/data_cmd.py (registered before this module).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable, Iterator

import typer

from dtrain.cli.data_cmd import data_app

_TIMEOUT = typer.Option(
    None, "--timeout", min=1.0,
    help="Seconds a store may stay silent before the command fails (default 60, or DTRAIN_STORAGE_TIMEOUT).",
)


@contextlib.contextmanager
def _bytes_progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback (bytes done, bytes total): a bar on a terminal, else one line
    per step (a shard) with the rate, so a log shows that the transfer moves."""
    if not sys.stderr.isatty():
        t0 = time.monotonic()

        def line(done: int, total: int) -> None:
            rate = done / max(time.monotonic() - t0, 1e-6)
            print(f"{label}: {_human(done)} of {_human(total)} ({done / max(total, 1):.0%}), {_human(rate)}/s",
                  file=sys.stderr, flush=True)

        yield line
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM ends the command like Ctrl-C does: through its cleanup (staging files)."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


@data_app.command()
def push(
    src: str = typer.Argument(..., help="Local data set folder (ImageFolder / MVTec / `dtrain data synth` output)."),
    dest: str = typer.Argument(..., help="Where to put the shards: a path, NAS mount or s3://bucket/prefix."),
    shard_size: str = typer.Option("256MB", "--shard-size", help="Target size of one shard (e.g. 256MB, 1GiB)."),
    layout: str = typer.Option("imagefolder", "--layout", help="Source layout: imagefolder, classfolders or mvtec."),
    category: str | None = typer.Option(None, "--category", help="MVTec-AD category folder under SRC."),
    negative_class: str = typer.Option("ok", "--negative-class", help="The class of defect-free parts."),
    split: list[str] = typer.Option([], "--split", help="Only these splits (default: train, val, test if present)."),
    recheck: bool = typer.Option(False, "--recheck", help="Re-read shards already on DEST and replace damaged ones."),
    timeout: float | None = _TIMEOUT,
) -> None:
    """Pack SRC into WebDataset shards at DEST (resumable: a re-run uploads only what is missing)."""
    from dtrain.configio import validate
    from dtrain.data.config import DataConfig
    from dtrain.data.shard_push import parse_size
    from dtrain.data.shard_push import push as do_push
    from dtrain.data.storage import open_store

    cfg = validate(DataConfig, {"root": src, "layout": layout, "category": category, "negative_class": negative_class},
                   "command line")
    size = parse_size(shard_size)
    store = open_store(dest, timeout=timeout)
    with _sigterm_unwinds(), _bytes_progress("push") as progress:
        report = do_push(cfg, store, size, progress=progress, splits=list(split) or None, recheck=recheck)
    counts = ", ".join(f"{k} {v}" for k, v in report.splits.items())
    typer.echo(
        f"pushed {counts} images to {report.address}: {report.shards_total} shards, "
        f"{len(report.shards_uploaded)} uploaded, {len(report.shards_skipped)} already there; "
        f"{_human(report.bytes_uploaded)} in {report.seconds:.1f} s ({_human(report.bytes_per_s)}/s)"
    )
    if report.superseded:
        typer.echo(f"{report.superseded} object(s) of earlier versions remain on {report.address}: "
                   f"`dtrain data gc {report.address}` removes them once no job reads them")


@data_app.command()
def verify(
    dest: str = typer.Argument(..., help="A pushed data set: path or s3://bucket/prefix."),
    timeout: float | None = _TIMEOUT,
) -> None:
    """Re-read every shard and index of DEST and check sizes and sha256 checksums."""
    from dtrain.data.shard_verify import verify as do_verify
    from dtrain.data.storage import open_store
    from dtrain.errors import DtrainError

    with _bytes_progress("verify") as progress:
        report = do_verify(open_store(dest, timeout=timeout), progress=progress)
    for name, problem in report.problems:
        typer.echo(f"BAD  {name}: {problem}")
    if not report.ok:
        raise DtrainError(f"{report.address}: {len(report.problems)} of {report.checked} objects failed verification",
                          "replace them with `dtrain data push SRC DEST --recheck`")
    typer.echo(f"ok: {report.address}: {report.checked} objects, {_human(report.bytes)}, all checksums match")


@data_app.command()
def gc(
    dest: str = typer.Argument(..., help="A pushed data set: path or s3://bucket/prefix."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
    timeout: float | None = _TIMEOUT,
) -> None:
    """Remove the shards and indexes of earlier versions of DEST (and of interrupted pushes).

    Run it when no push to DEST is running and no job still reads an earlier version."""
    from dtrain.data.shard_verify import collect_garbage
    from dtrain.data.storage import open_store

    store = open_store(dest, timeout=timeout)
    names = collect_garbage(store, dry_run=dry_run)
    for name in names:
        typer.echo(f"{'would remove' if dry_run else 'removed'} {name}")
    typer.echo(f"{store.display}: {len(names)} object(s) of earlier versions {'found' if dry_run else 'removed'}")


@data_app.command()
def info(
    dest: str = typer.Argument(..., help="A pushed data set: path or s3://bucket/prefix."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    timeout: float | None = _TIMEOUT,
) -> None:
    """Counts per split and class of a pushed data set, and its fingerprint."""
    from dtrain.data.shard_verify import info as do_info
    from dtrain.data.storage import open_store

    data = do_info(open_store(dest, timeout=timeout))
    if as_json:
        typer.echo(json.dumps(data, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    classes = data["classes"]
    table = Table(title=f"{data['address']}  ({data['container']}, fingerprint {data['fingerprint'][:12]})")
    for col in ("split", "images", "shards", "size", *classes):
        table.add_column(col, justify="left" if col == "split" else "right")
    for name, s in data["splits"].items():
        table.add_row(name, str(s["count"]), str(s["shards"]), _human(s["bytes"]),
                      *(str(s["class_counts"].get(c, 0)) for c in classes))
    Console().print(table)
    typer.echo(f"negative class: {data['negative_class']}")


def register(app: typer.Typer) -> None:
    # The commands are already on data_app, which data_cmd registered as `dtrain data`.
    pass
