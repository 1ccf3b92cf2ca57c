"""Where dtrain keeps its state on the head: `$DTRAIN_HOME` (default `~/.dtrain`).

Tests point `DTRAIN_HOME` at a temp dir (the `dtrain_home` fixture); nothing else in
dtrain reads the variable directly.
"""

from __future__ import annotations

import os
from pathlib import Path


def dtrain_home() -> Path:
    home = os.environ.get("DTRAIN_HOME")
    path = Path(home).expanduser() if home else Path.home() / ".dtrain"
    path.mkdir(parents=True, exist_ok=True)
    return path


def jobs_root() -> Path:
    path = dtrain_home() / "jobs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def job_dir(job_id: str) -> Path:
    """`$DTRAIN_HOME/jobs/<job_id>/` (job.json, logs/<node>.log, metrics.sqlite)."""
    return jobs_root() / job_id


def write_text_atomic(path: Path, text: str) -> None:
    """Readers (`dtrain top`, another `dtrain status`) see the old file or the new one,
    never half of it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def registry_path() -> Path:
    return dtrain_home() / "jobs.sqlite"
