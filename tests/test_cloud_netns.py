"""`dtrain run cloud.yaml --down` end to end: moto's EC2 API is the control plane and
network-namespace hosts are the data plane (tests.ec2.DataPlane)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from launch_helpers import REPO, SCRIPTS, free_port
from tests.ec2 import DataPlane, rented_yaml

pytestmark = pytest.mark.netns


@pytest.fixture
def rented(netns_cluster, ec2, tmp_path):
    """(cloud.yaml, data plane) for a 2-instance cluster named e2e in the bridge's subnet."""
    path = rented_yaml(netns_cluster, ec2, tmp_path, "e2e")
    plane = DataPlane(netns_cluster, ec2, "e2e")
    try:
        yield path, plane
    finally:
        plane.close()


@pytest.fixture
def dtrain(ec2, dtrain_home):
    """`dtrain ARGS` as a subprocess talking to the moto server, with this test's home."""
    env = dict(os.environ, DTRAIN_HOME=str(dtrain_home), **ec2.env())

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=400)

    return run


@pytest.mark.slow  # two rents of 2 instances, two 2-node DDP runs: ~80 s on the loaded 2-core machine
def test_run_down_rents_trains_and_releases(rented, ec2, dtrain):
    path, plane = rented
    t0 = time.time()
    run = dtrain("run", str(path), "--down", "--nproc-per-node", "1", "--port", str(free_port()),
                 "--", "python", str(SCRIPTS / "plain_ddp.py"), "--epochs", "1")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "[e2e-0:r0] done world=2" in out, out
    assert "releasing e2e" in out and "node-hours, $" in out, out
    assert len(plane.booted) == 2
    assert ec2.states("e2e") == ["terminated", "terminated"]
    assert "0 leaked" in dtrain("clusters", "--leaked").stdout
    # The cost is the instances' lifetimes x the configured price (1.0 USD per hour).
    hours = float(out.split("e2e: ")[-1].split(" node-hours")[0])
    assert 0 < hours <= 2 * (time.time() - t0) / 3600 + 1e-3

    # A failing job releases the cluster too (a second rent of the same name).
    fail = dtrain("run", str(path), "--down", "--nproc-per-node", "1", "--port", str(free_port()),
                  "--", "python", str(SCRIPTS / "plain_ddp.py"), "--fail-rank", "1", "--fail-step", "1")
    assert fail.returncode != 0, fail.stdout + fail.stderr
    assert len(plane.booted) == 4
    assert ec2.states("e2e") == ["terminated"] * 4
    assert "0 leaked" in dtrain("clusters", "--leaked").stdout


@pytest.mark.slow  # a rent, a preflight, a 2-node DDP run: ~50 s on the loaded 2-core machine
def test_up_checks_the_nodes_and_run_reuses_them(rented, ec2, dtrain):
    path, plane = rented
    up = dtrain("up", str(path))  # waits for SSH, then preflight over it
    assert up.returncode == 0, up.stdout + up.stderr
    assert "e2e-0" in up.stdout and "e2e-1" in up.stdout and "root@" in up.stdout, up.stdout
    dry = dtrain("run", str(path), "--dry-run", "--down", "--", "python", "x.py")  # shows, rents and ends nothing
    assert dry.returncode == 0 and "e2e-1" in dry.stdout, dry.stdout + dry.stderr
    assert ec2.states("e2e") == ["running", "running"]
    run = dtrain("run", str(path), "--down", "--nproc-per-node", "1", "--port", str(free_port()),
                 "--", "python", str(SCRIPTS / "plain_ddp.py"), "--epochs", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(plane.booted) == 2  # the run used the instances `up` rented
    assert ec2.states("e2e") == ["terminated", "terminated"]

    # The report and the dashboard show the job's and the cluster's node-hours and cost:
    # the instances' recorded lifetimes x the configured 1.0 USD per hour.
    from dtrain.cluster.providers.records import ClusterRecords
    from dtrain.jobs.registry import JobRegistry
    from dtrain.monitor.views.dashboard.server import series
    from dtrain.monitor.views.jobs import resolve

    job = JobRegistry().list()[0]
    folder = resolve(job.id).dir
    report = dtrain("report", job.id)
    assert report.returncode == 0 and "on e2e: this job" in report.stdout, report.stdout + report.stderr
    cost = json.loads((folder / "report" / "summary.json").read_text())["cloud"]
    lifetimes = [(i.ended_at - i.launched_at) / 3600 for i in ClusterRecords().instances("e2e")]
    assert len(lifetimes) == 2 and abs(cost["cluster_node_hours"] - sum(lifetimes)) < 1e-9
    assert abs(cost["cluster_cost"] - sum(lifetimes) * 1.0) < 1e-9
    assert abs(cost["cost"] - 2 * (job.ended - job.started) / 3600 * 1.0) < 1e-9
    assert 0 < cost["node_hours"] <= cost["cluster_node_hours"] - cost["idle_node_hours"] + 1e-9
    assert "this job" in (folder / "report" / "report.html").read_text()
    assert series(job.id, 0)["cost"] == cost
