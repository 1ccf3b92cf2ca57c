"""Watching a job: `dtrain top`, `dtrain dashboard`, `dtrain report` (owner: monitor).

All three read the job's stored series (`$DTRAIN_HOME/jobs/<id>/metrics.sqlite`), so
they work while the job runs and after its cluster is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer


@contextmanager
def _store_read(metrics: Path) -> Iterator[None]:
    """A metrics.sqlite that is damaged or no SQLite file at all: one line, not a traceback."""
    import sqlite3

    from dtrain.errors import DtrainError

    try:
        yield
    except sqlite3.DatabaseError as exc:
        raise DtrainError(f"{metrics} cannot be read as the job's metrics ({exc})",
                          f"it is damaged or not a dtrain metrics store; the job's logs are in {metrics.parent / 'logs'}") from None


def top(
    job: Optional[str] = typer.Argument(None, help="Job id, name, id prefix or job directory; default: the newest job."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit (for scripts and logs)."),
    interval: float = typer.Option(1.0, "--interval", min=0.2, help="Seconds between refreshes."),
) -> None:
    """Live per-node view of a job: CPU, memory, network, disk, GPUs, rank step times, findings."""
    from rich.console import Console

    from dtrain.monitor.views.jobs import resolve
    from dtrain.monitor.views.top import render, run_live

    info = resolve(job)
    console = Console()
    with _store_read(info.metrics):
        if once:
            store = info.open()
            try:
                console.print(render(store, info))
            finally:
                store.close()
            return
        try:
            run_live(info, console, refresh_s=interval)
        except KeyboardInterrupt:
            pass


def dashboard(
    port: int = typer.Option(8765, "--port", "-p", help="TCP port (0: any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; keep 127.0.0.1 unless you mean it."),
) -> None:
    """A web page with every job: per-node and per-rank charts (history and live), log tails, findings."""
    from dtrain.errors import DtrainError
    from dtrain.monitor.views.dashboard.server import make_server

    try:
        server = make_server(host, port)
    except OSError as exc:
        raise DtrainError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                          "pick another port with --port, or --port 0 for any free one") from None  # fmt: skip
    shown = f"[{host}]" if ":" in host else host
    typer.echo(f"dtrain dashboard on http://{shown}:{server.server_address[1]}/  (Ctrl-C to stop)")
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def report(
    job: str = typer.Argument(..., help="Job id, name, id prefix or job directory."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder; default: JOB_DIR/report."),
) -> None:
    """Post-job report: report.html, PNG plots and summary.json (per node/rank means, totals, findings)."""
    from dtrain.monitor.views.job_report import write_report
    from dtrain.monitor.views.jobs import resolve

    info = resolve(job)
    target = out if out is not None else info.dir / "report"
    with _store_read(info.metrics):
        summary = write_report(info, target)
    tot = summary["totals"]
    typer.echo(f"wrote {target / 'report.html'} and summary.json: {tot['nodes']} nodes, {tot['ranks']} ranks, "
               f"{tot['node_hours']:.2f} node-hours, {tot['gpu_hours']:.2f} GPU-hours, "
               f"{len(summary['findings'])} findings")  # fmt: skip
    if summary["cloud"]:  # a rented cluster's share (owner: cloud)
        from dtrain.cluster.providers.lifecycle import job_cost_line

        typer.echo(job_cost_line(summary["cloud"]))


def register(app: typer.Typer) -> None:
    app.command()(top)
    app.command()(dashboard)
    app.command()(report)
