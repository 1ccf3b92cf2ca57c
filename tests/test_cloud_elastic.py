"""Elastic recovery on a rented cluster: an instance terminated through the EC2 API in
the middle of training (and its machine killed) is replaced, the job resumes from its
last checkpoint at the full world size, and the event is in the log and the report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from launch_helpers import SCRIPTS, free_port
from tests.ec2 import REPO, DataPlane, rented_yaml


def test_the_new_node_takes_the_lost_ones_place_under_its_name():
    from dtrain.cluster.providers.replace import _moved
    from dtrain.launch.plan import NodeLaunch

    lost = NodeLaunch(name="c-1", node_rank=1, nproc=1, address="10.0.0.12",
                      argv=["torchrun", "--local-addr", "10.0.0.12", "--rdzv-endpoint", "10.0.0.125:29500"],
                      env={"DTRAIN_NODE_ADDRS": "10.0.0.125,10.0.0.12"}, cwd=None, scratch="/tmp/s",
                      agent_argv=["agent", "--bind", "10.0.0.12"], agent_url="http://10.0.0.12:9100")
    new = _moved(lost, "10.0.0.12", "10.0.0.200")
    assert new.name == "c-1" and new.address == "10.0.0.200"
    assert new.argv == ["torchrun", "--local-addr", "10.0.0.200", "--rdzv-endpoint", "10.0.0.125:29500"]
    assert new.env == {"DTRAIN_NODE_ADDRS": "10.0.0.125,10.0.0.200"}  # the master's address stays
    assert new.agent_argv[-1] == "10.0.0.200" and new.agent_url == "http://10.0.0.200:9100"


@pytest.mark.parametrize(("args", "says"), [
    (dict(rdzv="static", max_restarts=0), "needs an elastic job"),
    (dict(rdzv="elastic", max_restarts=0), "needs an elastic job whose survivors may restart"),
])
def test_replacements_need_an_elastic_job_that_may_restart(args, says, tmp_path):
    from dtrain.cluster.providers.replace import replacer_for
    from dtrain.errors import ConfigError
    from dtrain.launch.spec import JobSpec

    job = JobSpec(command=["python", "x.py"], **args)
    assert replacer_for(None, job, 0, detach=False) is None
    with pytest.raises(ConfigError, match=says):
        replacer_for(None, job, 1, detach=False)
    plain = tmp_path / "plain.yaml"
    plain.write_text("nodes: [gpu1]\n")
    with pytest.raises(ConfigError, match="no cluster file with a cloud: section"):
        replacer_for(str(plain), JobSpec(command=["python", "x.py"], rdzv="elastic", max_restarts=1), 1, False)


def _node_instance(ec2, cluster: str, k: int) -> str:
    """The instance behind node `<cluster>-<k>`: the provider lists by launch, then id."""
    reply = ec2.client().describe_instances(Filters=[{"Name": "tag:dtrain:cluster", "Values": [cluster]}])
    live = [i for r in reply["Reservations"] for i in r["Instances"] if i["State"]["Name"] == "running"]
    return sorted(live, key=lambda i: (i["LaunchTime"], i["InstanceId"]))[k]["InstanceId"]


@pytest.mark.netns
@pytest.mark.slow  # a rent, a 2-node run, a replacement mid-run: ~2 min on the loaded 2-core machine
def test_a_lost_instance_is_replaced_and_the_job_completes(netns_cluster, ec2, tmp_path, dtrain_home):
    path = rented_yaml(netns_cluster, ec2, tmp_path, "elastic")
    plane = DataPlane(netns_cluster, ec2, "elastic")
    ckpt = tmp_path / "ckpt.pt"
    env = dict(os.environ, DTRAIN_HOME=str(dtrain_home), **ec2.env())
    run = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "run", str(path), "--down", "--rdzv", "elastic", "--max-restarts", "2",
         "--max-replacements", "1", "--nproc-per-node", "1", "--port", str(free_port()),
         "--", "python", str(SCRIPTS / "plain_ddp.py"), "--epochs", "8", "--sleep", "0.3", "--ckpt", str(ckpt)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(run.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any("saved epoch 1 world=2" in ln for ln in lines):
            assert run.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        victim = _node_instance(ec2, "elastic", 1)
        host = plane.machines[victim][0]
        for pid, _ in netns_cluster.processes(host):  # the machine dies with everything on it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ec2.client().terminate_instances(InstanceIds=[victim])
        assert run.wait(timeout=420) == 0, "".join(lines)
        reader.join(10)
        out = "".join(lines)
        assert "[dtrain] node elastic-1 lost" in out and "replacing it" in out, out
        assert "[dtrain] elastic-1 is now i-" in out, out
        resumed = [ln for ln in lines if "start world=2 epoch=" in ln and "epoch=0" not in ln]
        assert resumed, out  # the restart went on from the checkpoint, with both nodes
        assert "[elastic-0:r0] done world=2" in out, out
        assert len(plane.booted) == 3
        assert ec2.states("elastic") == ["terminated"] * 3
        from dtrain.jobs.registry import JobRegistry
        from dtrain.paths import job_dir

        job = JobRegistry().list()[0]
        report = subprocess.run([sys.executable, "-m", "dtrain", "report", job.id], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert report.returncode == 0, report.stdout + report.stderr
        events = json.loads((job_dir(job.id) / "report" / "summary.json").read_text())["replacements"]
        assert [e["node"] for e in events] == ["elastic-1"] and events[0]["old_address"] != events[0]["new_address"]
        assert "elastic-1 was lost" in (job_dir(job.id) / "report" / "report.html").read_text()
    finally:
        if run.poll() is None:
            run.kill()
        plane.close()
