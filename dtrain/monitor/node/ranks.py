"""Per-rank training metrics as the agent keeps them: cumulative counters + last values.

Ranks send their own cumulative counters (see report.py), so a lost datagram loses
nothing. Counters stay monotonic across a rank's restart (elastic restarts start a new
process whose counters begin at zero): the old process's totals become a base offset.
Counters, not per-interval averages, so that any number of readers (the collector,
Prometheus, a curl by hand) can each take their own deltas.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any

_MAX_DATAGRAM = 4096
COUNTERS = ("steps_total", "step_time_total", "data_wait_total", "samples_total")


class RankTable:
    def __init__(self, job: str = "") -> None:
        self.job = job
        self._lock = threading.Lock()
        self._ranks: dict[int, dict[str, Any]] = {}
        self._base: dict[int, dict[str, float]] = {}
        self._seen: dict[int, dict[str, Any]] = {}  # rank -> {"pid", counters as sent}
        self.bad_datagrams = 0
        self.foreign_datagrams = 0

    def ingest(self, datagram: bytes) -> dict[str, Any] | None:
        """Fold one report_step datagram in; returns it parsed, or None if malformed."""
        try:
            msg = json.loads(datagram[:_MAX_DATAGRAM])
            rank = int(msg["rank"])
            sent = {c: float(msg[c]) for c in COUNTERS}
            if not all(math.isfinite(v) for v in sent.values()):
                raise ValueError("a counter that is not a number")
        except (ValueError, KeyError, TypeError, OverflowError):  # OverflowError: "rank": 1e999
            self.bad_datagrams += 1
            return None
        if self.job and msg.get("job") and msg["job"] != self.job:
            # a rank of another job on this node whose own agent could not take the port
            self.foreign_datagrams += 1
            return None
        with self._lock:
            seen = self._seen.get(rank)
            base = self._base.setdefault(rank, dict.fromkeys(COUNTERS, 0.0))
            if seen is not None and seen["pid"] != msg.get("pid"):
                for c in COUNTERS:  # a new process for this rank: keep counting on top
                    base[c] += seen[c]
            elif seen is not None and sent["steps_total"] < seen["steps_total"]:
                return msg  # an older datagram overtaken by a newer one
            self._seen[rank] = {"pid": msg.get("pid"), **sent}
            row = {c: base[c] + sent[c] for c in COUNTERS}
            row["steps_total"] = int(row["steps_total"])
            row["samples_total"] = int(row["samples_total"])
            # Figures as sent if they are numbers: a string ("loss": "diverged") made every
            # /metrics scrape fail, and `top` and the report with it.
            row.update(
                rank=rank,
                step=number(msg.get("step")),
                epoch=number(msg.get("epoch")),
                loss=number(msg.get("loss")),
                lr=number(msg.get("lr")),
                last_step_time=number(msg.get("last_step_time")),
                last_t=number(msg.get("t")),
                pid=number(msg.get("pid")),
                local_rank=number(msg.get("local_rank")),
            )
            self._ranks[rank] = row
        return msg

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {str(rank): dict(row) for rank, row in sorted(self._ranks.items())}


def number(value: Any) -> Any:
    """A figure as sent if it is a number, else None (a string, a list, a bool)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
