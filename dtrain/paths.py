"""Where dtrain keeps its state on the head: `$DTRAIN_HOME` (default `~/.dtrain`).

Tests point `DTRAIN_HOME` at a temp dir (the `dtrain_home` fixture); nothing else in
dtrain reads the variable directly.

Everything under it is private to its user: directories 0700 (the home itself is
tightened if found looser), files 0600 (`write_text_atomic`, `open_private`). Job files
and logs name hosts, commands and paths; secret values are never written at all
(dtrain.jobs.secrets).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Any

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def dtrain_home() -> Path:
    home = os.environ.get("DTRAIN_HOME")
    path = Path(home).expanduser() if home else Path.home() / ".dtrain"
    private_dir(path)
    return path


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner can enter (created, or tightened if looser)."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        path.chmod(PRIVATE_DIR)
    return path


def jobs_root() -> Path:
    return private_dir(dtrain_home() / "jobs")


def job_dir(job_id: str) -> Path:
    """`$DTRAIN_HOME/jobs/<job_id>/` (job.json, logs/<node>.log, metrics.sqlite)."""
    return private_dir(jobs_root() / job_id)


def write_text_atomic(path: Path, text: str) -> None:
    """Readers (`dtrain top`, another `dtrain status`) see the old file or the new one,
    never half of it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open_private(tmp, "w") as fh:
        fh.write(text)
    tmp.replace(path)


def open_private(path: Path, mode: str, **kwargs: Any) -> IO[Any]:
    """`open(path, mode, **kwargs)` creating the file 0600 (an existing one is tightened);
    text is UTF-8."""
    if "b" not in mode:
        kwargs.setdefault("encoding", "utf-8")
    fh = open(path, mode, **kwargs, opener=lambda p, flags: os.open(p, flags, PRIVATE_FILE))  # noqa: SIM115
    if stat.S_IMODE(os.fstat(fh.fileno()).st_mode) & 0o077:
        os.fchmod(fh.fileno(), PRIVATE_FILE)
    return fh


def registry_path() -> Path:
    return dtrain_home() / "jobs.sqlite"
