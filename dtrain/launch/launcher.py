"""`dtrain run` as a library call: preflight, plan, dry run, prepare nodes, supervise.

`start` is the whole launch path; the CLI only parses flags into a JobSpec and a
ClusterSpec. Side effects (output stream, registry) are passed in. Every command to a
node - preflight probe, code-sync check, setup, node wrapper, monitor agent - shares one
SSH connection per node (`job_runners`): the launch pays one handshake, like a
hand-written `ssh node torchrun ...`, not one per step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TextIO

from dtrain.errors import ExitStatus, JobFailed, PreflightError
from dtrain.jobs import secrets
from dtrain.jobs.registry import JobRegistry, new_job_id
from dtrain.launch.plan import LaunchPlan, build_plan, node_command, remove_sync_marker, render
from dtrain.launch.spec import JobSpec
from dtrain.paths import job_dir


@dataclass
class Started:
    job_id: str
    plan: LaunchPlan
    exit_status: int
    supervisor_pid: int | None = None


def preflight(cluster, job: JobSpec, out: TextIO, timeout: float = 30.0, runners: dict | None = None):
    """The cluster engineer's checks; any failing node -> PreflightError, nothing launched.

    `runners`: the job's runners by node name, so the probes open the connections that the
    launch then reuses."""
    from dtrain.cluster.preflight import run_preflight
    from dtrain.cluster.runner import runner_for

    from rich.console import Console

    factory = (lambda node, c: runners[node.name]) if runners else runner_for
    report = run_preflight(cluster, master_port=job.port, timeout=timeout, out=Console(file=out, width=120),
                           runner_factory=factory)
    if not report.ok:
        lines = "\n".join(f"  {line}" for line in report.failures)
        raise PreflightError(
            f"preflight failed, nothing was launched:\n{lines}",
            "fix the nodes above, or skip the checks with --no-preflight",
        )
    return report


def job_runners(cluster, job_id: str | None) -> tuple[dict, str | None]:
    """One runner per node; with a job id, every command to a node shares one connection
    (closed by `dtrain.cluster.ssh.close_connections(directory)` when the job is over)."""
    from dtrain.cluster.runner import runner_for

    directory = None
    if job_id and any(not n.is_local for n in cluster.nodes):
        from dtrain.cluster.ssh import job_connections

        directory = job_connections(job_id)
    return {n.name: runner_for(n, cluster).share_connection(directory) for n in cluster.nodes}, directory


def start(
    job: JobSpec,
    cluster,
    *,
    out: TextIO,
    run_preflight: bool = True,
    dry_run: bool = False,
    detach: bool = False,
    registry: JobRegistry | None = None,
    head_cwd: str | None = None,
) -> Started:
    head_cwd = head_cwd or os.getcwd()
    if dry_run:
        runners, _ = job_runners(cluster, None)
        plan = build_plan(job, cluster.nodes, new_job_id(time.time()), head_cwd=head_cwd)
        local = {}
        for n in plan.nodes:
            argv, cwd = node_command(n)
            local[n.name] = runners[n.name].argv(argv, env=n.env, cwd=cwd)
        _, values = secrets.split({"plan": plan.to_json()}, job.secret_env)
        out.write(secrets.mask(render(plan, local), values.values()) + "\n")
        return Started(plan.job_id, plan, 0)

    registry = registry or JobRegistry()
    job_id = new_job_id(registry.clock())
    runners, connections = job_runners(cluster, job_id)
    handed_over = False  # to the detached supervisor, which closes the connections itself
    plan = None
    try:
        ifnames: dict = {}
        gpus: dict = {}
        if run_preflight:
            report = preflight(cluster, job, out, runners=runners)
            ifnames = {k: v for k, v in report.ifname.items() if v}
            gpus = {k: v for k, v in report.gpus.items() if v is not None}
        plan = build_plan(job, cluster.nodes, job_id, head_cwd=head_cwd, ifnames=ifnames, gpus=gpus)
        directory = job_dir(job_id)
        registry.create(plan.name, [n.name for n in plan.nodes], plan.world_size, directory, job_id=job_id)
        # This process answers for the job until a supervisor takes over: if it dies while
        # preparing, readers mark the job failed instead of leaving it pending.
        registry.set_supervisor(job_id, os.getpid())
        from dtrain.launch.prepare import prepare_nodes
        from dtrain.launch.supervisor import spawn, supervise, write_job_file

        try:
            prepare_nodes(plan, cluster, runners, job, out=out)
        except BaseException as exc:
            from dtrain.jobs.registry import JobState

            if isinstance(exc, KeyboardInterrupt):
                registry.finish(job_id, JobState.STOPPED, int(ExitStatus.INTERRUPTED), "interrupted while preparing")
            else:
                registry.finish(job_id, JobState.FAILED, 1, f"preparing the nodes failed: {exc}".splitlines()[0])
            raise
        # After prepare_nodes, which may change the plan.
        secret_values = write_job_file(directory, plan, cluster, job)
        if detach:
            pid = spawn(job_id, registry, secret_values)
            handed_over = True
            out.write(f"job {job_id} started in the background (supervisor pid {pid})\n"
                      f"  follow it: dtrain logs {job_id} -f    stop it: dtrain stop {job_id}\n")
            return Started(job_id, plan, 0, pid)

        out.write(f"[dtrain] job {job_id}: {len(plan.nodes)} node(s), world size {plan.world_size}\n")
        outcome = supervise(job_id, out=out, registry=registry, runners=runners, plan=plan)
    finally:
        if not handed_over:
            from dtrain.cluster.ssh import close_connections

            close_connections(connections)
            if plan is not None:
                remove_sync_marker(plan)
    if outcome.state == "succeeded":
        out.write(outcome.summary(job_id) + "\n")
        return Started(job_id, plan, 0)
    if outcome.state == "stopped":
        out.write(outcome.summary(job_id) + "\n")
        return Started(job_id, plan, int(ExitStatus.INTERRUPTED))
    text = outcome.summary(job_id) if outcome.hang is None else f"job {job_id} failed: {outcome.hang.describe()}"
    raise JobFailed(text, f"full logs: dtrain logs {job_id}   (or {directory / 'logs'})")

