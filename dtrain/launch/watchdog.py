"""Hang watchdog: a job that shows no sign of progress for `timeout` seconds is hung.

Signs of life per (node, rank): the mtime of the rank's heartbeat file (refreshed by the
dtrain training library's report_step, reported by the node wrapper as an age, so clocks
of different hosts never get compared) and, for any other script, its output lines.
The wrapper's own status lines prove only that the node is reachable, not progress.

The clock starts at the first sign of life from a rank: before that the job is starting
(imports, rendezvous, data set scans), bounded by `startup_timeout` - a rendezvous that
can never complete is also ended by torchrun's own join timeout, which fails fast.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Hang:
    idle_s: float
    node: str
    rank: int | None
    last_seen_s: float
    source: str  # "heartbeat" or "output" or "start"

    def describe(self) -> str:
        who = f"{self.node}:r{self.rank}" if self.rank is not None else self.node
        if self.source == "start":
            return f"no rank started within {self.idle_s:.0f} s; suspected {who} (the master)"
        return (
            f"no progress for {self.idle_s:.0f} s (no heartbeat and no output from any rank); "
            f"suspected {who}: its last {self.source} was {self.last_seen_s:.0f} s ago"
        )


class Watchdog:
    def __init__(self, timeout: float, start: float, nodes: list[str], startup_timeout: float = 900.0) -> None:
        self.timeout = timeout
        self.startup_timeout = max(startup_timeout, timeout)
        self.start = start
        self.nodes = nodes
        # (node, rank) -> (time, source); rank None = a node's unprefixed output
        self.life: dict[tuple[str, int | None], tuple[float, str]] = {}

    def _touch(self, key: tuple[str, int | None], t: float, source: str) -> None:
        old = self.life.get(key)
        if old is None or t > old[0]:
            self.life[key] = (t, source)

    def output(self, node: str, rank: int | None, now: float) -> None:
        self._touch((node, rank), now, "output")

    def heartbeats(self, node: str, ages: dict[str, float], now: float) -> None:
        for rank, age in ages.items():
            self._touch((node, int(rank)), now - float(age), "heartbeat")

    def restart(self, now: float) -> None:
        """An elastic restart: progress is measured afresh from now."""
        self.start = now
        self.life.clear()

    def check(self, now: float) -> Hang | None:
        latest = max((t for t, _ in self.life.values()), default=self.start)
        latest = max(latest, self.start)
        ranked = {k: v for k, v in self.life.items() if k[1] is not None}
        if now - latest < (self.timeout if ranked else self.startup_timeout):
            return None
        pool = ranked or self.life
        if not pool:
            return Hang(now - latest, self.nodes[0], None, now - self.start, "start")
        # The rank silent for longest: in a collective hang every other rank is blocked
        # waiting for it, so it went quiet first.
        (node, rank), (t, source) = min(pool.items(), key=lambda kv: (kv[1][0], kv[0][0], kv[0][1] or 0))
        return Hang(now - latest, node, rank, now - t, source)
