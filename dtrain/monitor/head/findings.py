"""Findings: what is wrong, in words, computed from stored series by pure functions.

Inputs are the column dicts `MetricsDB.*_series()` returns ({key: {column: [values]}}), so
the same rules run live in the collector and `top`, and afterwards in the report.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable

STRAGGLER_RATIO = 1.2  # a rank's median step time over the cluster median
STARVATION_RATIO = 0.2  # data wait over step time
# A rank's first steps wait for the loader to start: worker processes spawn and fill their
# first-use caches (transplanted defects are lifted, shards fetched). That is start-up, not
# a pipeline too slow for the model: judged on them, a 30-minute run whose data wait was 3 %
# overall was told to add loader workers 10 s in (recipe runs of 4-step epochs, session 31).
STARVATION_WARMUP_STEPS = 10
IDLE_UTIL = 0.10  # GPU utilisation below this ...
IDLE_SECONDS = 300.0  # ... for this long while the job runs
WINDOW_S = 60.0
MAX_GAP_S = 5.0  # a hole this long in a GPU's samples breaks an idle stretch
# A node that falls silent this close to a job's normal end went quiet with the job
# (its agent stops as the ranks finish), not because something broke.
END_GRACE_S = 15.0

Series = dict[Any, dict[str, list]]


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # straggler | data_starvation | idle_gpu | not_reporting
    message: str
    t: float
    node: str | None = None
    rank: int | None = None
    gpu: int | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.node}:{self.rank}:{self.gpu}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "node": self.node, "rank": self.rank, "gpu": self.gpu, "t": self.t,
                "message": self.message}  # fmt: skip


@dataclass(frozen=True, slots=True)
class JobEnd:
    """When (the collector's clock) and how a job ended; the views pass None while it runs."""

    t: float
    state: str = "unknown"  # succeeded | failed | stopped | unknown

    def explains(self, silent_since: float) -> bool:
        """A node silent since `silent_since` just went with a job that ended normally.
        A failed job keeps every lost node: a node that died is often why it failed."""
        return self.state != "failed" and silent_since >= self.t - END_GRACE_S


def node_states(nodes: Iterable[dict[str, Any]], end: JobEnd | None) -> list[dict[str, Any]]:
    """The collector's node rows with the state a person should read: after the end a
    node that reported to the end (or went quiet with it) is "finished"."""
    out = []
    for n in nodes:
        state = n.get("state")
        if end is not None and (state == "reporting" or (state == "not_reporting" and end.explains(n["state_since"]))):
            n = {**n, "state": "finished"}
        out.append(n)
    return out


def _window(series: dict[str, list], start: float | None) -> list[int]:
    """Indices of intervals with finished, timed steps at or after `start`."""
    return [
        i for i, (t, n, st) in enumerate(zip(series["t"], series["steps"], series["step_time"]))
        if n and st is not None and (start is None or t >= start)
    ]  # fmt: skip


def _weighted_median(values: list[float], weights: list[int]) -> float:
    pairs = sorted(zip(values, weights))
    half, acc = sum(weights) / 2.0, 0
    for value, weight in pairs:
        acc += weight
        if acc >= half:
            return value
    return pairs[-1][0]


def stragglers(ranks: Series, start: float | None = None, ratio: float = STRAGGLER_RATIO) -> list[Finding]:
    """Ranks whose median step time since `start` exceeds `ratio` x the cluster median."""
    medians: dict[tuple, tuple[float, float]] = {}
    for key, s in ranks.items():
        idx = _window(s, start)
        if idx:
            # weighted by steps: an interval with 50 steps says more than one with 1
            med = _weighted_median([s["step_time"][i] for i in idx], [s["steps"][i] for i in idx])
            medians[key] = (med, s["t"][idx[-1]])
    if len(medians) < 2:
        return []
    cluster = statistics.median(m for m, _ in medians.values())
    out = []
    for (node, rank), (med, t) in sorted(medians.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if cluster > 0 and med > ratio * cluster:
            out.append(Finding(
                "straggler",
                f"rank {rank} on {node} is a straggler: median step {med:.3g} s vs cluster median "
                f"{cluster:.3g} s ({med / cluster:.1f}x)",
                t, node=node, rank=rank,
            ))  # fmt: skip
    return out


def data_starvation(ranks: Series, start: float | None = None, ratio: float = STARVATION_RATIO,
                    warmup_steps: int = STARVATION_WARMUP_STEPS) -> list[Finding]:  # fmt: skip
    """Ranks that spend more than `ratio` of their step time waiting for data, not counting
    intervals that hold any of a rank's first `warmup_steps` steps."""
    out = []
    for (node, rank), s in sorted(ranks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        idx = [i for i in _window(s, start) if _steps_before(s, i) >= warmup_steps]
        step = sum(s["step_time"][i] * s["steps"][i] for i in idx)
        wait = sum((s["data_wait"][i] or 0.0) * s["steps"][i] for i in idx)
        if step > 0 and wait / step > ratio:
            out.append(Finding(
                "data_starvation",
                f"rank {rank} on {node} waits for data {wait / step:.0%} of its step time "
                f"(> {ratio:.0%}): add data loader workers or move the data closer",
                s["t"][idx[-1]], node=node, rank=rank,
            ))  # fmt: skip
    return out


def _steps_before(s: dict[str, list], i: int) -> int:
    """Steps the rank had finished before interval i: from its running total where the
    series carries one (the store's does), else counted from the series' own start."""
    totals = s.get("steps_total")
    if totals is not None and totals[i] is not None:
        return totals[i] - s["steps"][i]
    return sum(s["steps"][:i])


def idle_gpus(gpus: Series, min_idle_s: float = IDLE_SECONDS, util: float = IDLE_UTIL) -> list[Finding]:
    """GPUs whose utilisation stayed below `util` for at least `min_idle_s` (longest stretch)."""
    out = []
    for (node, gpu), s in sorted(gpus.items()):
        longest, run_start, prev_t = (0.0, 0.0, 0.0), None, None
        for t, u in zip(s["t"], s["util"]):
            idle = u is not None and u < util
            if run_start is not None and (not idle or (prev_t is not None and t - prev_t > MAX_GAP_S)):
                run_start = None
            if idle and run_start is None:
                run_start = t
            if run_start is not None and t - run_start > longest[0]:
                longest = (t - run_start, run_start, t)
            prev_t = t
        if longest[0] >= min_idle_s:
            out.append(Finding(
                "idle_gpu",
                f"GPU {gpu} on {node} was idle (< {util:.0%} utilisation) for {longest[0] / 60:.1f} min "
                "while the job ran",
                longest[2], node=node, gpu=gpu,
            ))  # fmt: skip
    return out


def not_reporting(nodes: Iterable[dict[str, Any]], end: JobEnd | None = None) -> list[Finding]:
    """Nodes the collector marks as not reporting, less those that went quiet with the job's end."""
    return [
        Finding("not_reporting", f"node {n['node']} stopped reporting (agent unreachable since "
                f"{_clock(n['state_since'])})", n["state_since"], node=n["node"])  # fmt: skip
        for n in node_states(nodes, end)
        if n.get("state") == "not_reporting"
    ]


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def analyze(nodes: list[dict[str, Any]], ranks: Series, gpus: Series, *, end: JobEnd | None = None,
            window_s: float | None = WINDOW_S, idle_s: float = IDLE_SECONDS) -> list[Finding]:  # fmt: skip
    """Every rule; the straggler and starvation window ends at the newest rank sample
    (so a finished job is judged on its last minute; window_s=None: the whole run)."""
    newest = max((s["t"][-1] for s in ranks.values() if s["t"]), default=None)
    start = None if window_s is None or newest is None else newest - window_s
    return [
        *not_reporting(nodes, end),
        *stragglers(ranks, start),
        *data_starvation(ranks, start),
        *idle_gpus(gpus, idle_s),
    ]


def from_store(store: Any, end: JobEnd | None = None, *, window_s: float | None = WINDOW_S,
               idle_s: float = IDLE_SECONDS) -> list[Finding]:  # fmt: skip
    """Current findings plus the ones the collector recorded while the job ran, judged
    against the job's `end` (None: it still runs)."""
    since = 0.0
    if window_s is not None:
        span = store.time_range()
        since = 0.0 if span is None else span[1] - max(window_s, idle_s) - 5.0
    live = analyze(store.nodes(), store.rank_series(since), store.gpu_series(since), end=end, window_s=window_s,
                   idle_s=idle_s)  # fmt: skip
    seen = {f.key for f in live}
    recorded = [
        Finding(r["kind"], r["message"], r["t"], r["node"], r["rank"], r["gpu"])
        for r in store.findings()
        if f"{r['kind']}:{r['node']}:{r['rank']}:{r['gpu']}" not in seen
        and not (r["kind"] == "not_reporting" and end is not None and end.explains(r["t"]))
    ]
    return sorted(live + recorded, key=lambda f: f.t)
