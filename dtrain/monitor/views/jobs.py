"""Which jobs have stored metrics, and where: the views' (top, dashboard, report) way in.

The job registry (owner: launch) knows ids, names and states; a job directory with a
`metrics.sqlite` is what the views can show. A path to such a directory works too, so
a job copied off the head can still be looked at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError
from dtrain.monitor.head.findings import JobEnd
from dtrain.monitor.head.metrics_db import FILENAME, MetricsDB

TERMINAL = ("succeeded", "failed", "stopped")


@dataclass(frozen=True)
class JobInfo:
    id: str
    dir: Path
    name: str = ""
    state: str = "unknown"
    started: float | None = None
    ended: float | None = None
    nodes: tuple[str, ...] = ()

    @property
    def metrics(self) -> Path:
        return self.dir / FILENAME

    def open(self) -> MetricsDB:
        return MetricsDB(self.metrics, readonly=True)

    def end(self, store: MetricsDB) -> JobEnd | None:
        """How the job ended, None while it runs. The time is the collector's stop (the
        clock its node states use); the state is the registry's (unknown for a copied job
        directory), which may lag the store a moment: a job whose collector stopped has
        ended either way."""
        stopped = store.meta().get("stopped")
        t = stopped if stopped is not None else self.ended
        if t is None:
            return None
        return JobEnd(float(t), self.state if self.state in TERMINAL else "unknown")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "state": self.state, "started": self.started, "ended": self.ended,
                "nodes": list(self.nodes), "dir": str(self.dir)}  # fmt: skip


def _from_record(rec: Any) -> JobInfo:
    from dtrain.paths import job_dir

    return JobInfo(
        id=rec.id, dir=Path(rec.dir) if rec.dir else job_dir(rec.id), name=rec.name, state=rec.state.value,
        started=rec.started, ended=rec.ended, nodes=tuple(rec.nodes),
    )  # fmt: skip


def _from_dir(path: Path) -> JobInfo:
    """A job directory the registry does not know (copied off another head): its name
    from job.json's plan; its state is the registry's, unknown here."""
    meta: dict[str, Any] = {}
    job_json = path / "job.json"
    if job_json.is_file():
        try:
            meta = json.loads(job_json.read_text())
        except (OSError, ValueError):
            meta = {}
    return JobInfo(id=path.name, dir=path, name=str((meta.get("plan") or {}).get("name", "")))


def list_jobs() -> list[JobInfo]:
    """Jobs with stored metrics, newest first."""
    from dtrain.jobs.registry import JobRegistry
    from dtrain.paths import jobs_root

    out: dict[str, JobInfo] = {}
    for rec in JobRegistry().list():
        info = _from_record(rec)
        if info.metrics.is_file():
            out[info.id] = info
    root = jobs_root()
    for path in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if path.name not in out and (path / FILENAME).is_file():
            out[path.name] = _from_dir(path)
    return sorted(out.values(), key=lambda j: j.metrics.stat().st_mtime, reverse=True)


def refresh(info: JobInfo) -> JobInfo:
    """`info` as the registry (or job.json) has it now: `dtrain top` watches one job while
    its state changes. A terminal state is final."""
    if info.state in TERMINAL:
        return info
    from dtrain.jobs.registry import JobRegistry

    try:
        return _from_record(JobRegistry().get(info.id))
    except DtrainError:
        return _from_dir(info.dir)


def resolve(job: str | None) -> JobInfo:
    """A job by id, name or unique id prefix (the registry's rules), or a directory; the
    newest job with metrics when `job` is None."""
    if job is None:
        jobs = list_jobs()
        if not jobs:
            raise DtrainError("no job has stored metrics yet", "start one with `dtrain run` or `dtrain train`")
        return jobs[0]
    path = Path(job).expanduser()
    if (path / FILENAME).is_file():
        return _from_dir(path.resolve())
    from dtrain.jobs.registry import JobRegistry
    from dtrain.paths import jobs_root

    if (jobs_root() / job / FILENAME).is_file():
        try:
            return _from_record(JobRegistry().get(job))
        except DtrainError:
            return _from_dir(jobs_root() / job)
    info = _from_record(JobRegistry().get(job))  # raises "no job ..." with recent ids
    if not info.metrics.is_file():
        raise DtrainError(f"job {info.id} has no stored metrics ({info.metrics} is missing)",
                          "metrics are collected while a job runs under dtrain; `dtrain jobs` lists jobs")  # fmt: skip
    return info
