"""What this head rented: `$DTRAIN_HOME/clusters.sqlite` (0600).

A cluster's row is written before the first instance is requested, so a crash in the
middle of creating leaves a record that the next `dtrain up` continues (same token) and
`dtrain down` can end. Instances carry their launch and end times and their price, so
the cost is the sum of lifetime x price. The cloud stays the source of truth:
`reconcile` brings the rows in line with what a query returned.
"""

from __future__ import annotations

import fcntl
import json
import sqlite3
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dtrain.cluster.providers.base import Instance
from dtrain.errors import DtrainError
from dtrain.paths import dtrain_home, open_private

LIVE_STATES = ("creating", "up")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS clusters (
  name TEXT PRIMARY KEY, provider TEXT NOT NULL, token TEXT NOT NULL, spec TEXT NOT NULL,
  state TEXT NOT NULL, created_at REAL NOT NULL, ended_at REAL
);
CREATE TABLE IF NOT EXISTS instances (
  id TEXT PRIMARY KEY, cluster TEXT NOT NULL, instance_type TEXT NOT NULL, zone TEXT NOT NULL,
  price REAL, launched_at REAL NOT NULL, ended_at REAL
);
"""


@dataclass(frozen=True)
class ClusterRow:
    name: str
    provider: str
    token: str
    spec: dict
    state: str
    created_at: float
    ended_at: float | None
    nodes: int  # instances not yet ended
    node_hours: float
    cost: float | None  # None when an instance's price is unknown


@dataclass(frozen=True)
class InstanceRow:
    id: str
    cluster: str
    instance_type: str
    zone: str
    price: float | None  # USD per hour
    launched_at: float
    ended_at: float | None


class ClusterRecords:
    def __init__(self, path: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self.path = path or dtrain_home() / "clusters.sqlite"
        self._clock = clock
        if not self.path.exists():
            open_private(self.path, "a").close()  # 0600 before sqlite writes a byte
        with self._db() as db:
            db.executescript(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.row_factory = sqlite3.Row
        return db

    @contextmanager
    def creating(self, name: str) -> Iterator[None]:
        """One `up` of a cluster at a time on this head: two at once would both count
        the same instances and both start the missing ones."""
        with open_private(self.path.with_name(f"clusters-{name}.lock"), "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DtrainError(f"another dtrain is bringing {name} up right now",
                                  "wait for it to finish (`dtrain clusters` shows the state)") from None
            yield

    def begin(self, name: str, provider: str, spec: dict) -> str:
        """The record's token: a live record keeps its own (a second `up` continues it)."""
        with self._db() as db:
            row = db.execute("SELECT token, state FROM clusters WHERE name = ?", (name,)).fetchone()
            if row and row["state"] in LIVE_STATES:
                db.execute("UPDATE clusters SET spec = ? WHERE name = ?", (json.dumps(spec), name))
                return row["token"]
            token = uuid.uuid4().hex[:16]
            db.execute("INSERT OR REPLACE INTO clusters VALUES (?, ?, ?, ?, 'creating', ?, NULL)",
                       (name, provider, token, json.dumps(spec), self._clock()))
            return token

    def set_state(self, name: str, state: str) -> None:
        ended = None if state in LIVE_STATES else self._clock()
        with self._db() as db:
            db.execute("UPDATE clusters SET state = ?, ended_at = ? WHERE name = ?", (state, ended, name))

    def reconcile(self, name: str, seen: list[Instance], price: Callable[[Instance], float | None]) -> None:
        """Rows for every instance the cloud showed; an instance the cloud calls
        terminated, or no longer shows, has ended now (if it had not already)."""
        now = self._clock()
        with self._db() as db:
            known = {r["id"] for r in db.execute("SELECT id FROM instances WHERE cluster = ?", (name,))}
            for inst in seen:
                if inst.id not in known:  # priced once, when first seen
                    db.execute("INSERT INTO instances VALUES (?, ?, ?, ?, ?, ?, NULL)",
                               (inst.id, name, inst.instance_type, inst.zone, price(inst), inst.launched_at))
            alive = {i.id for i in seen if i.alive}
            for row in db.execute("SELECT id FROM instances WHERE cluster = ? AND ended_at IS NULL", (name,)):
                if row["id"] not in alive:
                    db.execute("UPDATE instances SET ended_at = ? WHERE id = ?", (now, row["id"]))

    def instances(self, name: str) -> list[InstanceRow]:
        """The instances `name` ever had, in the order the provider lists them (launch
        time, then id): a node `<name>-<k>` is the k-th of those alive at the time."""
        with self._db() as db:
            rows = db.execute("SELECT * FROM instances WHERE cluster = ? ORDER BY launched_at, id", (name,))
            return [InstanceRow(**dict(r)) for r in rows]

    def get(self, name: str) -> ClusterRow | None:
        rows = [r for r in self.all() if r.name == name]
        return rows[0] if rows else None

    def all(self) -> list[ClusterRow]:
        now = self._clock()
        with self._db() as db:
            clusters = db.execute("SELECT * FROM clusters ORDER BY created_at").fetchall()
            instances = db.execute("SELECT * FROM instances").fetchall()
        out = []
        for c in clusters:
            mine = [i for i in instances if i["cluster"] == c["name"]]
            hours = [((i["ended_at"] or now) - i["launched_at"]) / 3600 for i in mine]
            prices = [i["price"] for i in mine]
            cost = None if None in prices else sum(h * p for h, p in zip(hours, prices))
            out.append(ClusterRow(c["name"], c["provider"], c["token"], json.loads(c["spec"]), c["state"],
                                  c["created_at"], c["ended_at"], sum(1 for i in mine if i["ended_at"] is None),
                                  sum(hours), cost))
        return out
