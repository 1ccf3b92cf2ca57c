"""Rented clusters against moto's EC2 server on loopback: the control plane for real
(run, describe, terminate, tags), faults injected at the boto3 client boundary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dtrain.cluster.providers import make_provider
from dtrain.cluster.providers.base import CapacityError, Instance, ProviderError
from dtrain.cluster.providers.config import CloudSpec, read_cloud_file
from dtrain.cluster.providers.ec2 import PRICES
from dtrain.cluster.providers.lifecycle import leaked, refresh, up
from dtrain.cluster.providers.records import ClusterRecords
from dtrain.errors import ConfigError, DtrainError
from tests.ec2 import IMAGE, REGION


def spec(ec2, name: str, **extra) -> CloudSpec:
    fields = dict(name=name, count=2, region=REGION, zones=["us-east-1a", "us-east-1b"], instance_type="g5.xlarge",
                  image=IMAGE, endpoint_url=ec2.endpoint, wait_timeout=60)
    return CloudSpec(**{**fields, **extra})


def provider(ec2, cloud: CloudSpec, fail=None, **deps):
    deps.setdefault("sleep", lambda s: None)
    return make_provider(cloud, client=ec2.client(fail), **deps)


def dtrain(*args: str, env_home, ec2, check: bool = True) -> subprocess.CompletedProcess[str]:
    import os

    env = dict(os.environ, DTRAIN_HOME=str(env_home), **ec2.env())
    proc = subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True, env=env,
                          timeout=180)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def write_cloud_yaml(tmp_path, ec2, name: str) -> str:
    path = tmp_path / "cloud.yaml"
    path.write_text(f"""cloud:
  name: {name}
  count: 2
  region: {REGION}
  zones: [us-east-1a]
  instance_type: g5.xlarge
  image: {IMAGE}
  spot: true
  endpoint_url: {ec2.endpoint}
  prices: {{g5.xlarge: 0.5}}
