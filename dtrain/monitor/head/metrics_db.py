"""A job's stored time series: `$DTRAIN_HOME/jobs/<id>/metrics.sqlite`.

One writer (the collector on the head), any number of readers (top, dashboard, report)
at the same time: WAL mode. Wide tables, one row per node / GPU / rank per poll, since
every reader wants whole rows over a time range.
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any, Iterable

from dtrain.paths import open_private

FILENAME = "metrics.sqlite"

NODE_COLS = (
    "cpu", "mem_used", "mem_total", "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps",
    "disk_read_iops", "disk_write_iops", "job_cpu", "job_rss", "job_procs",
)  # fmt: skip
GPU_COLS = ("util", "mem_used", "mem_total", "power_w", "temp_c", "sm_clock_hz")
# step_time / data_wait: mean per step over the poll interval; the *_total columns are
# the agent's cumulative counters, so totals survive a collector that started late.
RANK_COLS = (
    "step", "epoch", "loss", "lr", "steps", "step_time", "data_wait", "samples_per_s",
    "steps_total", "step_time_total", "data_wait_total", "samples_total",
)  # fmt: skip

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS nodes(node TEXT PRIMARY KEY, url TEXT, first_seen REAL, last_seen REAL,
    state TEXT, state_since REAL);
CREATE TABLE IF NOT EXISTS node_samples(t REAL, node TEXT, {", ".join(NODE_COLS)}, detail TEXT);
CREATE INDEX IF NOT EXISTS node_samples_t ON node_samples(t);
CREATE TABLE IF NOT EXISTS gpu_samples(t REAL, node TEXT, gpu INTEGER, {", ".join(GPU_COLS)});
CREATE INDEX IF NOT EXISTS gpu_samples_t ON gpu_samples(t);
CREATE TABLE IF NOT EXISTS rank_samples(t REAL, node TEXT, rank INTEGER, {", ".join(RANK_COLS)});
CREATE INDEX IF NOT EXISTS rank_samples_t ON rank_samples(t);
CREATE TABLE IF NOT EXISTS events(t REAL, node TEXT, kind TEXT, message TEXT);
CREATE TABLE IF NOT EXISTS findings(key TEXT PRIMARY KEY, t REAL, kind TEXT, node TEXT, rank INTEGER,
    gpu INTEGER, message TEXT);
"""


