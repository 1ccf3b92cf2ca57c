"""What a job on rented nodes cost, for `dtrain report` and the dashboard.

A rented node is named `<cluster>-<k>` (lifecycle.node_list): the k-th instance of that
cluster alive while the job ran, in the provider's order. A job's share is its
node-hours (the job's duration on each of its nodes) x each instance's price per hour;
the cluster's own node-hours and cost are its instances' whole lifetimes x their prices
(records.ClusterRecords), and what no job of this head used of them is idle.
"""

from __future__ import annotations

import re
import time
from typing import Any, Iterable

from dtrain.cluster.providers.records import ClusterRecords, InstanceRow
from dtrain.paths import dtrain_home

_NODE = re.compile(r"^(?P<cluster>.+)-(?P<k>\d+)$")


def job_cost(nodes: Iterable[str], started: float | None, ended: float | None,
             records: ClusterRecords | None = None, jobs: Iterable[Any] | None = None,
             now: float | None = None) -> dict[str, Any] | None:
    """The cost section of a job that ran on a rented cluster, None for any other job.
    `jobs` are the head's job records (name `nodes`, `started`, `ended`): what they used
    of the cluster is not idle."""
    if started is None:
        return None
    now = time.time() if now is None else now
    if records is None:
        if not (dtrain_home() / "clusters.sqlite").exists():
            return None  # this head never rented a cluster
        records = ClusterRecords()
    clusters = {r.name: r for r in records.all()}
    placed = _placed(nodes, clusters)
    if not placed:
        return None
    name = placed[0][1]
    cluster = clusters[name]
    instances = records.instances(name)
    end = ended or now
    hours, cost, prices = 0.0, 0.0, {}
    for node, _, k in placed:
        inst = _instance_at(instances, k, started, end, now)
        if inst is None:  # a node that only shares the name: the cluster was not up then
            continue
        h = (end - started) / 3600
        hours += h
        prices[node] = inst.price
        cost = None if cost is None or inst.price is None else cost + h * inst.price
    if not prices:
        return None
    used = sum(_used_hours(job, name, clusters, cluster.created_at, cluster.ended_at or now, now)
               for job in (jobs if jobs is not None else _head_jobs()))
    return {
        "cluster": name, "provider": cluster.provider, "instance_type": cluster.spec.get("instance_type"),
        "price_per_hour": prices, "node_hours": hours, "cost": cost,
        "cluster_node_hours": cluster.node_hours, "cluster_cost": cluster.cost,
        "idle_node_hours": max(0.0, cluster.node_hours - used),
    }


def _placed(nodes: Iterable[str], clusters: dict) -> list[tuple[str, str, int]]:
    """(node, cluster, k) for each of `nodes` that is a rented node."""
    out = []
    for node in nodes:
        match = _NODE.match(node)
        if match and match["cluster"] in clusters:
            out.append((node, match["cluster"], int(match["k"])))
    return out


def _instance_at(instances: list[InstanceRow], k: int, start: float, end: float, now: float) -> InstanceRow | None:
    alive = [i for i in instances if i.launched_at <= end and (i.ended_at or now) >= start]
    return alive[k] if k < len(alive) else (alive[0] if alive else None)


def _used_hours(job: Any, name: str, clusters: dict, life_start: float, life_end: float, now: float) -> float:
    if job.started is None:
        return 0.0
    mine = [p for p in _placed(job.nodes, clusters) if p[1] == name]
    span = min(job.ended or now, life_end) - max(job.started, life_start)
    return len(mine) * max(0.0, span) / 3600


def _head_jobs() -> list[Any]:
    from dtrain.jobs.registry import JobRegistry

    return JobRegistry().list()