defaults: {{python: {sys.executable}}}
""")
    return str(path)


def test_up_twice_then_down_leaves_nothing(ec2, dtrain_home, tmp_path):
    cfg = write_cloud_yaml(tmp_path, ec2, "defects")
    first = dtrain("up", cfg, "--no-check", env_home=dtrain_home, ec2=ec2)
    assert first.stdout.count("g5.xlarge spot") == 2, first.stdout
    assert ec2.states("defects") == ["running", "running"]
    dtrain("up", cfg, "--no-check", env_home=dtrain_home, ec2=ec2)  # nothing new
    assert ec2.states("defects") == ["running", "running"]
    listing = dtrain("clusters", "--refresh", env_home=dtrain_home, ec2=ec2).stdout
    assert "defects" in listing and " up " in listing and "ec2" in listing, listing
    assert (dtrain_home / "clusters.sqlite").stat().st_mode & 0o077 == 0

    gone = dtrain("down", "defects", env_home=dtrain_home, ec2=ec2).stdout
    assert "every instance terminated" in gone and "$" in gone, gone
    assert ec2.states("defects") == ["terminated", "terminated"]
    assert "0 leaked" in dtrain("clusters", "--leaked", env_home=dtrain_home, ec2=ec2).stdout
    assert " down " in dtrain("clusters", env_home=dtrain_home, ec2=ec2).stdout


def test_down_and_run_refuse_what_they_cannot_do(ec2, dtrain_home, tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text("nodes: [local]\n")
    refused = dtrain("run", str(plain), "--down", "--", "true", env_home=dtrain_home, ec2=ec2, check=False)
    assert refused.returncode == 3 and "no cluster file with a cloud: section" in refused.stderr, refused.stderr
    cfg = write_cloud_yaml(tmp_path, ec2, "never")
    both = dtrain("run", cfg, "--down", "--detach", "--", "true", env_home=dtrain_home, ec2=ec2, check=False)
    assert both.returncode == 3 and "--detach" in both.stderr, both.stderr
    dry = dtrain("run", cfg, "--dry-run", "--", "true", env_home=dtrain_home, ec2=ec2, check=False)
    assert dry.returncode == 3 and "a dry run rents nothing" in dry.stderr, dry.stderr
    unknown = dtrain("down", "nosuch", env_home=dtrain_home, ec2=ec2, check=False)
    assert unknown.returncode == 3 and "dtrain clusters" in unknown.stderr, unknown.stderr
    assert ec2.states("never") == []


def test_sigterm_while_waiting_for_ssh_releases_the_cluster(ec2, dtrain_home, tmp_path):
    import os
    import signal
    import time

    cfg = write_cloud_yaml(tmp_path, ec2, "sigterm")  # no data plane: SSH never answers
    env = dict(os.environ, DTRAIN_HOME=str(dtrain_home), **ec2.env())
    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", cfg, "--down", "--", "true"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while ec2.states("sigterm") != ["running", "running"]:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and "releasing sigterm" in out, out
    assert ec2.states("sigterm") == ["terminated", "terminated"]


def test_leaked_instances_are_listed_and_removed(ec2, dtrain_home, tmp_path):
    cfg = write_cloud_yaml(tmp_path, ec2, "kept")
    dtrain("up", cfg, "--no-check", env_home=dtrain_home, ec2=ec2)
    # An instance with dtrain's tags that no record here knows (a lost laptop's cluster).
    ec2.client().run_instances(ImageId=IMAGE, MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "dtrain:cluster", "Value": "orphan"}]}])
    listed = dtrain("clusters", "--leaked", env_home=dtrain_home, ec2=ec2).stdout
    assert "orphan" in listed and "1 leaked" in listed and "kept" not in listed, listed
    dtrain("down", "--leaked", env_home=dtrain_home, ec2=ec2)
    assert ec2.states("orphan") == ["terminated"]
    assert ec2.states("kept") == ["running", "running"]  # a live record's instances are not leaks
    dtrain("down", "kept", env_home=dtrain_home, ec2=ec2)


def test_second_up_after_a_crash_mid_creation_makes_no_duplicates(ec2, dtrain_home):
    cloud = spec(ec2, "crashy", count=3)
    records = ClusterRecords()
    # The crash: the record is written and one instance requested, then the process died.
    token = records.begin(cloud.name, cloud.provider, cloud.model_dump())
    early = provider(ec2, cloud.model_copy(update={"zones": ["us-east-1b"]})).create(cloud.name, token, 1)
    made = up(cloud, records, provider(ec2, cloud))
    assert len(made) == 3 and early[0].id in {i.id for i in made}
    again = up(cloud, records, provider(ec2, cloud))
    assert {i.id for i in again} == {i.id for i in made}
    assert ec2.states("crashy") == ["running"] * 3
    assert {i.zone for i in made} == {"us-east-1b"}  # finished in the zone it started in, not the first


def test_one_up_at_a_time_and_a_missing_image_rents_nothing(ec2, dtrain_home):
    cloud = spec(ec2, "locked", count=1)
    records = ClusterRecords()
    with records.creating("locked"), pytest.raises(DtrainError, match="right now"):
        up(cloud, records, provider(ec2, cloud))
    bad = cloud.model_copy(update={"image": "ami-00000000deadbeef"})
    with pytest.raises(ProviderError, match="not available in us-east-1"):
        up(bad, records, provider(ec2, bad))
    assert ec2.states("locked") == []


def test_the_image_by_ssm_parameter_or_by_name(ec2, dtrain_home):
    """How a Deep Learning AMI is found: the public parameter AWS keeps pointing at the
    newest one, or the newest Amazon image whose name matches."""
    import boto3

    ssm = boto3.client("ssm", endpoint_url=ec2.endpoint, region_name=REGION)
    ssm.put_parameter(Name="/test/deeplearning/ami-id", Value=IMAGE, Type="String")
    for image, expected in (("ssm:/test/deeplearning/ami-id", IMAGE), ("name:Deep Learning AMI Ubuntu*", None)):
        cloud = spec(ec2, image[:3], count=1, image=image)
        said: list[str] = []
        made = up(cloud, ClusterRecords(), provider(ec2, cloud, echo=said.append), said.append)
        raw = ec2.client().describe_instances(InstanceIds=[made[0].id])["Reservations"][0]["Instances"][0]
        name = ec2.client().describe_images(ImageIds=[raw["ImageId"]])["Images"][0]["Name"]
        if expected:
            assert raw["ImageId"] == expected
        else:
            assert name.startswith("Deep Learning AMI Ubuntu"), name
        assert said == [f"image {image} is {raw['ImageId']} ({name})"]
    missing = spec(ec2, "no-image", count=1, image="ssm:/test/nothing-here")
    with pytest.raises(ProviderError, match="ParameterNotFound"):
        up(missing, ClusterRecords(), provider(ec2, missing))
    assert ec2.states("no-image") == []


def test_a_zone_without_capacity_moves_on_to_the_next(ec2, dtrain_home):
    cloud = spec(ec2, "zones")
    said: list[str] = []
    full = {"RunInstances": lambda p: "InsufficientInstanceCapacity"
            if p.get("Placement", {}).get("AvailabilityZone") == "us-east-1a" else None}
    made = up(cloud, ClusterRecords(), provider(ec2, cloud, full, echo=said.append), said.append)
    assert {i.zone for i in made} == {"us-east-1b"} and len(made) == 2
    assert said == ["us-east-1a: InsufficientInstanceCapacity (injected InsufficientInstanceCapacity); "
                    "trying the next zone"]


def test_every_zone_failing_names_each_zone_and_leaves_nothing(ec2, dtrain_home):
    cloud = spec(ec2, "nozones")
    codes = {"us-east-1a": "InsufficientInstanceCapacity", "us-east-1b": "VcpuLimitExceeded"}
    fail = {"RunInstances": lambda p: codes[p["Placement"]["AvailabilityZone"]]}
    records = ClusterRecords()
    with pytest.raises(CapacityError) as err:
        up(cloud, records, provider(ec2, cloud, fail, echo=lambda s: None), lambda s: None)
    text = str(err.value)
    assert "us-east-1a: InsufficientInstanceCapacity" in text and "us-east-1b: VcpuLimitExceeded" in text
    assert ec2.states("nozones") == []
    assert records.get("nozones").state == "failed"


def test_a_failure_after_creating_terminates_what_was_created(ec2, dtrain_home):
    cloud = spec(ec2, "halfway")
    calls = {"n": 0}

    def refuse_once_running(params):  # the 2nd describe is the first one of wait()
        calls["n"] += 1
        return "UnauthorizedOperation" if calls["n"] == 2 else None

    records = ClusterRecords()
    with pytest.raises(Exception, match="UnauthorizedOperation"):
        up(cloud, records, provider(ec2, cloud, {"DescribeInstances": refuse_once_running}), lambda s: None)
    assert ec2.states("halfway") == ["terminated", "terminated"]
    assert records.get("halfway").state == "failed" and records.get("halfway").nodes == 0


def test_a_failed_growth_of_an_up_cluster_spares_its_running_instances(ec2, dtrain_home):
    small = spec(ec2, "grow", count=1)
    records = ClusterRecords()
    first = up(small, records, provider(ec2, small))
    calls = {"n": 0}

    def refuse_in_wait(params):  # 1: what is up, 2: create's count, 3: the first of wait()
        calls["n"] += 1
        return "UnauthorizedOperation" if calls["n"] == 3 else None

    bigger = small.model_copy(update={"count": 2})
    with pytest.raises(Exception, match="UnauthorizedOperation"):
        up(bigger, records, provider(ec2, bigger, {"DescribeInstances": refuse_in_wait}), lambda s: None)
    live = [i for i in provider(ec2, small).query("grow") if i.alive]
    assert [i.id for i in live] == [first[0].id] and ec2.states("grow") == ["running", "terminated"]
    assert records.get("grow").state == "up"


def test_an_instance_ended_from_the_console_is_replaced_by_up_and_seen_by_refresh(ec2, dtrain_home):
    cloud = spec(ec2, "console")
    records = ClusterRecords()
    first = up(cloud, records, provider(ec2, cloud))
    ec2.client().terminate_instances(InstanceIds=[first[1].id])
    refresh(records, records.get("console"), provider(ec2, cloud))
    assert records.get("console").nodes == 1 and records.get("console").state == "up"
    again = up(cloud, records, provider(ec2, cloud))
    assert first[0].id in {i.id for i in again} and first[1].id not in {i.id for i in again} and len(again) == 2
    assert ec2.states("console") == ["running", "running", "terminated"]
    assert records.get("console").nodes == 2


def test_throttling_is_retried_with_backoff(ec2, dtrain_home):
    cloud = spec(ec2, "busy", count=1)
    calls = {"n": 0}

    def throttle_twice(params):
        calls["n"] += 1
        return "RequestLimitExceeded" if calls["n"] <= 2 else None

    slept: list[float] = []
    made = up(cloud, ClusterRecords(), provider(ec2, cloud, {"RunInstances": throttle_twice},
                                                 sleep=slept.append, echo=lambda s: None))
    assert len(made) == 1 and slept[:2] == [1.0, 2.0]


def test_terminating_a_gone_instance_is_not_an_error(ec2, dtrain_home):
    cloud = spec(ec2, "gone", count=1)
    made = up(cloud, ClusterRecords(), provider(ec2, cloud))
    p = provider(ec2, cloud)
    p.terminate([made[0].id], timeout=30)
    p.terminate([made[0].id, "i-0123456789abcdef0"], timeout=30)
    assert ec2.states("gone") == ["terminated"]
    assert leaked(ClusterRecords(), [p]) == []


def test_more_instances_than_asked_is_reported_as_a_leak(ec2, dtrain_home):
    cloud = spec(ec2, "toomany", count=1)
    up(cloud.model_copy(update={"count": 2}), ClusterRecords(), provider(ec2, cloud))
    with pytest.raises(ProviderError, match="more than the 1 asked for"):
        provider(ec2, cloud).create("toomany", "tok", 1)


def test_cost_is_lifetime_times_price(tmp_path):
    now = [1000.0]
    records = ClusterRecords(tmp_path / "c.sqlite", clock=lambda: now[0])
    records.begin("c", "ec2", {})
    inst = Instance("i-1", "c", "c", "running", "z", "g5.xlarge", "10.0.0.1", None, 1000.0 - 1800, False)
    records.reconcile("c", [inst], lambda i: 2.0)
    assert records.get("c").cost == pytest.approx(1.0) and records.get("c").nodes == 1
    now[0] += 1800
    records.reconcile("c", [], lambda i: 2.0)  # the cloud no longer shows it: it ended now
    now[0] += 7200  # ended instances cost nothing more
    row = records.get("c")
    assert row.cost == pytest.approx(2.0) and row.node_hours == pytest.approx(1.0) and row.nodes == 0


def test_spot_instances_cost_the_spot_price_unless_prices_say_otherwise(ec2, dtrain_home):
    spot = spec(ec2, "spotty", count=1, spot=True)
    made = up(spot, ClusterRecords(), provider(ec2, spot))
    assert made[0].spot
    expected = float(ec2.client().describe_spot_price_history(
        InstanceTypes=["g5.xlarge"], AvailabilityZone=made[0].zone, MaxResults=1)["SpotPriceHistory"][0]["SpotPrice"])
    assert provider(ec2, spot).price(made[0]) == expected != PRICES["g5.xlarge"]
    fixed = spot.model_copy(update={"prices": {"g5.xlarge": 0.25}})
    assert provider(ec2, fixed).price(made[0]) == 0.25
    on_demand = spec(ec2, "steady", count=1)
    assert provider(ec2, on_demand).price(up(on_demand, ClusterRecords(), provider(ec2, on_demand))[0]) == 1.006


_BASE = "name: a, count: 1, region: r, instance_type: t, image: ami-1"


@pytest.mark.parametrize(("text", "says"), [
    ("cloud: {name: a, count: 1, region: r, instance_typ: t, image: ami-1}", "did you mean 'instance_type'"),
    ("cloud: {name: a, count: 1, region: r, instance_type: t, image: ubuntu}", "ssm:PARAMETER or name:PATTERN"),
    (f"cloud: {{{_BASE}, autostop: 10s}}", "autostop is at least 30s"),
    (f"cloud: {{{_BASE}, provider: ec3}}", "did you mean 'ec2'"),
    (f"cloud: {{{_BASE}}}\ndefaults: {{pyton: x}}", "did you mean 'defaults.python'"),
    (f"cloud: {{{_BASE}, max_price: 1}}", "spot instances only"),
    (f"cloud: {{{_BASE}}}\nnodes: [gpu1]", "both cloud: and nodes:"),
])
def test_cloud_file_is_checked_before_anything_is_rented(tmp_path, text, says):
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=says):
        read_cloud_file(path)


def test_the_readme_cloud_yaml_is_valid(tmp_path):
    from tests.conftest import REPO

    text = (REPO / "README.md").read_text().split("```yaml\n# cloud.yaml: 2 x one A10G")[1].split("```")[0]
    text = text.split("\n", 1)[1]  # past the comment line
    path = tmp_path / "cloud.yaml"
    path.write_text(text)
    spec, rest = read_cloud_file(path)
    assert spec.instance_type == "g5.xlarge" and spec.spot and spec.provider == "ec2"
    assert spec.autostop == 1800 and spec.image.startswith("ssm:/aws/service/deeplearning/ami/")
    assert rest["defaults"]["python"] == "/opt/pytorch/bin/python"