class MetricsDB:
    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        if readonly:
            self.db = sqlite3.connect(_readonly_uri(self.path), uri=True, timeout=10, check_same_thread=False)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            open_private(self.path, "ab").close()  # 0600; SQLite gives -wal/-shm the same mode
            self.db = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
        self.db.row_factory = sqlite3.Row
        self._tables: set[str] = set()  # tables seen to exist (none is ever dropped)

    @classmethod
    def for_job(cls, job_dir: str | Path, *, readonly: bool = False) -> "MetricsDB":
        return cls(Path(job_dir) / FILENAME, readonly=readonly)

    def close(self) -> None:
        self.db.close()

    # -- writing (the collector) --------------------------------------------------
    def set_meta(self, **values: Any) -> None:
        with self.db:
            self.db.executemany(
                "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    def upsert_node(self, node: str, url: str, t: float, state: str) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO nodes(node, url, first_seen, last_seen, state, state_since) VALUES (?,?,NULL,NULL,?,?)"
                " ON CONFLICT(node) DO UPDATE SET url=excluded.url",
                (node, url, state, t),
            )

    def write_poll(
        self,
        t: float,
        node_rows: Iterable[tuple[str, dict[str, Any], str]],
        gpu_rows: Iterable[tuple[str, int, dict[str, Any]]],
        rank_rows: Iterable[tuple[str, int, dict[str, Any]]],
    ) -> None:
        """One poll of every node in one transaction (readers see whole polls)."""
        with self.db:
            for node, row, detail in node_rows:
                self.db.execute(
                    f"INSERT INTO node_samples VALUES (?, ?, {', '.join('?' * len(NODE_COLS))}, ?)",
                    (t, node, *[_finite(row.get(c)) for c in NODE_COLS], detail),
                )
                self.db.execute(
                    "UPDATE nodes SET last_seen=?, first_seen=COALESCE(first_seen, ?) WHERE node=?", (t, t, node)
                )
            for node, gpu, row in gpu_rows:
                self.db.execute(
                    f"INSERT INTO gpu_samples VALUES (?, ?, ?, {', '.join('?' * len(GPU_COLS))})",
                    (t, node, gpu, *[_finite(row.get(c)) for c in GPU_COLS]),
                )
            for node, rank, row in rank_rows:
                self.db.execute(
                    f"INSERT INTO rank_samples VALUES (?, ?, ?, {', '.join('?' * len(RANK_COLS))})",
                    (t, node, rank, *[_finite(row.get(c)) for c in RANK_COLS]),
                )

    def set_state(self, node: str, state: str, t: float, message: str) -> None:
        with self.db:
            self.db.execute("UPDATE nodes SET state=?, state_since=? WHERE node=?", (state, t, node))
            self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (t, node, state, message))

    def add_finding(self, key: str, t: float, kind: str, node: str | None, rank: int | None, gpu: int | None,
                    message: str) -> bool:  # fmt: skip
        """Record a finding once per key; True when it is new."""
        with self.db:
            cur = self.db.execute(
                "INSERT OR IGNORE INTO findings VALUES (?, ?, ?, ?, ?, ?, ?)", (key, t, kind, node, rank, gpu, message)
            )
        return cur.rowcount == 1

    # -- reading (top, dashboard, report, findings) -------------------------------
    # A store without its schema reads as one without samples: the collector creates the
    # file empty and writes the schema a moment later (never, on a full disk), and `top`
    # opened in that moment keeps reading until the tables appear.
    def _rows(self, table: str, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        """The rows of `sql` (a query of `table`); none while `table` does not exist."""
        if table not in self._tables:
            exists = self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
            if exists.fetchone() is None:
                return []
            self._tables.add(table)
        return self.db.execute(sql, params).fetchall()

    def meta(self) -> dict[str, Any]:
        return {r["key"]: json.loads(r["value"]) for r in self._rows("meta", "SELECT key, value FROM meta")}

    def nodes(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows("nodes", "SELECT * FROM nodes ORDER BY node")]

    def events(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows("events", "SELECT * FROM events ORDER BY t")]

    def findings(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows("findings", "SELECT * FROM findings ORDER BY t")]

    def time_range(self) -> tuple[float, float] | None:
        rows = self._rows("node_samples", "SELECT MIN(t), MAX(t) FROM node_samples")
        return None if not rows or rows[0][0] is None else (rows[0][0], rows[0][1])

    def node_series(self, since: float = 0.0) -> dict[str, dict[str, list]]:
        return _columns(self._rows("node_samples", "SELECT * FROM node_samples WHERE t > ? ORDER BY t", (since,)),
                        ("node",))  # fmt: skip

    def gpu_series(self, since: float = 0.0) -> dict[tuple, dict[str, list]]:
        return _columns(self._rows("gpu_samples", "SELECT * FROM gpu_samples WHERE t > ? ORDER BY t", (since,)),
                        ("node", "gpu"))  # fmt: skip

    def rank_series(self, since: float = 0.0) -> dict[tuple, dict[str, list]]:
        return _columns(self._rows("rank_samples", "SELECT * FROM rank_samples WHERE t > ? ORDER BY t", (since,)),
                        ("node", "rank"))  # fmt: skip


def _readonly_uri(path: Path) -> str:
    """A read-only SQLite URI for `path`, percent-encoded: pasted in as it is, a `#` in
    a copied job's folder name ended the path (and SQLite created an empty file at the
    cut-off path), and a `?` or `%3F` was read as the start of the query or an escape."""
    return path.resolve().as_uri() + "?mode=ro"


def _finite(value: Any) -> Any:
    """NaN/inf (a diverged loss) are stored as NULL: JSON readers (the dashboard,
    summary.json consumers) cannot parse them, and a gap is what they mean."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _columns(rows: Iterable[sqlite3.Row], key_cols: tuple[str, ...]) -> dict[Any, dict[str, list]]:
    """Rows -> {key: {column: [values in time order]}}; key is a str or a tuple."""
    out: dict[Any, dict[str, list]] = {}
    for row in rows:
        key = row[key_cols[0]] if len(key_cols) == 1 else tuple(row[c] for c in key_cols)
        series = out.get(key)
        if series is None:
            series = out[key] = {c: [] for c in row.keys() if c not in key_cols}
        for c in series:
            series[c].append(row[c])
    return out
