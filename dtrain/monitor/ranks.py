"""Per-rank training metrics as the agent keeps them: cumulative counters + last values.

Counters (not per-interval averages) so that any number of readers — the collector,
Prometheus, a curl by hand — can each take their own deltas without resetting anything.
"""

from __future__ import annotations

import json
import threading
from typing import Any

_MAX_DATAGRAM = 4096


class RankTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, dict[str, Any]] = {}
        self.bad_datagrams = 0

    def ingest(self, datagram: bytes) -> dict[str, Any] | None:
        """Fold one report_step datagram in; returns it parsed, or None if malformed."""
        try:
            msg = json.loads(datagram[:_MAX_DATAGRAM])
            rank = int(msg["rank"])
            step_time = float(msg["step_time_s"])
            data_wait = float(msg.get("data_wait_s") or 0.0)
            samples = int(msg.get("samples") or 0)
        except (ValueError, KeyError, TypeError):
            self.bad_datagrams += 1
            return None
        with self._lock:
            row = self._ranks.get(rank)
            if row is None:
                row = self._ranks[rank] = {
                    "rank": rank,
                    "steps_total": 0,
                    "step_time_total": 0.0,
                    "data_wait_total": 0.0,
                    "samples_total": 0,
                }
            row["steps_total"] += 1
            row["step_time_total"] += step_time
            row["data_wait_total"] += data_wait
            row["samples_total"] += samples
            row.update(
                step=msg.get("step"),
                epoch=msg.get("epoch"),
                loss=msg.get("loss"),
                lr=msg.get("lr"),
                last_step_time=step_time,
                last_t=msg.get("t"),
                pid=msg.get("pid"),
                local_rank=msg.get("local_rank"),
            )
        return msg

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {str(rank): dict(row) for rank, row in sorted(self._ranks.items())}
