"""`dtrain up`, `dtrain down`, `dtrain clusters`: rented clusters (owner: cloud).

`dtrain run cloud.yaml --down -- CMD` lives in launch_cmd.py and uses the same
lifecycle (dtrain.cluster.providers.lifecycle)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer


def up(
    cluster: Path = typer.Argument(..., help="cluster.yaml with a cloud: section."),
    no_check: bool = typer.Option(False, "--no-check",
                                  help="Return once the instances run: no preflight (and no wait for SSH unless "
                                  "autostop must be armed)."),
    port: int = typer.Option(29500, "--port", help="The master port the preflight checks."),
) -> None:
    """Rent the cluster a cloud: section describes (only the missing instances), wait for SSH, preflight.

    A second `dtrain up` of the same file continues (or confirms) the first; it never
    starts a second set."""
    from rich.console import Console

    from dtrain.cluster.preflight import run_preflight
    from dtrain.cluster.providers import make_provider
    from dtrain.cluster.providers.autostop import arm as arm_autostop
    from dtrain.cluster.providers.config import read_cloud_file
    from dtrain.cluster.providers.lifecycle import node_list, signals_unwind, wait_ssh
    from dtrain.cluster.providers.lifecycle import up as bring_up
    from dtrain.cluster.providers.records import ClusterRecords
    from dtrain.cluster.runner import job_runners, with_addresses
    from dtrain.errors import ConfigError, PreflightError

    cloud = read_cloud_file(cluster)
    if cloud is None:
        raise ConfigError(f"{cluster} has no cloud: section", "`dtrain up` rents clusters; see README 'Rent a cluster'")
    spec, rest = cloud
    provider = make_provider(spec, echo=typer.echo)
    with signals_unwind():  # a SIGTERM while creating terminates what was started
        instances = bring_up(spec, ClusterRecords(), provider, typer.echo)
    nodes = node_list(spec, rest, instances, provider)
    for node, inst in zip(nodes.nodes, instances):
        typer.echo(f"{node.name}  {inst.id}  {inst.zone}  {inst.instance_type}{' spot' if inst.spot else ''}  "
                   f"{node.host}")
    if no_check and spec.autostop is None:
        return
    wait_ssh(spec, instances, provider)
    arm_autostop(spec, nodes, instances, provider, typer.echo)  # before anything else can fail
    if no_check:
        return
    nodes = with_addresses(nodes, job_runners(nodes))
    report = run_preflight(nodes, master_port=port, timeout=60.0, out=Console())
    if not report.ok:
        raise PreflightError(f"{spec.name} is up but fails preflight (it is still running and costing money)",
                             f"fix what the nodes report, or `dtrain down {spec.name}`")


def down(
    name: Optional[str] = typer.Argument(None, help="The cluster's name (cloud.name)."),
    leaked: bool = typer.Option(False, "--leaked", help="Terminate every instance with dtrain's tags and no live record."),
) -> None:
    """Terminate a rented cluster's instances and confirm they are gone (or the leaked ones)."""
    from dtrain.cluster.providers.lifecycle import account_providers, cost_line, provider_of
    from dtrain.cluster.providers.lifecycle import down as take_down
    from dtrain.cluster.providers.lifecycle import leaked as find_leaked
    from dtrain.cluster.providers.records import ClusterRecords
    from dtrain.errors import ConfigError

    records = ClusterRecords()
    if leaked == (name is not None):
        raise ConfigError("name one cluster, or pass --leaked", "e.g. `dtrain down defects-a10g`")
    if leaked:
        for provider in account_providers(records, echo=typer.echo):
            ids = [i.id for i in find_leaked(records, [provider])]
            provider.terminate(ids, timeout=600)
            typer.echo(f"terminated {len(ids)} leaked instance(s){': ' + ', '.join(ids) if ids else ''}")
        return
    row = records.get(name)
    if row is None:
        raise ConfigError(f"no cluster named {name!r} in the records",
                          "`dtrain clusters` lists them; `dtrain down --leaked` ends instances without a record")
    typer.echo(cost_line(take_down(name, records, provider_of(row, echo=typer.echo))))
    typer.echo(f"{name}: every instance terminated")


def clusters(
    refresh: bool = typer.Option(False, "--refresh", help="Ask the cloud and reconcile the records first."),
    leaked: bool = typer.Option(False, "--leaked", help="List instances with dtrain's tags and no live record."),
) -> None:
    """Rented clusters: name, provider, nodes, state, age, node-hours and cost so far."""
    from dtrain.cluster.providers.lifecycle import account_providers, provider_of
    from dtrain.cluster.providers.lifecycle import leaked as find_leaked
    from dtrain.cluster.providers.lifecycle import refresh as reconcile
    from dtrain.cluster.providers.records import LIVE_STATES, ClusterRecords

    records = ClusterRecords()
    if leaked:
        found = find_leaked(records, account_providers(records, echo=typer.echo))
        for inst in found:
            typer.echo(f"{inst.id}  {inst.cluster or '(no name)'}  {inst.state}  {inst.zone}  {inst.instance_type}")
        typer.echo(f"{len(found)} leaked instance(s)" + ("; `dtrain down --leaked` ends them" if found else ""))
        return
    if refresh:
        for row in records.all():
            if row.state in LIVE_STATES:
                reconcile(records, row, provider_of(row, echo=typer.echo))
    rows = records.all()
    if not rows:
        typer.echo("no rented clusters (`dtrain up cloud.yaml` rents one)")
        return
    typer.echo(f"{'NAME':<24} {'PROVIDER':<8} {'NODES':>5} {'STATE':<8} {'AGE':>8} {'NODE-H':>8} {'COST':>10}")
    for r in rows:
        age = _age((r.ended_at or time.time()) - r.created_at)
        cost = "?" if r.cost is None else f"${r.cost:.2f}"
        typer.echo(f"{r.name:<24} {r.provider:<8} {r.nodes:>5} {r.state:<8} {age:>8} {r.node_hours:>8.3f} {cost:>10}")


def _age(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{int(seconds % 60):02d}s"


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(down)
    app.command()(clusters)
