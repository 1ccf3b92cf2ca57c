"""`dtrain run`, `dtrain train --nproc N` and the quickstart as one library call: gather
the facts, plan, then execute that plan (or print it: the dry run).

`start` is the whole launch path; the CLIs only parse flags into a JobSpec and a
ClusterSpec (this machine alone is the `local` backend, a cluster.yaml or --hosts the
`ssh` one) or a SlurmCluster (`scheduler: slurm`: the plan is one batch script). Side effects (output stream, registry) are passed in. Every command to a node
- address lookup, preflight probe, code-sync check, setup, node wrapper, monitor agent -
shares one connection per node (`job_runners`): the launch pays one handshake, like a
hand-written `ssh node torchrun ...`, not one per step.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from dtrain.cluster.runner import close_job_runners, job_runners, with_addresses
from dtrain.errors import DtrainError, ExitStatus, JobFailed, PreflightError
from dtrain.jobs import secrets
from dtrain.jobs.registry import JobRegistry, JobState, new_job_id
from dtrain.launch.plan import Facts, LaunchPlan, build_plan, node_command, render
from dtrain.launch.prepare import prepare_nodes
from dtrain.launch.slurm import SlurmCluster, SlurmFacts, slurm_plan
from dtrain.launch.spec import JobSpec
from dtrain.launch.supervisor import spawn, supervise, write_job_file
from dtrain.launch.sync import can_mark, for_plan
from dtrain.paths import job_dir
from dtrain.signals import Stopped, raising


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


def gather_facts(cluster, job: JobSpec, runners: dict, out: TextIO, head_cwd: str, probe: bool) -> Facts:
    """What the plan needs to know about the nodes: the preflight's findings (GPUs,
    interface towards the master) when the nodes are probed, and whether the head can
    mark its directory for the code-sync check."""
    if not probe:
        return Facts(can_mark=can_mark(head_cwd))
    report = preflight(cluster, job, out, runners=runners)
    return Facts(ifnames={k: v for k, v in report.ifname.items() if v},
                 gpus={k: v for k, v in report.gpus.items() if v is not None},
                 can_mark=can_mark(head_cwd))


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
    on_job: Callable[[str], None] | None = None,
    replacer: Callable | None = None,
) -> Started:
    """Plan the job, then print the plan (`dry_run`) or execute it. `on_job` hears the
    job's id before it is executed (e.g. to tell the user how to watch a local run)."""
    head_cwd = head_cwd or os.getcwd()
    if not dry_run:  # a dry run registers nothing
        registry = registry or JobRegistry()
    job_id = new_job_id(registry.clock() if registry is not None else time.time())
    if isinstance(cluster, SlurmCluster):
        return _start_batch(job, cluster, job_id, out=out, run_preflight=run_preflight, dry_run=dry_run,
                            detach=detach, registry=registry, head_cwd=head_cwd, on_job=on_job)
    runners = job_runners(cluster, job_id)
    handed_over = False  # to the detached supervisor, which closes the connections itself
    try:
        cluster = with_addresses(cluster, runners)
        facts = gather_facts(cluster, job, runners, out, head_cwd, probe=run_preflight)
        plan = build_plan(job, cluster.nodes, job_id, head_cwd=head_cwd, facts=facts)
        if dry_run:
            via = {}
            for n in plan.nodes:
                argv, cwd = node_command(n)
                via[n.name] = runners[n.name].argv(argv, env=n.env, cwd=cwd)
            _, values = secrets.split({"plan": plan.to_json()}, job.secret_env)
            out.write(secrets.mask(render(plan, via), values.values()) + "\n")
            return Started(job_id, plan, 0)
        if on_job is not None:
            on_job(job_id)
        outcome, pid = _execute(plan, cluster, job, runners, registry, out=out, detach=detach, replacer=replacer)
        handed_over = pid is not None
    finally:
        if not handed_over:
            close_job_runners(runners)
    if pid is not None:
        return Started(job_id, plan, 0, pid)
    return _report(job_id, plan, outcome, out)


