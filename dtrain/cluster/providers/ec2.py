"""The EC2 API through boto3: AWS, and any cloud or test server that speaks it.

Every instance is tagged `dtrain:cluster=<name>` and `dtrain:token=<record token>` at
launch (TagSpecifications, so an instance never exists untagged). A zone either starts
all the missing instances or none (MinCount = MaxCount): a cluster never straddles
zones by accident. Capacity and quota errors move on to the next zone; throttling is
retried here with backoff (botocore's own retries are off, so the two never multiply).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from botocore.exceptions import ClientError as _ClientError  # botocore comes with s3fs

from dtrain.cluster.providers.base import (
    TAG_CLUSTER,
    TAG_TOKEN,
    CapacityError,
    Instance,
    Provider,
    ProviderError,
    ZoneFailure,
)
from dtrain.cluster.providers.config import CloudSpec

# The request cannot succeed in this zone now; another zone (or type) may work.
CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity", "InstanceLimitExceeded", "VcpuLimitExceeded",
    "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow", "Unsupported",
})
THROTTLE_CODES = frozenset({"RequestLimitExceeded", "Throttling", "ThrottlingException",
                            "RequestThrottled", "ServiceUnavailable", "InternalError"})
USABLE = ("pending", "running")
GONE_CODES = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})

# On-demand USD per hour in us-east-1 (AWS list prices, late 2024); spot instances are
# priced from EC2's spot price history instead, and `cloud.prices` overrides both.
PRICES = {
    "g5.xlarge": 1.006, "g5.2xlarge": 1.212, "g5.4xlarge": 1.624, "g5.12xlarge": 5.672,
    "g5.48xlarge": 16.288, "g6.xlarge": 0.805, "g6.2xlarge": 0.978, "g6.4xlarge": 1.323,
    "g6.12xlarge": 4.602, "g6.48xlarge": 13.350, "p4d.24xlarge": 32.773, "t3.micro": 0.0104,
}


class Ec2Provider(Provider):
    def __init__(self, spec: CloudSpec, *, client: Any = None, sleep: Callable[[float], None] = time.sleep,
                 echo: Callable[[str], None] = print, attempts: int = 6) -> None:
        self.spec = spec
        self._client = client
        self._sleep = sleep
        self._echo = echo
        self._attempts = attempts
        self._resolved: tuple[str, str] | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import boto3
            except ImportError:
                raise ProviderError("the ec2 provider needs boto3", "pip install 'dtrain[cloud]'") from None
            from botocore.config import Config

            self._client = boto3.client("ec2", region_name=self.spec.region, endpoint_url=self.spec.endpoint_url,
                                        config=Config(retries={"total_max_attempts": 1}))
        return self._client

    def create(self, cluster: str, token: str, count: int) -> list[Instance]:
        seen = self.query(cluster)
        stopped = [i for i in seen if i.state in ("stopping", "stopped")]
        if stopped:
            raise ProviderError(f"instance {stopped[0].id} of {cluster} is {stopped[0].state}",
                                f"start it again in the console, or `dtrain down {cluster}` and bring it up again")
        # An instance on its way out (a console terminate, a spot reclaim) is replaced.
        have = [i for i in seen if i.state in USABLE]
        if len(have) > count:
            raise ProviderError(f"cluster {cluster} has {len(have)} live instances, more than the {count} asked for",
                                f"`dtrain down {cluster}` and bring it up again")
        if len(have) == count:
            return have
        need = count - len(have)
        zones: list[str | None] = list(self.spec.zones) or [None]
        if have:  # finish the cluster in the zone it started in
            zones = [have[0].zone]
        failures = []
        for zone in zones:
            try:
                made = self._run(cluster, token, zone, need, first=len(have))
            except _ClientError as exc:
                code, message = _code(exc), _message(exc)
                if code not in CAPACITY_CODES:
                    raise ProviderError(f"EC2 refused to start {need} x {self.spec.instance_type}: {code}: {message}",
                                        "fix the cloud: section (image, key, subnet, security group) or the account"
                                        ) from None
                failures.append(ZoneFailure(zone or "(any zone)", code, message))
                self._echo(f"{failures[-1].line()}; trying the next zone" if zone != zones[-1]
                           else failures[-1].line())
                continue
            return have + made
        raise CapacityError(f"{need} x {self.spec.instance_type}", failures)

    def _run(self, cluster: str, token: str, zone: str | None, need: int, first: int) -> list[Instance]:
        spec = self.spec
        image, root_device = self._image()
        request: dict[str, Any] = {
            "ImageId": image, "InstanceType": spec.instance_type, "MinCount": need, "MaxCount": need,
            # The same token for the same step of the same record: a retried request that
            # EC2 already served returns the first answer instead of a second set.
            "ClientToken": f"{token}-{zone or 'any'}-{first}",
            "BlockDeviceMappings": [{"DeviceName": root_device, "Ebs": {
                "VolumeSize": spec.disk_gb, "VolumeType": "gp3", "DeleteOnTermination": True}}],
            "TagSpecifications": [{"ResourceType": "instance", "Tags": [
                {"Key": TAG_CLUSTER, "Value": cluster}, {"Key": TAG_TOKEN, "Value": token},
                {"Key": "Name", "Value": cluster}]}],
        }
        if spec.key_name:
            request["KeyName"] = spec.key_name
        if spec.iam_instance_profile:
            request["IamInstanceProfile"] = {"Name": spec.iam_instance_profile}
        if spec.security_group_ids:
            request["SecurityGroupIds"] = spec.security_group_ids
        if zone and zone in spec.subnet_ids:
            request["SubnetId"] = spec.subnet_ids[zone]
        elif zone:
            request["Placement"] = {"AvailabilityZone": zone}
        elif len(spec.subnet_ids) == 1:
            request["SubnetId"] = next(iter(spec.subnet_ids.values()))
        if not spec.spot:
            # A node that powers itself off is terminated, never left stopped (and billed for
            # its disk). A one-time spot instance cannot be stopped: it ends on shutdown anyway.
            request["InstanceInitiatedShutdownBehavior"] = "terminate"
        else:
            options: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
            if spec.max_price is not None:
                options["MaxPrice"] = f"{spec.max_price:.4f}"
            request["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": options}
        reply = self._call("run_instances", **request)
        return [_instance(raw, cluster) for raw in reply["Instances"]]

    def _image(self) -> tuple[str, str]:
        """(image id, its root device) for `cloud.image`: an id, `ssm:PARAMETER` (the
        id a public parameter holds: AWS publishes the newest Deep Learning AMIs so), or
        `name:PATTERN` (the newest image of Amazon's whose name matches). The root
        device is what `disk_gb` resizes (another name would add a second, unused volume:
        Ubuntu images say /dev/sda1, Amazon Linux /dev/xvda)."""
        if self._resolved is not None:
            return self._resolved
        wanted = self.spec.image
        try:
            if wanted.startswith("ssm:"):
                wanted = self._ssm().get_parameter(Name=wanted[4:])["Parameter"]["Value"]
            if wanted.startswith("name:"):
                images = self._call("describe_images", Owners=["amazon"],
                                    Filters=[{"Name": "name", "Values": [wanted[5:]]}])["Images"]
                images = sorted(images, key=lambda i: i.get("CreationDate", ""))[-1:]
            else:
                images = self._call("describe_images", ImageIds=[wanted])["Images"]
        except _ClientError as exc:
            images, why = [], f"{_code(exc)}: {_message(exc)}"
        else:
            why = "no such image"
        if not images:
            raise ProviderError(f"image {self.spec.image} is not available in {self.spec.region} ({why})",
                                "images are per region: look up the id, parameter or name for this region "
                                "(README 'Rent a cluster')")
        self._resolved = (str(images[0]["ImageId"]), str(images[0].get("RootDeviceName", "/dev/sda1")))
        if self._resolved[0] != self.spec.image:
            self._echo(f"image {self.spec.image} is {self._resolved[0]} ({images[0].get('Name', '')})")
        return self._resolved

    def _ssm(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("ssm", region_name=self.spec.region, endpoint_url=self.spec.endpoint_url,
                            config=Config(retries={"mode": "standard"}))

    def wait(self, cluster: str, count: int, timeout: float) -> list[Instance]:
        deadline = time.monotonic() + timeout
        while True:
            usable = [i for i in self.query(cluster) if i.state in USABLE]
            if len(usable) < count:
                raise ProviderError(f"{count - len(usable)} instance(s) of {cluster} went away while starting "
                                    "(a spot reclaim, or ended from the console)", "run `dtrain up` again")
            ready = [i for i in usable if i.state == "running" and self._address(i)]
            if len(ready) >= count:
                return ready
            if time.monotonic() > deadline:
                raise ProviderError(f"{len(ready)} of {count} instances of {cluster} running after {timeout:.0f} s",
                                    "raise cloud.wait_timeout, or look at the instances in the console")
            self._sleep(2.0)

    def _address(self, instance: Instance) -> str | None:
        return instance.private_ip if self.spec.use_private_ip else instance.public_ip

    def address(self, instance: Instance) -> str:
        """The address this head (and the other nodes) dial: private or public, per the spec."""
        addr = self._address(instance)
        if not addr:
            raise ProviderError(f"instance {instance.id} has no {'private' if self.spec.use_private_ip else 'public'}"
                                " address", "use a subnet that assigns public addresses, or set use_private_ip")
        return addr

    def query(self, cluster: str | None = None) -> list[Instance]:
        tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}] if cluster else [
            {"Name": "tag-key", "Values": [TAG_CLUSTER]}]
        found: list[Instance] = []
        token = None
        while True:
            page = self._call("describe_instances", Filters=tag, **({"NextToken": token} if token else {}))
            for reservation in page.get("Reservations", []):
                found.extend(_instance(raw, None) for raw in reservation.get("Instances", []))
            token = page.get("NextToken")
            if not token:
                return sorted(found, key=lambda i: (i.launched_at, i.id))

    def terminate(self, ids: list[str], timeout: float) -> None:
        for one in ids:  # one call each: an instance already gone must not spare the others
            try:
                self._call("terminate_instances", InstanceIds=[one])
            except _ClientError as exc:
                if _code(exc) not in GONE_CODES:
                    raise ProviderError(f"EC2 refused to terminate {one}: {_code(exc)}: {_message(exc)}",
                                        "terminate it in the console, then `dtrain clusters --refresh`") from None
        deadline = time.monotonic() + timeout
        while ids:
            left = [i for i in self.query() if i.id in ids and i.state != "terminated"]
            if not left:
                return
            if time.monotonic() > deadline:
                raise ProviderError(f"still not terminated after {timeout:.0f} s: "
                                    + ", ".join(f"{i.id} ({i.state})" for i in left),
                                    "run `dtrain down` again, or terminate them in the console")
            self._sleep(2.0)

    def node_access(self, instance: Instance) -> dict:
        """With an instance profile the node terminates itself with its role; without
        one it gets this head's credentials (in a 0600 file on the node, see autostop)."""
        access = {"provider": "ec2", "region": self.spec.region, "endpoint_url": self.spec.endpoint_url,
                  "instance_id": instance.id, "credentials": None}
        if self.spec.iam_instance_profile:
            return access
        import boto3

        found = boto3.Session(region_name=self.spec.region).get_credentials()
        if found is None:
            raise ProviderError("autostop has no credentials to hand to the nodes",
                                "set cloud.iam_instance_profile (a role allowed to terminate the cluster's "
                                "instances), or give this head AWS credentials")
        creds = found.get_frozen_credentials()
        access["credentials"] = {"key": creds.access_key, "secret": creds.secret_key, "token": creds.token}
        return access

    def price(self, instance: Instance) -> float | None:
        """`cloud.prices` if it names the type; for a spot instance, the zone's current
        spot price (EC2's spot price history, read once when dtrain first sees the
        instance); else the on-demand list price."""
        if instance.instance_type in self.spec.prices:
            return self.spec.prices[instance.instance_type]
        if instance.spot:
            try:
                history = self._call("describe_spot_price_history", InstanceTypes=[instance.instance_type],
                                     AvailabilityZone=instance.zone, ProductDescriptions=["Linux/UNIX"],
                                     MaxResults=1)["SpotPriceHistory"]
            except _ClientError as exc:
                self._echo(f"no spot price for {instance.instance_type} in {instance.zone} ({_code(exc)}); "
                           "counting the on-demand price")
            else:
                if history:
                    return float(history[0]["SpotPrice"])
        return PRICES.get(instance.instance_type)

    def _call(self, operation: str, **kwargs: Any) -> dict:
        delay = 1.0
        for attempt in range(self._attempts):
            try:
                return getattr(self.client, operation)(**kwargs)
            except _ClientError as exc:
                if _code(exc) not in THROTTLE_CODES or attempt == self._attempts - 1:
                    raise
                self._echo(f"EC2 {operation}: {_code(exc)}; retrying in {delay:.0f} s")
                self._sleep(delay)
                delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")


def _code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__))


def _message(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Message", exc))


def _instance(raw: dict, cluster: str | None) -> Instance:
    tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
    launched = raw.get("LaunchTime")
    return Instance(
        id=raw["InstanceId"], cluster=cluster or tags.get(TAG_CLUSTER, ""), name=tags.get("Name", raw["InstanceId"]),
        state=raw["State"]["Name"], zone=raw.get("Placement", {}).get("AvailabilityZone", ""),
        instance_type=raw.get("InstanceType", ""), private_ip=raw.get("PrivateIpAddress"),
        public_ip=raw.get("PublicIpAddress"), launched_at=launched.timestamp() if launched else time.time(),
        spot=raw.get("InstanceLifecycle") == "spot",
    )
