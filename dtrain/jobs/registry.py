"""The job registry: one SQLite file under `$DTRAIN_HOME` (WAL mode, many readers).

States move pending -> running -> succeeded | failed | stopped. The process that drives a
job (the foreground `dtrain run`, or the detached supervisor) records its pid and start
time; a reader that finds a live state whose supervisor is gone marks the job failed
("supervisor died") instead of leaving it "running" forever.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from dtrain.errors import DtrainError
from dtrain.paths import open_private


class JobState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


@dataclass
class JobRecord:
    id: str
    name: str
    nodes: list[str]
    world_size: int | None
    state: JobState
    created: float
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    supervisor_pid: int | None = None
    supervisor_started: float | None = None
    reason: str = ""
    dir: str = ""
    extra: dict = field(default_factory=dict)

    def duration(self, now: float) -> float | None:
        if self.started is None:
            return None
        return (self.ended or now) - self.started

    def to_json(self, now: float) -> dict:
        data = asdict(self)
        data["state"] = self.state.value
        data["duration_s"] = self.duration(now)
        return data


def process_start_time(pid: int) -> float | None:
    """Start time of `pid` (None if no such process): tells a live pid from a reused one."""
    started = _proc_start_time(pid)
    if started is not None:
        return None if started < 0 else started
    import psutil

    try:
        proc = psutil.Process(pid)
        # A killed supervisor whose parent never reaps it (PID 1 in many containers is not
        # an init) stays a zombie: it has a start time, but it is dead.
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


PROC = "/proc"


def _proc_start_time(pid: int) -> float | None:
    """psutil's create_time read straight from /proc (boot time + start ticks), without
    importing psutil on the launch path: -1 for a zombie or no such process, None where
    /proc cannot tell (then psutil answers)."""
    import os

    if not os.path.isdir(f"{PROC}/self"):
        return None  # no procfs (macOS): psutil answers
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"{PROC}/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        if fields[0] == b"Z":
            return -1.0
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except FileNotFoundError:
        return -1.0
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# The extra field that names the supervisor's process exactly: "<boot id>:<start ticks>".
START_KEY = "supervisor_start"


def start_key(pid: int) -> str | None:
    """The boot and clock ticks at which `pid` started, as /proc has them; "" for no such
    process (or a zombie), None where /proc cannot tell.

    Unlike a start time in wall-clock seconds, this does not move when the clock is stepped
    (an NTP step, a VM resumed): /proc/stat's btime moves with the clock, so a job whose
    supervisor ran through a step of over a second was read as dead ("supervisor died")."""
    import os

    if not os.path.isdir(f"{PROC}/self"):
        return None
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"{PROC}/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip().decode()
    except FileNotFoundError:
        return ""
    except (OSError, ValueError, IndexError):
        return None
    return "" if fields[0] == b"Z" else f"{boot}:{int(fields[19])}"


def supervisor_alive(pid: int, started: float | None, key: str | None = None) -> bool:
    """`key`: start_key when the supervisor was recorded (the exact test); else its start time."""
    if key:
        now_key = start_key(pid)
        if now_key is not None:
            return now_key == key
    now_started = process_start_time(pid)
    if now_started is None:
        return False
    return started is None or abs(now_started - started) < 1.0


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    nodes TEXT NOT NULL,
    world_size INTEGER,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    started REAL,
    ended REAL,
    exit_code INTEGER,
    supervisor_pid INTEGER,
    supervisor_started REAL,
    reason TEXT NOT NULL DEFAULT '',
    dir TEXT NOT NULL DEFAULT '',
    extra TEXT NOT NULL DEFAULT '{}'
)
"""
_COLUMNS = [
    "id", "name", "nodes", "world_size", "state", "created", "started", "ended",
    "exit_code", "supervisor_pid", "supervisor_started", "reason", "dir", "extra",
]


