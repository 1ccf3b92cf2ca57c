"""The head collector: polls every node's agent once a second and stores what it gets.

    c = Collector(job_dir, {"node1": "http://10.0.0.1:9464", ...}).start()
    ...
    c.stop()

Series go to `job_dir/metrics.sqlite` (see store.py), so they outlive the cluster. A node
whose agent misses `miss_limit` polls in a row is marked "not reporting" (an event, a
finding, a line in `job_dir/monitor.log` and the `on_finding` callback); with the
defaults that happens 3-5 s after the agent dies. An agent that has not answered yet
is still starting (a Python process, niced, on a node busy starting its ranks): it gets
`start_grace_s` from the collector's start before it is called missing. Findings are
re-evaluated every `findings_every_s` and each new one is announced once.

`quiet_grace_s` is for jobs whose agents end with their ranks (Slurm: the agent is the
node wrapper's child), seconds before the head hears that the job ended: a node that
goes quiet is stored as not reporting at once, but announced only if the collector is
still running `quiet_grace_s` later, i.e. if the job went on without it. A collector
stopped earlier drops it, as the report does for nodes that went quiet with the job's
end (findings.END_GRACE_S).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from dtrain.monitor.head import findings as rules
from dtrain.monitor.head.metrics_db import MetricsDB
# Figures that are not numbers are stored as NULL: a string broke every view that formats it.
from dtrain.monitor.node.ranks import number
from dtrain.paths import open_private

LOG_NAME = "monitor.log"
# The largest snapshot an agent is believed (a node with many GPUs and ranks sends ~100 kB).
MAX_SNAPSHOT_BYTES = 16 * 1024 * 1024


class _NodeState:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.misses = 0
        self.reporting: bool | None = None  # None until the first answer or verdict
        self.prev: dict[str, Any] | None = None  # last snapshot, for counter deltas
        self.held: rules.Finding | None = None  # a loss not announced yet (quiet_grace_s)
        self.fetch: Future | None = None  # the poll of its agent in flight


class Collector:
    def __init__(
        self,
        job_dir: str | Path,
        endpoints: dict[str, str],
        clock: Callable[[], float] = time.time,
        *,
        interval_s: float = 1.0,
        miss_limit: int = 3,
        start_grace_s: float = 30.0,
        quiet_grace_s: float = 0.0,
        findings_every_s: float = 5.0,
        on_finding: Callable[[rules.Finding], None] | None = None,
        job_id: str | None = None,
    ) -> None:
        self.job_dir = Path(job_dir)
        # An agent of another job answering on our port (ours could not bind it) is not ours.
        self.job_id = self.job_dir.name if job_id is None else job_id
        self.clock = clock
        self.interval_s = interval_s
        self.miss_limit = miss_limit
        self.start_grace_s = start_grace_s
        self.quiet_grace_s = quiet_grace_s
        self.started_at = clock()
        self.findings_every_s = findings_every_s
        self.on_finding = on_finding
        self.nodes = {name: _NodeState(url) for name, url in endpoints.items()}
        self.store = MetricsDB.for_job(self.job_dir)
        self.store.set_meta(job=self.job_id, endpoints=endpoints, started=clock())
        for name, st in self.nodes.items():
            self.store.upsert_node(name, st.url, clock(), "pending")
        self._pool = ThreadPoolExecutor(max_workers=min(32, max(1, len(self.nodes))), thread_name_prefix="poll")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_findings = 0.0

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> "Collector":
        self._thread = threading.Thread(target=self._run, name="dtrain-collector", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        # (a loss still held by quiet_grace_s went with the job: dropped, not announced)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._evaluate(force=True)
        self.store.set_meta(stopped=self.clock())
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    def _run(self) -> None:
        next_t = time.monotonic()
        failing = False
        while not self._stop.is_set():
            try:
                self.poll_once()
                failing = False
            except Exception as exc:  # e.g. the job's disk is full: keep polling, say it once
                if not failing:
                    self._log(self.clock(), f"monitor: storing metrics failed: {exc}")
                failing = True
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.monotonic()))
            if next_t < time.monotonic():
                next_t = time.monotonic()

    # -- one poll ------------------------------------------------------------------
    def poll_once(self) -> None:
        timeout = max(0.2, self.interval_s * 0.9)
        for st in self.nodes.values():
            # A node still answering the last poll (a stuck or trickling agent) gets no second one:
            # its threads would pile up in the pool, which every node shares.
            if st.fetch is None or st.fetch.done():
                st.fetch = self._pool.submit(_fetch, st.url + "/snapshot", timeout)
        t = self.clock()
        deadline = time.monotonic() + timeout + 0.5
        node_rows, gpu_rows, rank_rows = [], [], []
        for name, st in self.nodes.items():
            try:
                # One slow node is a miss for that node: the poll goes on for the others.
                snap = st.fetch.result(timeout=max(0.0, deadline - time.monotonic()))
                if not isinstance(snap, dict):
                    raise ValueError("the answer is not an agent's snapshot")
                if snap.get("job") != self.job_id:
                    raise _OtherJob(f"the agent there belongs to job {snap.get('job')!r}")
                # Read whole before it counts: a snapshot of another shape is this node's miss,
                # not a poll lost for every node.
                host = snap.get("host") or {}
                node = (name, _node_row(host), json.dumps(_detail(host)))
                gpus = [(name, int(g["gpu"]), {k: number(v) for k, v in g.items()}) for g in host.get("gpus") or []]
                ranks = [(name, rank, row) for rank, row in _rank_rows(snap, st.prev)]
            except Exception as exc:  # refused, timeout, bad JSON or shape, wrong job: all mean "no answer"
                self._missed(name, st, t, exc)
                continue
            self._answered(name, st, t)
            node_rows.append(node)
            gpu_rows += gpus
            rank_rows += ranks
            st.prev = snap
        self.store.write_poll(t, node_rows, gpu_rows, rank_rows)
        for st in self.nodes.values():  # losses the job outlived: news now
            if st.held is not None and t - st.held.t >= self.quiet_grace_s:
                self._announce_lost(st.held)
                st.held = None
        self._evaluate()

    def _missed(self, name: str, st: _NodeState, t: float, exc: Exception) -> None:
        st.misses += 1
        never = st.reporting is None
        # Another job's agent on the port is an answer, not a slow start: no grace for it.
        if never and t - self.started_at < self.start_grace_s and not isinstance(exc, _OtherJob):
            return
        if st.misses >= self.miss_limit and st.reporting is not False:
            st.reporting = False
            if never:
                msg = (f"node {name} has not reported since monitoring started {t - self.started_at:.0f} s ago: "
                       f"{st.misses} polls of {st.url} failed ({_reason(exc)}); its agent did not start or cannot be reached")
            else:
                msg = f"node {name} stopped reporting: {st.misses} polls of {st.url} failed ({_reason(exc)})"
            self.store.set_state(name, "not_reporting", t, msg)
            found = rules.Finding("not_reporting", msg, t, node=name)
            if self.quiet_grace_s > 0 and not never:
                st.held = found  # poll_once announces it if the job goes on
            else:
                self._announce_lost(found)

    def _answered(self, name: str, st: _NodeState, t: float) -> None:
        if st.reporting is not True:
            state_msg = "reporting again" if st.reporting is False else "reporting"
            self.store.set_state(name, "reporting", t, f"node {name} {state_msg}")
            if st.reporting is False and st.held is None:  # (a held loss was never said)
                self._log(t, f"node {name} is reporting again")
            st.held = None
            st.reporting = True
        st.misses = 0

    # -- findings --------------------------------------------------------------------
    def _evaluate(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_findings:
            return
        self._next_findings = now + self.findings_every_s
        span = self.store.time_range()
        if span is None:
            return
        since = span[1] - max(rules.WINDOW_S, rules.IDLE_SECONDS) - 5.0
        found = rules.analyze([], self.store.rank_series(since), self.store.gpu_series(since))
        for f in found:
            self._announce(f)

    def _announce_lost(self, f: rules.Finding) -> None:
        self._announce(f, key_suffix=f":{f.t:.0f}")  # a node may be lost more than once a job

    def _announce(self, f: rules.Finding, key_suffix: str = "") -> None:
        if self.store.add_finding(f.key + key_suffix, f.t, f.kind, f.node, f.rank, f.gpu, f.message):
            self._log(f.t, f.message)
            if self.on_finding is not None:
                self.on_finding(f)

    def _log(self, t: float, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
        try:
            with open_private(self.job_dir / LOG_NAME, "a") as fh:
                fh.write(f"{stamp}Z {message}\n")
        except OSError:
            pass  # the log is a convenience; the store and on_finding carry the same


class _OtherJob(ValueError):
    """An agent answered, but for another job (ours could not bind the port)."""


def _fetch(url: str, timeout: float) -> dict[str, Any]:
    """The agent's snapshot; TimeoutError past `timeout` in all (urllib's is per read: an agent
    sending a byte at a time held the poll for good), ValueError past MAX_SNAPSHOT_BYTES."""
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body = bytearray()
        while chunk := resp.read1(65536):
            body += chunk
            if len(body) > MAX_SNAPSHOT_BYTES:
                raise ValueError(f"the snapshot is over {MAX_SNAPSHOT_BYTES} bytes")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the snapshot took over {timeout:.1f} s to arrive")
        return json.loads(body)


def _reason(exc: Exception) -> str:
    return str(getattr(exc, "reason", None) or exc) or type(exc).__name__


def _node_row(host: dict[str, Any]) -> dict[str, Any]:
    disk = host.get("disk") or {}
    job = host.get("job") or {}
    values = {
        "cpu": host.get("cpu"),
        "mem_used": host.get("mem_used"),
        "mem_total": host.get("mem_total"),
        "net_rx_bps": host.get("net_rx_bps"),
        "net_tx_bps": host.get("net_tx_bps"),
        "disk_read_bps": disk.get("read_bps"),
        "disk_write_bps": disk.get("write_bps"),
        "disk_read_iops": disk.get("read_iops"),
        "disk_write_iops": disk.get("write_iops"),
        "job_cpu": job.get("cpu"),
        "job_rss": job.get("rss"),
        "job_procs": job.get("processes"),
    }
    return {k: number(v) for k, v in values.items()}


def _detail(host: dict[str, Any]) -> dict[str, Any]:
    """Per-core and per-interface values, kept as JSON: wanted rarely, never queried by."""
    return {
        "cpu_cores": host.get("cpu_cores"),
        "net": {nic: [v.get("rx_bps"), v.get("tx_bps")] for nic, v in (host.get("net") or {}).items()},
        "procs": [{k: p.get(k) for k in ("pid", "name", "rank", "cpu_cores", "rss")} for p in (host.get("job") or {}).get("procs", [])],
    }


def _rank_rows(snap: dict[str, Any], prev: dict[str, Any] | None):
    """Per rank: the poll interval's mean step time, data wait and throughput from the
    agent's counters. An agent that restarted (new `started`) resets the baseline."""
    prev_ranks = {}
    if prev is not None and prev.get("started") == snap.get("started"):
        prev_ranks = prev.get("ranks") or {}
    dt = None if prev is None else snap.get("t", 0) - prev.get("t", 0)
    for key, r in (snap.get("ranks") or {}).items():
        p = prev_ranks.get(key) or {"steps_total": 0, "step_time_total": 0.0, "data_wait_total": 0.0, "samples_total": 0}
        steps = r["steps_total"] - p["steps_total"]
        if steps < 0:
            continue
        row = {
            "step": number(r.get("step")), "epoch": number(r.get("epoch")), "loss": number(r.get("loss")),
            "lr": number(r.get("lr")),
            "steps": steps,
            "step_time": (r["step_time_total"] - p["step_time_total"]) / steps if steps else None,
            "data_wait": (r["data_wait_total"] - p["data_wait_total"]) / steps if steps else None,
            "samples_per_s": (r["samples_total"] - p["samples_total"]) / dt if dt and dt > 0 and prev_ranks else None,
            "steps_total": r["steps_total"], "step_time_total": r["step_time_total"],
            "data_wait_total": r["data_wait_total"], "samples_total": r["samples_total"],
        }  # fmt: skip
        yield int(key), row
