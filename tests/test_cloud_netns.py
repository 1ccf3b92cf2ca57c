"""`dtrain run cloud.yaml --down` end to end: moto's EC2 API is the control plane and
network-namespace hosts are the data plane.

`DataPlane` plays the part of the cloud's hypervisor: when the API shows an instance of
the cluster running, it gives that instance a machine (a namespace host's network, with
the instance's private address added, and an sshd listening on it); when the API shows
it terminated, the machine goes away. The VPC's subnet is part of the test bridge's own
/24, above the addresses the namespace hosts use, so the head reaches every instance.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from launch_helpers import REPO, SCRIPTS, free_port
from tests.ec2 import IMAGE, REGION
from tests.netns import SSHD, Host, _sshd_config

pytestmark = pytest.mark.netns


class DataPlane:
    def __init__(self, netns, ec2, cluster: str) -> None:
        self.netns, self.ec2, self.cluster = netns, ec2, cluster
        self.machines: dict[str, tuple[Host, str, subprocess.Popen]] = {}
        self.booted: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        client = self.ec2.client()
        while not self._stop.wait(0.3):
            reply = client.describe_instances(Filters=[{"Name": "tag:dtrain:cluster", "Values": [self.cluster]}])
            for inst in (i for r in reply["Reservations"] for i in r["Instances"]):
                state, iid = inst["State"]["Name"], inst["InstanceId"]
                if state == "running" and iid not in self.booted:
                    self._boot(iid, inst["PrivateIpAddress"])
                elif state in ("shutting-down", "terminated") and iid in self.machines:
                    self._halt(iid)

    def _boot(self, iid: str, ip: str) -> None:
        host = self.netns.hosts[len(self.booted) % len(self.netns.hosts)]
        self.booted.append(iid)
        subprocess.run(["ip", "-n", host.netns, "addr", "add", f"{ip}/24", "dev", "eth0"], check=True)
        cfg = _sshd_config(self.netns.tmpdir, Host(iid, host.netns, ip))
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, SSHD, "-D", "-e", "-f", str(cfg)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.machines[iid] = (host, ip, proc)

    def _halt(self, iid: str) -> None:
        host, ip, proc = self.machines.pop(iid)
        proc.terminate()
        proc.wait(10)
        subprocess.run(["ip", "-n", host.netns, "addr", "del", f"{ip}/24", "dev", "eth0"], check=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for iid in list(self.machines):
            self._halt(iid)


@pytest.fixture
def rented(netns_cluster, ec2, tmp_path):
    """(cloud.yaml, data plane) for a 2-instance cluster named e2e in the bridge's subnet."""
    prefix = netns_cluster.hosts[0].address.rsplit(".", 1)[0]
    client = ec2.client()
    vpc = client.create_vpc(CidrBlock=f"{prefix}.0/24")["Vpc"]["VpcId"]
    subnet = client.create_subnet(VpcId=vpc, CidrBlock=f"{prefix}.128/25",
                                  AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    path = tmp_path / "cloud.yaml"
    path.write_text(f"""ssh_config: {netns_cluster.ssh_config}
defaults: {{python: {sys.executable}, workdir: {REPO}}}
cloud:
  name: e2e
  count: 2
  region: {REGION}
  zones: [us-east-1a]
  subnet_ids: {{us-east-1a: {subnet}}}
  instance_type: g5.xlarge
  image: {IMAGE}
  spot: true
  use_private_ip: true
  ssh_user: root
  endpoint_url: {ec2.endpoint}
  prices: {{g5.xlarge: 1.0}}
  wait_timeout: 120
""")
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
