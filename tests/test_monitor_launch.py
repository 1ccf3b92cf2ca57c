"""Monitoring of a real `dtrain run` across two namespace hosts: the launcher starts an
agent on every node and the collector on the head; ranks report through report_step."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dtrain.monitor.head.metrics_db import MetricsDB

pytestmark = [pytest.mark.netns, pytest.mark.slow]

# A rank of an ordinary (non-DDP) job: 6 s of steps, global rank 1 five times slower.
# (Agents start once the ranks run, ~1-2 s after their first heartbeat: the steps must
# outlast that, as any real training does.)
RANK_SCRIPT = """
import os, time
from dtrain.monitor.rank.client import report_step
rank = int(os.environ["RANK"])
sleep = 0.25 if rank == 1 else 0.05
end = time.monotonic() + 6.0
i = 0
while time.monotonic() < end:
    t0 = time.perf_counter()
    time.sleep(sleep)
    i += 1
    report_step(step=i, epoch=0, loss=1.0 / i, lr=0.1, step_time_s=time.perf_counter() - t0, samples=4)
print(f"rank {rank} did {i} steps", flush=True)
"""


def test_dtrain_run_collects_both_hosts_and_reports(netns_cluster, dtrain_home, tmp_path):
    from launch_helpers import free_port, job_id_of

    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    # the nodes work in this test's directory (shared, like a NAS): nothing is copied
    workdir = {h.name: f"    workdir: {tmp_path}" for h in netns_cluster.hosts[:2]}
    yaml = netns_cluster.cluster_yaml(2, node_extra=workdir)
    res = subprocess.run(
        [sys.executable, "-m", "dtrain", "run", str(yaml), "--no-preflight", "--port", str(free_port()),
         "--", "python", str(script)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "code copied" not in res.stdout
    job_id = job_id_of(res.stdout)
    # "[h2:r1] rank 1 did 11 steps" -> {"1": 11}
    steps = dict(re.findall(r"\] rank (\d+) did (\d+) steps", res.stdout))
    steps = {rank: int(n) for rank, n in steps.items()}
    assert set(steps) == {"0", "1"}, res.stdout

    store = MetricsDB.for_job(dtrain_home / "jobs" / job_id, readonly=True)
    nodes = store.node_series()
    assert set(nodes) == {"h1", "h2"}
    for series in nodes.values():
        assert len(series["t"]) >= 2 and all(0.0 <= c <= 1.0 for c in series["cpu"] if c is not None)
    ranks = store.rank_series()
    assert set(ranks) == {("h1", 0), ("h2", 1)}
    # every step each rank took reached the head (the rank flushes its last steps at exit)
    assert {str(r): max(s["steps_total"]) for (_, r), s in ranks.items()} == steps
    store.close()

    out = tmp_path / "report"
    rep = subprocess.run([sys.executable, "-m", "dtrain", "report", job_id, "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["nodes"] == 2 and summary["totals"]["ranks"] == 2
    assert ("straggler", "h2", 1) in {(f["kind"], f["node"], f["rank"]) for f in summary["findings"]}
