"""The EC2 API on loopback for the cloud tests: moto's server mode in a subprocess.

`DataPlane` plays the part of the cloud's hypervisor: when the API shows an instance of
a cluster running, it gives that instance a machine (a namespace host's network, with
the instance's private address added, and an sshd listening on it); when the API shows
it terminated, the machine goes away. `rented_yaml` puts the VPC's subnet inside the
test bridge's own /24, above the addresses the namespace hosts use, so the head reaches
every instance.

One server per session (`ec2_server`); `ec2` resets its state before each test, so every
test starts from an empty account and `--leaked` sees only its own instances. Faults the
server cannot produce (no capacity, quota, throttling) are raised by botocore event
hooks on a client the test builds (`ec2_client(..., fail=...)`): at the client
boundary, exactly as botocore raises a refused request, never inside dtrain.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from tests.netns import SSHD, Host, _sshd_config
from tests.s3 import start_moto, stop_moto

REPO = Path(__file__).resolve().parents[1]
REGION = "us-east-1"
IMAGE = "ami-12c6146b"  # one of moto's built-in images


@dataclass
class Ec2Server:
    endpoint: str

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, fail: dict[str, Callable[[dict], str | None]] | None = None):
        """A boto3 EC2 client; `fail[Operation](params)` returning an error code makes
        that call raise ClientError(code) before it is sent."""
        import boto3
        from botocore.exceptions import ClientError

        client = boto3.client("ec2", endpoint_url=self.endpoint, region_name=REGION,
                              aws_access_key_id="test", aws_secret_access_key="test")
        for operation, decide in (fail or {}).items():
            def hook(params, _op=operation, _decide=decide, **_):
                code = _decide(params)
                if code:
                    raise ClientError({"Error": {"Code": code, "Message": f"injected {code}"}}, _op)
            client.meta.events.register(f"before-parameter-build.ec2.{operation}", hook)
        return client

    def states(self, cluster: str) -> list[str]:
        reply = self.client().describe_instances(Filters=[{"Name": "tag:dtrain:cluster", "Values": [cluster]}])
        return sorted(i["State"]["Name"] for r in reply["Reservations"] for i in r["Instances"])


@pytest.fixture(scope="session")
def ec2_server(tmp_path_factory) -> Ec2Server:
    proc, endpoint = start_moto(tmp_path_factory.mktemp("moto-ec2"), {})
    try:
        yield Ec2Server(endpoint)
    finally:
        stop_moto(proc)


@pytest.fixture
def ec2(ec2_server, monkeypatch) -> Ec2Server:
    urllib.request.urlopen(urllib.request.Request(f"{ec2_server.endpoint}/moto-api/reset", method="POST")).read()
    for key, value in ec2_server.env().items():
        monkeypatch.setenv(key, value)
    return ec2_server


@pytest.fixture
def ec2_on_bridge(netns_cluster, tmp_path) -> Ec2Server:
    """A fresh EC2 API on the bridge's head address, which the namespace hosts (the
    rented nodes) reach too: what autostop's nodes call to terminate themselves."""
    proc, endpoint = start_moto(tmp_path, {}, host=netns_cluster.head_address)
    try:
        yield Ec2Server(endpoint)
    finally:
        stop_moto(proc)


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


def rented_yaml(netns, ec2: Ec2Server, tmp_path: Path, name: str, extra: str = "") -> Path:
    """A cloud.yaml for a 2-instance cluster `name` in a subnet of the bridge's /24;
    `extra` adds lines to its cloud: section."""
    prefix = netns.hosts[0].address.rsplit(".", 1)[0]
    client = ec2.client()
    vpc = client.create_vpc(CidrBlock=f"{prefix}.0/24")["Vpc"]["VpcId"]
    subnet = client.create_subnet(VpcId=vpc, CidrBlock=f"{prefix}.128/25",
                                  AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    path = tmp_path / "cloud.yaml"
    path.write_text(f"""ssh_config: {netns.ssh_config}
defaults: {{python: {sys.executable}, workdir: {REPO}, env: {{DTRAIN_HOME: {tmp_path / 'node-home'}}}}}
cloud:
  name: {name}
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
{extra}""")
    return path
