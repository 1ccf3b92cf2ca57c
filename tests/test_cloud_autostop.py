"""Autostop: rented nodes terminate themselves through the EC2 API when idle or cut off
from their head, with no dtrain command left running. The nodes are namespace hosts
(tests.ec2.DataPlane) and the API is a moto server they reach on the bridge."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dtrain.cluster.providers.autostop_node import decide, job_processes
from dtrain.cluster.providers.config import CloudSpec
from tests.ec2 import IMAGE, REGION, REPO, DataPlane, rented_yaml

LIMIT = 60.0


def test_decide_ends_an_idle_node_and_one_cut_off_from_its_head():
    armed = 1000.0
    assert decide(armed + 59, False, armed, armed, LIMIT) is None
    assert "no job has run for 60 s" in decide(armed + 60, False, armed, armed, LIMIT)
    # A job that ran until t+50 keeps the node up until t+110.
    assert decide(armed + 100, False, armed + 50, armed, LIMIT) is None
    assert "no job" in decide(armed + 110, False, armed + 50, armed, LIMIT)
    # A running job keeps it up while the head is heard from...
    assert decide(armed + 500, True, armed + 500, armed + 450, LIMIT) is None
    # ...and not once the head has been silent for the limit (the laptop is gone).
    assert "head has not been heard from for 60 s" in decide(armed + 510, True, armed + 510, armed + 450, LIMIT)


def test_autostop_is_a_duration_of_at_least_30s():
    fields = dict(name="a", count=1, region=REGION, instance_type="g5.xlarge", image=IMAGE)
    assert CloudSpec(**fields, autostop="1m").autostop == 60
    assert CloudSpec(**fields, autostop="2h").autostop == 7200
    assert CloudSpec(**fields, autostop=45).autostop == 45
    assert CloudSpec(**fields).autostop is None
    for bad in ("10s", "soon", "5 min"):
        with pytest.raises(ValueError, match="autostop"):
            CloudSpec(**fields, autostop=bad)


@pytest.mark.netns
def test_job_processes_are_those_of_the_node_itself(netns_cluster):
    h1, h2 = netns_cluster.hosts[:2]
    marker = netns_cluster.popen(h1, [sys.executable, "-c", "import time; time.sleep(60)", "dtrain.launch.node"])
    try:
        probe = [sys.executable, "-c", "from dtrain.cluster.providers.autostop_node import job_processes as j; "
                 "print(sum('time.sleep(60)' in c for c in j()))"]
        seen = {h.name: netns_cluster.exec(h, probe, cwd=REPO, check=True).stdout.strip() for h in (h1, h2)}
        assert seen == {h1.name: "1", h2.name: "0"}  # h2 is another machine
        assert not any("time.sleep(60)" in c for c in job_processes())  # so is the test's own namespace
    finally:
        marker.kill()
        marker.wait()


def _watchers(node_home: Path) -> list[str]:
    """The autostop daemons that run with configs under `node_home`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = proc.read_bytes().replace(b"\0", b" ").decode(errors="replace")  # any process: any bytes
        except OSError:
            continue
        if "autostop_node.py watch" in cmd and str(node_home) in cmd:
            found.append(cmd)
    return found


def _read_until(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    seen: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            seen.append(line)
            if needle in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    found.wait(timeout)
    return "".join(seen)


@pytest.mark.netns
@pytest.mark.slow  # a rent, an idle minute, the nodes' own terminate: ~2 min
def test_nodes_terminate_themselves_after_the_head_is_killed(netns_cluster, ec2_on_bridge, tmp_path, dtrain_home):
    ec2 = ec2_on_bridge
    path = rented_yaml(netns_cluster, ec2, tmp_path, "auto", extra="  autostop: 1m\n")
    node_home = tmp_path / "node-home"
    env = dict(os.environ, DTRAIN_HOME=str(dtrain_home), **ec2.env())
    plane = DataPlane(netns_cluster, ec2, "auto")
    try:
        head = subprocess.Popen([sys.executable, "-m", "dtrain", "up", str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        out = _read_until(head, "autostop armed", timeout=240)
        head.kill()  # SIGKILL: no finally, no signal handler, nothing of the head runs any more
        head.wait()
        assert "autostop armed on 2 node(s)" in out, out
        assert ec2.states("auto") == ["running", "running"]
        assert len(_watchers(node_home)) == 2, _watchers(node_home)
        configs = sorted((node_home / "autostop").glob("i-*.json"))
        assert len(configs) == 2 and all(c.stat().st_mode & 0o077 == 0 for c in configs)
        assert (node_home / "autostop").stat().st_mode & 0o077 == 0

        # Arming again (a second head) starts no second daemon per instance.
        again = subprocess.run([sys.executable, "-m", "dtrain", "up", str(path), "--no-check"], env=env, cwd=REPO,
                               capture_output=True, text=True, timeout=240)
        assert again.returncode == 0 and "autostop armed" in again.stdout, again.stdout + again.stderr
        assert len(_watchers(node_home)) == 2, _watchers(node_home)

        deadline = time.monotonic() + 180  # the minute of idleness, a 10 s tick, a loaded machine
        while ec2.states("auto") != ["terminated", "terminated"] and time.monotonic() < deadline:
            time.sleep(2)
        assert ec2.states("auto") == ["terminated", "terminated"]
        logs = [log.read_text() for log in sorted((node_home / "autostop").glob("i-*.log"))]
        assert len(logs) == 2
        for log in logs:
            assert "armed on i-" in log and "no job has run for" in log and "ec2 answered:" in log, log
        deadline = time.monotonic() + 30
        while _watchers(node_home) and time.monotonic() < deadline:
            time.sleep(1)
        assert _watchers(node_home) == []  # each daemon ended after its instance
    finally:
        plane.close()
