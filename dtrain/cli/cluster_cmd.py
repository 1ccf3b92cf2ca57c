"""`dtrain check`: preflight of a cluster (owner: cluster). The launch commands live in
launch_cmd.py (owner: launch) and are registered from here, right after `check`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dtrain.cli import launch_cmd


def check(
    cluster: Optional[Path] = typer.Argument(None, help="cluster.yaml (omit with --hosts)."),
    hosts: Optional[str] = typer.Option(None, "--hosts",
                                        help="Comma-separated SSH hosts, or a subset of the file's nodes."),
    port: int = typer.Option(29500, "--port", help="The master port the job will use."),
    timeout: float = typer.Option(20.0, "--timeout", help="Seconds each node may take to answer."),
    python: Optional[str] = typer.Option(None, "--python", help="Interpreter on every node (overrides the file)."),
    ssh_config: Optional[str] = typer.Option(None, "--ssh-config", help="ssh client config (ssh -F) instead of ~/.ssh/config."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Preflight every node: ssh, Python/torch versions, GPUs, master port, interface, DNS, storage, clock.

    All nodes are probed at once; each failing node gets one line saying what to fix, and
    the exit status is 4. `dtrain run` runs the same checks before it launches anything."""
    from rich.console import Console

    from dtrain.cluster.preflight import run_preflight
    from dtrain.cluster.runner import job_runners, with_addresses
    from dtrain.cluster.spec import cluster_from_args
    from dtrain.errors import PreflightError

    spec = cluster_from_args(cluster, hosts, python=python, ssh_config=ssh_config)
    spec = with_addresses(spec, job_runners(spec))  # the addresses the job would use
    report = run_preflight(spec, master_port=port, timeout=timeout, out=None if as_json else Console())
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    if not report.ok:
        failing = sorted({line.split(":")[0] for line in report.failures})
        raise PreflightError(f"preflight failed on {len(failing)} node(s): {', '.join(failing)}",
                             "fix what each failing node reports above, then run `dtrain check` again")


def register(app: typer.Typer) -> None:
    app.command()(check)
    launch_cmd.register(app)
