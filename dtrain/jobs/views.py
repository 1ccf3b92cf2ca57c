"""What `dtrain jobs / status / logs / stop` show and do, over the registry."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from dtrain.errors import DtrainError, ExitStatus
from dtrain.jobs.registry import JobRecord, JobRegistry, JobState


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _current(registry: JobRegistry, rec: JobRecord) -> JobRecord:
    """The record, brought up to date from the scheduler for a job Slurm runs."""
    if rec.extra.get("scheduler") != "slurm" or rec.state.terminal:
        return rec
    from dtrain.launch.slurm_job import refresh

    return refresh(registry, rec)


def show_jobs(*, as_json: bool, limit: int, registry: JobRegistry | None = None, out=None) -> None:
    out = out or sys.stdout
    registry = registry or JobRegistry()
    records = [_current(registry, r) for r in registry.list(limit=limit)]
    now = time.time()
    if as_json:
        out.write(json.dumps([r.to_json(now) for r in records], indent=2) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("id", "name", "nodes", "world", "state", "start", "duration", "exit"):
        table.add_column(col)
    for r in records:
        table.add_row(r.id, r.name, ",".join(r.nodes), str(r.world_size or "-"), r.state.value,
                      _when(r.started or r.created), _dur(r.duration(now)),
                      "-" if r.exit_code is None else str(r.exit_code))
    if not records:
        out.write("no jobs yet (start one with `dtrain run`)\n")
        return
    Console(file=out, width=200).print(table)


def show_status(job: str, *, as_json: bool, registry: JobRegistry | None = None, out=None) -> JobRecord:
    out = out or sys.stdout
    registry = registry or JobRegistry()
    rec = _current(registry, registry.get(job))
    now = time.time()
    if as_json:
        out.write(json.dumps(rec.to_json(now), indent=2) + "\n")
        return rec
    rows = [
        ("job", rec.id), ("name", rec.name), ("state", rec.state.value),
        ("nodes", ", ".join(rec.nodes)), ("world size", str(rec.world_size or "-")),
        ("started", _when(rec.started)), ("duration", _dur(rec.duration(now))),
        ("exit code", "-" if rec.exit_code is None else str(rec.exit_code)),
        ("reason", rec.reason or "-"), ("supervisor pid", str(rec.supervisor_pid or "-")),
        ("directory", rec.dir),
    ]
    if rec.extra.get("slurm_job_id"):
        rows.append(("slurm job", rec.extra["slurm_job_id"]))
    for key, value in rows:
        out.write(f"{key:>15}: {value}\n")
    return rec


def show_logs(job: str, *, follow: bool, node: str | None, registry: JobRegistry | None = None,
              out=None, poll: float = 0.3) -> None:
    out = out or sys.stdout
    registry = registry or JobRegistry()
    rec = registry.get(job)
    directory = Path(rec.dir)
    if node is not None and node not in rec.nodes:
        raise DtrainError(f"job {rec.id} has no node {node!r}", f"its nodes are: {', '.join(rec.nodes)}")
    path = directory / "logs" / f"{node}.log" if node else directory / "output.log"
    pos = 0
    while True:
        if path.exists():
            with open(path, encoding="utf-8", errors="replace") as fh:
                fh.seek(pos)
                chunk = fh.read()
                # Only whole lines: the writer may be half-way through one.
                cut = chunk.rfind("\n") + 1 if follow else len(chunk)
                out.write(chunk[:cut])
                out.flush()
                pos += len(chunk[:cut].encode("utf-8"))
        if not follow:
            return
        if _current(registry, registry.get(rec.id)).state.terminal:
            follow = False  # one more pass prints the summary lines written at the end
            continue
        time.sleep(poll)


def stop_job(job: str, *, wait: float, registry: JobRegistry | None = None, out=None) -> JobRecord:
    out = out or sys.stdout
    registry = registry or JobRegistry()
    rec = registry.get(job)
    if rec.state.terminal:
        out.write(f"job {rec.id} already {rec.state.value}\n")
        return rec
    if rec.extra.get("scheduler") == "slurm":
        from dtrain.launch.slurm_job import stop

        rec = stop(registry, rec, wait=wait)
        out.write(f"job {rec.id} {rec.state.value}\n")
        return rec
    if rec.supervisor_pid is None:
        raise DtrainError(f"job {rec.id} has no supervisor yet", "try again in a moment")
    try:
        os.kill(rec.supervisor_pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + wait
    # A supervisor that dies of this SIGTERM before its handlers are in place (it was still
    # starting, or preparing the nodes: no node runs yet) was stopped, not lost.
    gone = (JobState.STOPPED, int(ExitStatus.INTERRUPTED), "stopped (SIGTERM, e.g. dtrain stop) before it started")
    while time.monotonic() < deadline:
        rec = registry.get(rec.id, if_gone=gone)
        if rec.state.terminal:
            out.write(f"job {rec.id} {rec.state.value}\n")
            return rec
        time.sleep(0.2)
    raise DtrainError(f"job {rec.id} did not stop within {wait:.0f} s",
                      f"its supervisor is pid {rec.supervisor_pid}; check `dtrain status {rec.id}`")
