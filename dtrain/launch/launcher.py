"""`dtrain run` as a library call: preflight, plan, dry run, prepare nodes, supervise.

`start` is the whole launch path; the CLI only parses flags into a JobSpec and a
ClusterSpec. Side effects (output stream, registry) are passed in.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TextIO

from dtrain.errors import ExitStatus, JobFailed, PreflightError
from dtrain.jobs.registry import JobRegistry, new_job_id
from dtrain.launch.plan import LaunchPlan, build_plan, render
from dtrain.launch.spec import JobSpec
from dtrain.paths import job_dir


@dataclass
class Started:
    job_id: str
    plan: LaunchPlan
    exit_status: int
    supervisor_pid: int | None = None


def preflight(cluster, job: JobSpec, out: TextIO, timeout: float = 30.0):
    """The cluster engineer's checks; any failing node -> PreflightError, nothing launched."""
    from dtrain.cluster.preflight import run_preflight

    from rich.console import Console

    report = run_preflight(cluster, master_port=job.port, timeout=timeout, out=Console(file=out, width=120))
    if not report.ok:
        lines = "\n".join(f"  {line}" for line in report.failures)
        raise PreflightError(
            f"preflight failed, nothing was launched:\n{lines}",
            "fix the nodes above, or skip the checks with --no-preflight",
        )
    return report


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
    from dtrain.cluster.runner import runner_for

    head_cwd = head_cwd or os.getcwd()
    ifnames: dict = {}
    gpus: dict = {}
    if run_preflight and not dry_run:
        report = preflight(cluster, job, out)
        ifnames = {k: v for k, v in report.ifname.items() if v}
        gpus = {k: v for k, v in report.gpus.items() if v is not None}
    runners = {n.name: runner_for(n, cluster) for n in cluster.nodes}
    if dry_run:
        plan = build_plan(job, cluster.nodes, new_job_id(time.time()), head_cwd=head_cwd)
        local = {n.name: runners[n.name].argv(n.argv, env=n.env, cwd=n.cwd) for n in plan.nodes}
        out.write(render(plan, local) + "\n")
        return Started(plan.job_id, plan, 0)

    registry = registry or JobRegistry()
    job_id = new_job_id(registry.clock())
    plan = build_plan(job, cluster.nodes, job_id, head_cwd=head_cwd, ifnames=ifnames, gpus=gpus)
    directory = job_dir(job_id)
    registry.create(plan.name, [n.name for n in plan.nodes], plan.world_size, directory, job_id=job_id)
    # This process answers for the job until a supervisor takes over: if it dies while
    # preparing, readers mark the job failed instead of leaving it pending.
    registry.set_supervisor(job_id, os.getpid())
    from dtrain.launch.prepare import prepare_nodes
    from dtrain.launch.supervisor import spawn, supervise, write_job_file

    write_job_file(directory, plan, cluster, job)
    try:
        prepare_nodes(plan, cluster, runners, job, out=out)
    except BaseException as exc:
        from dtrain.jobs.registry import JobState

        if isinstance(exc, KeyboardInterrupt):
            registry.finish(job_id, JobState.STOPPED, int(ExitStatus.INTERRUPTED), "interrupted while preparing")
        else:
            registry.finish(job_id, JobState.FAILED, 1, f"preparing the nodes failed: {exc}".splitlines()[0])
        raise
    if detach:
        pid = spawn(job_id, registry)
        out.write(f"job {job_id} started in the background (supervisor pid {pid})\n"
                  f"  follow it: dtrain logs {job_id} -f    stop it: dtrain stop {job_id}\n")
        return Started(job_id, plan, 0, pid)

    out.write(f"[dtrain] job {job_id}: {len(plan.nodes)} node(s), world size {plan.world_size}\n")
    outcome = supervise(job_id, out=out, registry=registry)
    if outcome.state == "succeeded":
        out.write(outcome.summary(job_id) + "\n")
        return Started(job_id, plan, 0)
    if outcome.state == "stopped":
        out.write(outcome.summary(job_id) + "\n")
        return Started(job_id, plan, int(ExitStatus.INTERRUPTED))
    text = outcome.summary(job_id) if outcome.hang is None else f"job {job_id} failed: {outcome.hang.describe()}"
    raise JobFailed(text, f"full logs: dtrain logs {job_id}   (or {directory / 'logs'})")