def _start_batch(job: JobSpec, cluster: SlurmCluster, job_id: str, *, out: TextIO, run_preflight: bool,
                 dry_run: bool, detach: bool, registry: JobRegistry | None, head_cwd: str,
                 on_job: Callable[[str], None] | None) -> Started:
    """A scheduler's job: the same plan -> job directory -> registry row; Slurm allocates
    the nodes and runs the plan's batch script, dtrain submits and follows it."""
    from dtrain.launch import slurm_job

    client = slurm_job.SlurmClient()
    try:
        facts = client.facts()
    except DtrainError:
        if not dry_run:
            raise
        facts = SlurmFacts()  # a dry run away from the cluster: the script says so
    plan = slurm_plan(job, cluster, job_id, head_cwd=head_cwd, facts=facts, preflight=run_preflight)
    if dry_run:
        out.write(render(plan) + "\n")
        return Started(job_id, plan, 0)
    if run_preflight:
        slurm_job.check_request(cluster.slurm, client.partitions())
    if on_job is not None:
        on_job(job_id)
    directory = job_dir(job_id)
    registry.create(plan.name, [], plan.world_size, directory, job_id=job_id)
    write_job_file(directory, plan, cluster, job)
    status = slurm_job.execute(plan, job, cluster, registry=registry, out=out, facts=facts, detach=detach,
                               client=client)
    return Started(job_id, plan, status)


def _execute(plan: LaunchPlan, cluster, job: JobSpec, runners: dict, registry: JobRegistry, *, out: TextIO,
             detach: bool, replacer: Callable | None = None):
    """Register the job, prepare the nodes, write job.json (the plan, unchanged) and run
    it here (-> its Outcome, None) or under a detached supervisor (-> None, its pid)."""
    job_id = plan.job_id
    directory = job_dir(job_id)
    registry.create(plan.name, [n.name for n in plan.nodes], plan.world_size, directory, job_id=job_id)
    # This process answers for the job until a supervisor takes over: if it dies while
    # preparing, readers mark the job failed instead of leaving it pending.
    registry.set_supervisor(job_id, os.getpid())
    secret_values = write_job_file(directory, plan, cluster, job)
    sync = for_plan(plan, lambda text: out.write(text + "\n"))
    handed_over = False  # the detached supervisor's session removes the marker
    try:
        try:
            # `dtrain stop` (SIGTERM) or a closed terminal (SIGHUP) while the setup commands run
            # stops the job like Ctrl-C does: recorded stopped, the commands' processes ended.
            with raising((signal.SIGTERM, signal.SIGHUP), Stopped):
                if sync is not None:
                    sync.write()
                prepare_nodes(plan, cluster, runners, sync, out=out)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                said = exc.reason if isinstance(exc, Stopped) else "interrupted"
                registry.finish(job_id, JobState.STOPPED, int(ExitStatus.INTERRUPTED), f"{said} while preparing")
            else:
                registry.finish(job_id, JobState.FAILED, 1, f"preparing the nodes failed: {exc}".splitlines()[0])
            raise
        if detach:
            pid = spawn(job_id, registry, secret_values)
            handed_over = True
            out.write(f"job {job_id} started in the background (supervisor pid {pid})\n"
                      f"  follow it: dtrain logs {job_id} -f    stop it: dtrain stop {job_id}\n")
            return None, pid
        out.write(f"[dtrain] job {job_id}: {len(plan.nodes)} node(s), world size {plan.world_size}\n")
        return supervise(job_id, out=out, registry=registry, runners=runners, plan=plan, replacer=replacer), None
    finally:
        if sync is not None and not handed_over:
            sync.remove()  # (the session removed it already once every node had looked)


def _report(job_id: str, plan: LaunchPlan, outcome, out: TextIO) -> Started:
    if outcome.state == "succeeded":
        out.write(outcome.summary(job_id) + "\n")
        return Started(job_id, plan, 0)
    if outcome.state == "stopped":
        out.write(outcome.summary(job_id) + "\n")
        return Started(job_id, plan, int(ExitStatus.INTERRUPTED))
    text = outcome.summary(job_id) if outcome.hang is None else f"job {job_id} failed: {outcome.hang.describe()}"
    raise JobFailed(text, f"full logs: dtrain logs {job_id}   (or {job_dir(job_id) / 'logs'})")
