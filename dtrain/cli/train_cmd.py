"""`dtrain train CONFIG [--nproc N] [--set k=v ...] [--resume] [--no-monitor]`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("train")(train)


def train(
    config: Path = typer.Argument(None, help="Training config YAML (the defaults when omitted)."),
    nproc: int = typer.Option(None, "--nproc", min=1, help="Local ranks. Default: one per GPU, else 2 (capped by the cores)."),
    overrides: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="Override a config key, e.g. --set optim.lr=0.001"),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUTPUT/checkpoints/last.pt."),
    monitor: bool = typer.Option(True, "--monitor/--no-monitor", help="Run the node agent: `dtrain top` / `dtrain report` for this run."),
) -> None:
    """Train with DDP on this machine's devices, as a job (`dtrain jobs / logs / stop`)."""
    from dtrain.configio import load_config
    from dtrain.launch.cli_support import print_and_exit
    from dtrain.train.config import TrainConfig
    from dtrain.train.launch import default_nproc, launch_local, say_job

    # Validate here, before any process starts, so a typo costs no launch.
    load_config(TrainConfig, config, overrides)
    status = launch_local(str(config) if config else None, list(overrides), resume, nproc or default_nproc(),
                          monitor=monitor, on_job=say_job(monitor))
    print_and_exit(status)