class JobRegistry:
    def __init__(
        self,
        path: str | Path | None = None,
        *,
        clock: Callable[[], float] = time.time,
        is_alive: Callable[[int, float | None, str | None], bool] = supervisor_alive,
    ) -> None:
        if path is None:
            from dtrain.paths import registry_path

            path = registry_path()
        self.path = Path(path)
        open_private(self.path, "ab").close()  # 0600; SQLite gives -wal/-shm the same mode
        self.clock = clock
        self.is_alive = is_alive
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA busy_timeout=30000")
        return db

    # -- writing -------------------------------------------------------------------

    def create(self, name: str, nodes: list[str], world_size: int | None, job_dir: str | Path = "",
               job_id: str | None = None) -> JobRecord:
        job_id = job_id or new_job_id(self.clock())
        rec = JobRecord(job_id, name, list(nodes), world_size, JobState.PENDING, self.clock(), dir=str(job_dir))
        with self._connect() as db:
            db.execute(
                f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                _to_row(rec),
            )
        return rec

    def update(self, job_id: str, **fields) -> None:
        if "state" in fields:
            fields["state"] = JobState(fields["state"]).value
        if "nodes" in fields:
            fields["nodes"] = json.dumps(fields["nodes"])
        if "extra" in fields:
            fields["extra"] = json.dumps(fields["extra"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._connect() as db:
            db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", [*fields.values(), job_id])

    def set_supervisor(self, job_id: str, pid: int) -> None:
        key = start_key(pid)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")  # the job's other extra fields are kept
            row = db.execute("SELECT extra FROM jobs WHERE id = ?", [job_id]).fetchone()
            extra = {k: v for k, v in json.loads((row and row[0]) or "{}").items() if k != START_KEY}
            if key:
                extra[START_KEY] = key
            db.execute("UPDATE jobs SET supervisor_pid = ?, supervisor_started = ?, extra = ? WHERE id = ?",
                       [pid, process_start_time(pid), json.dumps(extra), job_id])
            db.execute("COMMIT")

    def mark_running(self, job_id: str) -> None:
        self.update(job_id, state=JobState.RUNNING, started=self.clock())

    def finish(self, job_id: str, state: JobState, exit_code: int | None, reason: str = "") -> None:
        """Record the end of a job; a job already in a terminal state keeps it."""
        if not JobState(state).terminal:
            raise ValueError(f"{state} is not a terminal state")
        with self._connect() as db:
            db.execute(
                "UPDATE jobs SET state = ?, exit_code = ?, reason = ?, ended = ? "
                "WHERE id = ? AND state IN ('pending', 'running')",
                [JobState(state).value, exit_code, reason, self.clock(), job_id],
            )

    # -- reading -------------------------------------------------------------------

    def list(self, limit: int | None = None) -> list[JobRecord]:
        """Newest first."""
        sql = f"SELECT {', '.join(_COLUMNS)} FROM jobs ORDER BY created DESC, id DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        with self._connect() as db:
            rows = db.execute(sql).fetchall()
        return [self._checked(_from_row(r)) for r in rows]

    def get(self, job_id: str, *, if_gone: tuple[JobState, int | None, str] | None = None) -> JobRecord:
        """The job with this id; else the newest job with this name; else the one job
        whose id starts with it. A live job whose supervisor is gone is marked failed
        ("supervisor died"), or as `if_gone` says (state, exit code, reason)."""
        cols = ", ".join(_COLUMNS)
        with self._connect() as db:
            row = db.execute(f"SELECT {cols} FROM jobs WHERE id = ?", [job_id]).fetchone()
            if row is None:
                row = db.execute(
                    f"SELECT {cols} FROM jobs WHERE name = ? ORDER BY created DESC LIMIT 1", [job_id]
                ).fetchone()
            if row is None:
                rows = db.execute(
                    f"SELECT {cols} FROM jobs WHERE id LIKE ? ESCAPE '\\'", [_like_prefix(job_id)]
                ).fetchall()
                if len(rows) > 1:
                    ids = ", ".join(sorted(r[0] for r in rows))
                    raise DtrainError(f"job id {job_id!r} is ambiguous: {ids}", "give more of the id")
                row = rows[0] if rows else None
        if row is None:
            recent = ", ".join(r.id for r in self.list(limit=5)) or "none yet"
            raise DtrainError(f"no job {job_id!r}", f"`dtrain jobs` lists them (recent: {recent})")
        return self._checked(_from_row(row), if_gone)

    def _checked(self, rec: JobRecord, if_gone: tuple[JobState, int | None, str] | None = None) -> JobRecord:
        """Mark a live job whose supervisor process is gone as failed (or `if_gone`), once, on read."""
        if rec.state.terminal or rec.supervisor_pid is None:
            return rec
        if self.is_alive(rec.supervisor_pid, rec.supervisor_started, rec.extra.get(START_KEY)):
            return rec
        self.finish(rec.id, *(if_gone or (JobState.FAILED, rec.exit_code, "supervisor died")))
        with self._connect() as db:
            row = db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?", [rec.id]).fetchone()
        return _from_row(row)


def new_job_id(now: float) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + "-" + secrets.token_hex(2)


def _like_prefix(prefix: str) -> str:
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


def _to_row(rec: JobRecord) -> list:
    data = asdict(rec)
    data["state"] = rec.state.value
    data["nodes"] = json.dumps(rec.nodes)
    data["extra"] = json.dumps(rec.extra)
    return [data[c] for c in _COLUMNS]


def _from_row(row) -> JobRecord:
    data = dict(zip(_COLUMNS, row, strict=True))
    data["state"] = JobState(data["state"])
    data["nodes"] = json.loads(data["nodes"])
    data["extra"] = json.loads(data["extra"] or "{}")
    return JobRecord(**data)
