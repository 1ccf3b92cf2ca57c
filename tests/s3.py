"""A real S3 API on loopback for the storage tests: moto's server mode in a subprocess.

Authentication is ON (moto's INITIAL_NO_AUTH_ACTION_COUNT): the fixture spends the
unauthenticated calls on creating an IAM user with an access key and an allow-all
policy, and every later request must be signed with that key, so wrong credentials
really are refused (403) like on a real store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from dtrain.ports import free_port

REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    key: str
    secret: str

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a child process (or monkeypatch) that talks to this server."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        env.update(extra)
        return env

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.key, aws_secret_access_key=self.secret)

    def new_bucket(self, prefix: str = "dtrain") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def stop_moto(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_moto(tmp: Path, env: dict[str, str], host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    """moto's server on a free port of `host` (loopback unless the namespace hosts must
    reach it too), answering; (process, endpoint)."""
    port = free_port()
    endpoint = f"http://{host}:{port}"
    log = tmp / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                                env=env or None, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    import boto3

    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")
    proc, endpoint = start_moto(tmp_path_factory.mktemp("moto"), env)
    try:
        iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION,
                           aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
        iam.create_user(UserName="dtrain")
        key = iam.create_access_key(UserName="dtrain")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="dtrain", PolicyName="all", PolicyDocument=json.dumps(policy))
        yield S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        stop_moto(proc)
