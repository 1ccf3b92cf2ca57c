"""`dtrain check`: preflight of a cluster (owner: cluster). The launch commands live in
launch_cmd.py (owner: launch) and are registered from here, right after `check`."""

from __future__ import annotations

import typer

from dtrain.cli import launch_cmd


def register(app: typer.Typer) -> None:
    launch_cmd.register(app)
