"""The `dtrain` command: the root app, and the one place errors become exit codes.

Each command module registers its commands on the root app. They import only typer at
module level; torch and every other heavy dependency are imported inside the command
bodies so that `dtrain --help` stays fast.
"""

from __future__ import annotations

import sys

import typer

from dtrain import __version__
from dtrain.errors import DtrainError, ExitStatus
from dtrain.printable import printable

app = typer.Typer(
    name="dtrain",
    help="Check a set of machines, run PyTorch DDP on all of them, watch it, ship the model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dtrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    traceback: bool = typer.Option(False, "--traceback", help="Show full tracebacks for errors."),
) -> None:
    """dtrain: distributed training without the SSH scripts."""


def _register_all() -> None:
    # Order here is the order in `dtrain --help`.
    from dtrain.cli import (
        cloud_cmd,
        cluster_cmd,
        data_cmd,
        deploy_cmd,
        eval_cmd,
        monitor_cmd,
        storage_cmd,
        train_cmd,
    )

    for module in (eval_cmd, train_cmd, data_cmd, storage_cmd, cluster_cmd, cloud_cmd, monitor_cmd, deploy_cmd):
        module.register(app)


_register_all()


def _printable_paths() -> None:
    """File names of bytes that are not UTF-8 (a Windows zip unpacked here) reach Python as
    surrogates. Under a C.UTF-8 locale stdout writes them back as the bytes they were; under
    en_US.UTF-8 it is strict and a warning naming such a photo would stop the command. There
    they are written as escapes (\\udce9) instead."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    _printable_paths()
    show_traceback = "--traceback" in args
    try:
        app(args=args, prog_name="dtrain", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    except DtrainError as exc:
        if show_traceback:
            raise
        # A message may quote a file or folder name (or a node's output): its own lines stay lines.
        shown = printable(str(exc), keep="\n\t")
        print(f"dtrain: error: {shown}", file=sys.stderr)
        return int(exc.exit_status)
    except KeyboardInterrupt:
        print("dtrain: interrupted", file=sys.stderr)
        return int(ExitStatus.INTERRUPTED)
    return 0
