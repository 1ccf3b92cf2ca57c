"""The process that drives one job on the head: registry states, signals, the session.

The foreground `dtrain run` is the supervisor of its job; `dtrain run --detach` hands
the same work to `python -m dtrain.launch.supervisor JOB_ID` in a new session. Either
way its pid is in the registry, `dtrain stop` sends it SIGTERM, and a reader that finds
it gone marks the job failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from dtrain.cluster.runner import close_job_runners, job_runners
from dtrain.jobs import secrets
from dtrain.jobs.registry import JobRegistry, JobState
from dtrain.launch.plan import LaunchPlan
from dtrain.launch.session import JobSession, Outcome
from dtrain.paths import job_dir, open_private, write_text_atomic
from dtrain.signals import STOP_REASONS

JOB_FILE = "job.json"


def write_job_file(directory: Path, plan: LaunchPlan, cluster, job, *, extra: dict | None = None) -> dict[str, str]:
    """Write job.json without its secret values; returns them (see dtrain.jobs.secrets).
    `extra`: what the backend learnt once it executed the plan (Slurm's job id)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    data, values = secrets.split(
        {"plan": plan.to_json(), "cluster": cluster.model_dump(), "job": job.model_dump(), **(extra or {})},
        job.secret_env,
    )
    write_text_atomic(directory / JOB_FILE, json.dumps(data, indent=2))
    return values


def read_job_file(directory: Path, values: dict[str, str] | None = None):
    from dtrain.cluster.spec import ClusterSpec
    from dtrain.launch.slurm import SlurmCluster
    from dtrain.launch.spec import JobSpec

    data = secrets.join(json.loads((directory / JOB_FILE).read_text()), values or {})
    plan = LaunchPlan.from_json(data["plan"])
    cluster = (SlurmCluster if plan.batch is not None else ClusterSpec).model_validate(data["cluster"])
    return plan, cluster, JobSpec.model_validate(data["job"])


@contextmanager
def _signals_stop(session: JobSession):
    """SIGTERM/SIGHUP (`dtrain stop`, a closed terminal) and Ctrl-C stop the whole job."""
    old = {sig: signal.signal(sig, lambda s, f: session.stop(STOP_REASONS[signal.Signals(s)])) for sig in STOP_REASONS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def supervise(job_id: str, *, out: TextIO, registry: JobRegistry | None = None,
              runners: dict | None = None, plan: LaunchPlan | None = None,
              secret_values: dict[str, str] | None = None, replacer=None,
              stop_asked: list[str] | None = None) -> Outcome:
    """Drive the job to its end. `runners` and `plan` come from the foreground `dtrain
    run` (which owns the runners' shared connections); a detached supervisor reads the
    job file (its secret values come in `secret_values`) and opens - and closes - its own.
    `stop_asked`: the reasons of stop signals received before the session's handlers took over."""
    registry = registry or JobRegistry()
    directory = job_dir(job_id)
    if runners is not None and plan is not None:
        return _supervise(job_id, plan, runners, directory, out=out, registry=registry, replacer=replacer)
    plan, cluster, _ = read_job_file(directory, secret_values)
    runners = job_runners(cluster, job_id)
    try:
        return _supervise(job_id, plan, runners, directory, out=out, registry=registry, stop_asked=stop_asked)
    finally:
        close_job_runners(runners)


def _supervise(job_id: str, plan: LaunchPlan, runners: dict, directory: Path, *, out: TextIO,
               registry: JobRegistry, replacer=None, stop_asked: list[str] | None = None) -> Outcome:
    registry.set_supervisor(job_id, os.getpid())
    registry.mark_running(job_id)
    session = JobSession(plan, runners, directory, out=out, replacer=replacer)
    outcome: Outcome | None = None
    try:
        with _signals_stop(session):
            if stop_asked:  # `dtrain stop` right after `--detach`: no node is started
                session.stop(stop_asked[0])
            outcome = session.run()
    finally:
        if outcome is None:
            registry.finish(job_id, JobState.FAILED, 1, "supervisor error")
    summary = outcome.summary(job_id)
    if outcome.hang is not None:
        summary = f"job {job_id} failed: {outcome.hang.describe()}"
    with open_private(directory / "output.log", "a") as log:
        log.write(summary + "\n")
    registry.finish(job_id, JobState(outcome.state), outcome.exit_code, summary.splitlines()[0])
    return outcome


def spawn(job_id: str, registry: JobRegistry, secret_values: dict[str, str], *, record: bool = True) -> int:
    """Start the detached supervisor of `job_id`; returns its pid (also recorded, unless
    `record` is off: a scheduler's job lives on without it). The secret values the job
    file lacks go down a pipe, never into a file or argv."""
    directory = job_dir(job_id)
    with open_private(directory / "supervisor.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dtrain.launch.supervisor", job_id],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, close_fds=True,
        )
    secrets.send(secret_values, proc.stdin)
    if record:
        registry.set_supervisor(job_id, proc.pid)
    return proc.pid


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dtrain.launch.supervisor JOB_ID", file=sys.stderr)
        return 2
    # From here a stop signal is noted, not fatal: the session acts on it once it is set up,
    # and the job ends "stopped" rather than "supervisor died".
    stop_asked: list[str] = []
    for sig, reason in STOP_REASONS.items():
        signal.signal(sig, lambda s, f, reason=reason: stop_asked.append(reason))
    values = secrets.receive(sys.stdin)
    plan, _, job = read_job_file(job_dir(args[0]), values)
    with open(os.devnull, "w") as devnull:
        if plan.batch is not None:  # Slurm runs the job; this process follows it for the metrics
            from dtrain.launch.slurm_job import watch

            return watch(args[0], job, out=devnull)
        outcome = supervise(args[0], out=devnull, secret_values=values, stop_asked=stop_asked)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
