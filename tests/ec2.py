"""The EC2 API on loopback for the cloud tests: moto's server mode in a subprocess.

One server per session (`ec2_server`); `ec2` resets its state before each test, so every
test starts from an empty account and `--leaked` sees only its own instances. Faults the
server cannot produce (no capacity, quota, throttling) are raised by botocore event
hooks on a client the test builds (`ec2_client(..., fail=...)`): at the client
boundary, exactly as botocore raises a refused request, never inside dtrain.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Callable

import pytest

from tests.s3 import start_moto, stop_moto

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
