"""A job's cost on a rented cluster: its node-hours x the instances' prices, next to the
cluster's whole lifetime x prices and what no job used (idle)."""

from __future__ import annotations

from types import SimpleNamespace

from dtrain.cluster.providers.base import Instance
from dtrain.cluster.providers.cost import job_cost
from dtrain.cluster.providers.records import ClusterRecords

T0 = 1_800_000_000.0
PRICE = {"g5.xlarge": 1.25, "g6.xlarge": 0.8}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _inst(iid: str, launched: float, state: str = "running", itype: str = "g5.xlarge") -> Instance:
    return Instance(iid, "c", "c", state, "us-east-1a", itype, "10.0.0.1", None, launched, False)


def _rent(tmp_path, clock: Clock) -> ClusterRecords:
    """Cluster c: i-a and i-b launched at T0 and T0+60, both ended at T0+2 h."""
    records = ClusterRecords(tmp_path / "clusters.sqlite", clock=clock)
    records.begin("c", "ec2", {"instance_type": "g5.xlarge"})
    price = lambda i: PRICE[i.instance_type]  # noqa: E731  (cloud.prices)
    records.reconcile("c", [_inst("i-a", T0), _inst("i-b", T0 + 60)], price)
    records.set_state("c", "up")
    clock.now = T0 + 7200
    records.reconcile("c", [_inst("i-a", T0, "terminated"), _inst("i-b", T0 + 60, "terminated")], price)
    records.set_state("c", "down")
    return records


def test_job_and_cluster_cost_are_lifetimes_times_prices(tmp_path):
    clock = Clock()
    records = _rent(tmp_path, clock)
    job = SimpleNamespace(nodes=("c-0", "c-1"), started=T0 + 600, ended=T0 + 600 + 1800)
    cost = job_cost(job.nodes, job.started, job.ended, records=records, jobs=[job], now=clock.now)
    assert cost["cluster"] == "c" and cost["instance_type"] == "g5.xlarge"
    assert cost["node_hours"] == 2 * 0.5 and cost["cost"] == 2 * 0.5 * 1.25
    cluster_hours = (7200 + 7140) / 3600
    assert abs(cost["cluster_node_hours"] - cluster_hours) < 1e-9
    assert abs(cost["cluster_cost"] - cluster_hours * 1.25) < 1e-9
    assert abs(cost["idle_node_hours"] - (cluster_hours - 1.0)) < 1e-9
    assert cost["price_per_hour"] == {"c-0": 1.25, "c-1": 1.25}


def test_only_jobs_on_the_cluster_while_it_was_up_have_a_cost(tmp_path):
    clock = Clock()
    records = _rent(tmp_path, clock)
    assert job_cost(("gpu1", "gpu2"), T0 + 600, T0 + 900, records=records, jobs=[], now=clock.now) is None
    # Same node names, but the cluster was already down: another machine by that name.
    assert job_cost(("c-0",), T0 + 9000, T0 + 9600, records=records, jobs=[], now=clock.now) is None
    assert job_cost(("c-0",), None, None, records=records, jobs=[], now=clock.now) is None


def test_a_head_that_never_rented_reports_no_cost(dtrain_home):
    assert job_cost(("c-0",), T0, T0 + 60) is None
    assert not (dtrain_home / "clusters.sqlite").exists()
