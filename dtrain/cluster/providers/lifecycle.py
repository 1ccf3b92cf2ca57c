"""The life of a rented cluster: up (record first, then create, wait), down (terminate,
confirm), the leaks (instances with dtrain's tags and no live record), and `dtrain run
--down` (create if needed, run, release whatever happened).

Side effects come in: the provider (its client), the records, and `echo` for the lines
the user reads.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from dtrain.cluster.providers import make_provider
from dtrain.cluster.providers.autostop import arm
from dtrain.cluster.providers.base import Instance, Provider, ProviderError
from dtrain.cluster.providers.config import CloudSpec, cluster_spec, read_cloud_file
from dtrain.cluster.providers.records import LIVE_STATES, ClusterRecords, ClusterRow
from dtrain.errors import ConfigError, DtrainError

Echo = Callable[[str], None]


def up(spec: CloudSpec, records: ClusterRecords, provider: Provider, echo: Echo = print) -> list[Instance]:
    """`spec.count` running instances of `spec.name`, creating only what is missing.

    A failure while creating terminates what this creation started before it is raised:
    for a cluster that is not up yet, every instance with its tag (a crashed earlier
    attempt's too); for one that is up, only the new ones (a job may be using the rest)."""
    with records.creating(spec.name):
        row = records.get(spec.name)
        keep = {i.id for i in provider.query(spec.name) if i.alive} if row and row.state == "up" else set()
        token = records.begin(spec.name, spec.provider, spec.model_dump())
        try:
            provider.create(spec.name, token, spec.count)
            instances = provider.wait(spec.name, spec.count, spec.wait_timeout)
        except BaseException:
            _release_after_failure(spec, records, provider, keep, echo)
            raise
        records.reconcile(spec.name, provider.query(spec.name), provider.price)
        records.set_state(spec.name, "up")
        return instances


def _release_after_failure(spec: CloudSpec, records: ClusterRecords, provider: Provider, keep: set[str],
                           echo: Echo) -> None:
    try:
        made = [i.id for i in provider.query(spec.name) if i.alive and i.id not in keep]
        if made:
            echo(f"creating {spec.name} failed; terminating the {len(made)} instance(s) it started")
        provider.terminate(made, spec.wait_timeout)
        records.reconcile(spec.name, provider.query(spec.name), provider.price)
        if not keep:
            records.set_state(spec.name, "failed")
    except Exception as exc:  # the original error is the one to raise; this one must be seen too
        echo(f"could not release {spec.name} after the failure ({exc}); run `dtrain down {spec.name}`")


def down(name: str, records: ClusterRecords, provider: Provider, timeout: float = 600) -> ClusterRow:
    """Terminate every instance tagged `name`, confirm they are gone, close the record."""
    provider.terminate([i.id for i in provider.query(name) if i.alive], timeout)
    records.reconcile(name, provider.query(name), provider.price)
    records.set_state(name, "down")
    row = records.get(name)
    assert row is not None
    return row


def refresh(records: ClusterRecords, row: ClusterRow, provider: Provider) -> None:
    """Bring a live record in line with the cloud; a cluster with no instance left is down."""
    seen = provider.query(row.name)
    records.reconcile(row.name, seen, provider.price)
    if row.state == "up" and not any(i.alive for i in seen):
        records.set_state(row.name, "down")


def leaked(records: ClusterRecords, providers: list[Provider]) -> list[Instance]:
    """Live instances with dtrain's tags whose cluster has no live record here."""
    live = {r.name for r in records.all() if r.state in LIVE_STATES}
    return [i for p in providers for i in p.query() if i.alive and i.cluster not in live]


def provider_of(row: ClusterRow, **deps: Any) -> Provider:
    return make_provider(CloudSpec.model_validate(row.spec), **deps)


def account_providers(records: ClusterRecords, extra: tuple[CloudSpec, ...] = (), **deps: Any) -> list[Provider]:
    """One provider per (cloud, region, endpoint) this head ever rented in, plus `extra`."""
    specs = [CloudSpec.model_validate(r.spec) for r in records.all()] + list(extra)
    seen: dict[tuple, CloudSpec] = {}
    for s in specs:
        seen.setdefault((s.provider, s.region, s.endpoint_url), s)
    return [make_provider(s, **deps) for s in seen.values()]


def wait_ssh(spec: CloudSpec, instances: list[Instance], provider: Provider, port: int = 22) -> None:
    """Until every instance accepts TCP connections on its SSH port: an instance the cloud
    calls running may still be booting. Bounded by `spec.wait_timeout`."""
    import socket
    import time

    address = provider.address
    deadline = time.monotonic() + spec.wait_timeout
    for inst in instances:
        while True:
            try:
                with socket.create_connection((address(inst), port), timeout=2):
                    break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ProviderError(f"{inst.id} ({address(inst)}) does not answer on port {port}: {exc}",
                                        "check the security group allows SSH from here, and the key pair"
                                        ) from None
                time.sleep(1.0)


def node_list(spec: CloudSpec, rest: dict[str, Any], instances: list[Instance], provider: Provider):
    """The ClusterSpec of the rented nodes: `<name>-0` (the master), `<name>-1`, ..."""
    return cluster_spec(spec, rest, [(f"{spec.name}-{k}", provider.address(i)) for k, i in enumerate(instances)])


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP while rented instances are being created or used."""


@contextmanager
def signals_unwind() -> Iterator[None]:
    """SIGTERM/SIGHUP raise `Terminated` here, so the `finally` and `except` blocks that
    release instances run instead of the process dying with them still running. (A job's
    supervisor installs its own handlers while it runs, and restores these.)"""
    import signal

    from dtrain.signals import raising

    with raising((signal.SIGTERM, signal.SIGHUP), lambda sig: Terminated(sig.name)):
        yield


def _usd(cost: float | None) -> str:
    return "cost unknown (set cloud.prices)" if cost is None else f"${cost:.4f}"


def cost_line(row: ClusterRow) -> str:
    return f"{row.name}: {row.node_hours:.4f} node-hours, {_usd(row.cost)}"


def job_cost_line(cost: dict) -> str:
    """One line for a job's cost section (dtrain.cluster.providers.cost)."""
    return (f"on {cost['cluster']}: this job {cost['node_hours']:.4f} node-hours, {_usd(cost['cost'])}; the cluster "
            f"{cost['cluster_node_hours']:.4f} node-hours, {_usd(cost['cluster_cost'])}, "
            f"{cost['idle_node_hours']:.4f} of them idle")


@contextmanager
def rented_cluster(cluster_file: str | Path | None, *, release: bool, dry_run: bool = False, echo: Echo = print,
                   records: ClusterRecords | None = None, **deps: Any) -> Iterator[Any]:
    """For `dtrain run`: the rented cluster's ClusterSpec when the file has a `cloud:`
    section (brought up if needed), else None. With `release`, the cluster is
    terminated when the block ends, however it ends. A dry run rents and releases
    nothing: it shows the cluster only if it is up."""
    cloud = read_cloud_file(cluster_file) if cluster_file else None
    if cloud is None:
        if release:
            raise ConfigError("--down releases a rented cluster, and no cluster file with a cloud: section was given",
                              "name a cluster file with a cloud: section, or drop --down")
        yield None
        return
    spec, rest = cloud
    records = records or ClusterRecords()
    provider = make_provider(spec, echo=echo, **deps)
    if dry_run:
        running = [i for i in provider.query(spec.name) if i.state == "running"]
        if len(running) != spec.count:
            raise ConfigError(f"{spec.name} is not up ({len(running)} of {spec.count} instances running), "
                              "and a dry run rents nothing", f"`dtrain up {cluster_file}` first")
        yield node_list(spec, rest, running, provider)
        return
    try:
        with signals_unwind():
            instances = up(spec, records, provider, echo)
            wait_ssh(spec, instances, provider)
            nodes = node_list(spec, rest, instances, provider)
            arm(spec, nodes, instances, provider, echo)  # refreshes the nodes' beat too
            echo(f"{spec.name}: {len(instances)} x {spec.instance_type} up in "
                 f"{', '.join(sorted({i.zone for i in instances}))}")
            yield nodes
    finally:
        if release:
            try:
                echo(f"releasing {spec.name}")
                echo(cost_line(down(spec.name, records, provider, spec.wait_timeout)))
            except DtrainError as exc:
                echo(f"could not release {spec.name}: {exc}")
                raise
