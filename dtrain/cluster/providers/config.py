"""The `cloud:` section of a cluster file: what to rent, where, and how to reach it.

```yaml
cloud:
  name: defects-a10g          # the cluster's name: tags, records, `dtrain down NAME`
  provider: ec2
  count: 2
  region: us-east-1
  zones: [us-east-1a, us-east-1b]   # tried in order when one has no capacity
  instance_type: g5.xlarge
  image: ami-...
  key_name: plant-key
  spot: true
  autostop: 30m               # the nodes terminate themselves after 30 min without a job
  iam_instance_profile: dtrain-node   # the role they do it with (README 'Rent a cluster')
defaults: {python: /opt/conda/bin/python, setup: ["pip install dtrain"]}
```

The rest of the file is an ordinary cluster.yaml without `nodes:` (they come from the
cloud): `defaults`, `ssh_options`, `shared_paths`, ... apply to every rented node.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from dtrain.configio import StrictModel, read_mapping, validate
from dtrain.errors import ConfigError

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smh]?)$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


class CloudSpec(StrictModel):
    name: str
    provider: str = "ec2"
    count: int = Field(ge=1, le=256)
    region: str
    zones: list[str] = Field([], description="tried in order; empty: the cloud (or the subnet) picks")
    instance_type: str
    image: str = Field(description="ami-..., ssm:/aws/service/... (a public parameter), or name:PATTERN "
                                   "(Amazon's newest image by that name)")
    key_name: str | None = None
    security_group_ids: list[str] = []
    subnet_ids: dict[str, str] = Field({}, description="zone -> subnet id (the subnet fixes the zone)")
    disk_gb: int = Field(100, ge=8, le=16384)
    spot: bool = False
    max_price: float | None = Field(None, gt=0, description="USD per hour a spot instance may cost at most")
    ssh_user: str = "ubuntu"
    # The head dials the private address when it sits in the same network (a VPN, a
    # bastion, or the tests' bridge); else the public one.
    use_private_ip: bool = False
    endpoint_url: str | None = None
    prices: dict[str, float] = Field({}, description="USD per instance-hour, overrides the built-in table")
    wait_timeout: float = Field(600, gt=0, description="seconds for instances to run (and to be gone)")
    autostop: float | None = Field(None, description="'30m', '2h', '90s' (or seconds): each node terminates "
                                   "itself after that long without a job, or without its head")
    iam_instance_profile: str | None = Field(None, description="the instance profile the nodes run with; autostop "
                                             "uses its role (without one, the head's credentials are handed over)")

    @field_validator("autostop", mode="before")
    @classmethod
    def _autostop(cls, value: Any) -> Any:
        if isinstance(value, str):
            match = _DURATION.match(value.strip())
            if not match:
                raise ValueError(f"autostop {value!r} is not a duration such as 30m, 2h or 90s")
            value = float(match[1]) * _UNITS[match[2] or "s"]
        if value is not None and float(value) < 30:
            raise ValueError("autostop is at least 30s (a node must get the time to start a job)")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError("a cloud cluster name is lower-case letters, digits and '-' (at most 40)")
        return name

    @field_validator("image")
    @classmethod
    def _image(cls, image: str) -> str:
        if not image.startswith(("ami-", "ssm:", "name:")):
            raise ValueError("image is an id (ami-...), ssm:PARAMETER or name:PATTERN (README 'Rent a cluster')")
        return image

    @field_validator("provider")
    @classmethod
    def _provider(cls, name: str) -> str:
        from dtrain.cluster.providers import check_provider_name

        try:
            return check_provider_name(name)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _spot(self) -> CloudSpec:
        if self.max_price is not None and not self.spot:
            raise ValueError("max_price applies to spot instances only; set spot: true or remove max_price")
        unknown = set(self.subnet_ids) - set(self.zones)
        if unknown and self.zones:
            raise ValueError(f"subnet_ids names zones not in zones: {', '.join(sorted(unknown))}")
        return self


def read_cloud_file(path: str | Path) -> tuple[CloudSpec, dict[str, Any]] | None:
    """(the cloud section, the rest of the file) if the file has a `cloud:` section,
    else None. The rest is checked as a cluster.yaml right away, so a typo fails here,
    before anything is rented."""
    data = read_mapping(path)
    if "cloud" not in data:
        return None
    rest = {k: v for k, v in data.items() if k != "cloud"}
    if "nodes" in rest:
        raise ConfigError(f"{path} has both cloud: and nodes:",
                          "remove nodes: (a cloud cluster's nodes are the instances it rents)")
    spec = validate(CloudSpec, data["cloud"] if isinstance(data["cloud"], dict) else {}, f"{path} (cloud:)")
    cluster_spec(spec, rest, [("check", "192.0.2.1")], source=str(path))
    return spec, rest


def cluster_spec(spec: CloudSpec, rest: dict[str, Any], nodes: list[tuple[str, str]], source: str = "cloud"):
    """The ordinary ClusterSpec for rented nodes given as (name, address) pairs."""
    from dtrain.cluster.spec import ClusterSpec

    data = {**rest, "nodes": [{"name": name, "host": f"{spec.ssh_user}@{addr}", "address": addr}
                              for name, addr in nodes]}
    return validate(ClusterSpec, data, source)
