"""Slurm as the place a job runs: the typed request (`scheduler: slurm` in cluster.yaml,
or `dtrain run --slurm-partition P --nodes N`) and the exact batch script it becomes.

```yaml
scheduler: slurm
slurm:
  partition: gpu
  nodes: 2
  time: "02:00:00"
  gpus_per_node: 4
  account: vision        # optional, like qos and cpus_per_task
  extra: ["--exclusive"] # more #SBATCH options, one per item
defaults: {python: /shared/venv/bin/python, workdir: /shared/inspect}
```

Slurm allocates, queues and watches the nodes; dtrain writes one batch script (a pure
function of the JobSpec and this request, printed by `--dry-run`): `srun` starts one
node wrapper + torchrun per allocated node, c10d rendezvous on the allocation's first
node, the same env contract as the SSH launch. The job's directory (the registry's
`jobs/<id>/`, where the script writes `output.log`) and the workdir must be on storage
every node sees, as on any Slurm cluster.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator

from dtrain.configio import StrictModel, load_config, read_mapping, validate
from dtrain.errors import ConfigError
from dtrain.jobs import secrets
from dtrain.launch.node import MARK
from dtrain.launch.plan import BatchJob, LaunchPlan
from dtrain.launch.spec import JobSpec, torchrun_target
from dtrain.paths import dtrain_home

TRAINING_STEP = "[dtrain] training step on"
# srun --wait: once one task ended, the others get this long before Slurm ends the step
# (a task that exits 0 early must not leave its peers blocked in a collective forever).
SRUN_WAIT = 30
_TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$")
_WORD = re.compile(r"^[A-Za-z0-9_.,:=+/@%-]+$")  # partition, account, qos


class SlurmSpec(StrictModel):
    partition: str | None = None  # None: the cluster's default partition
    nodes: int = Field(1, ge=1)
    time: str | None = None  # Slurm's forms: MIN, HH:MM:SS, D-HH:MM:SS ...
    account: str | None = None
    qos: str | None = None
    gpus_per_node: int | None = Field(None, ge=0)
    cpus_per_task: int | None = Field(None, ge=1)
    extra: list[str] = []  # further #SBATCH options, e.g. "--exclusive", "--constraint=a100"
    # Slurm requeues the job when one of its nodes fails (sbatch --requeue); a job with
    # max_restarts also requeues itself when its training step fails, up to that many times.
    requeue: bool = False

    @field_validator("partition", "account", "qos")
    @classmethod
    def _word(cls, value: str | None) -> str | None:
        if value is not None and not _WORD.match(value):
            raise ValueError("must be one Slurm name (letters, digits, '_', '-', '.')")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not _TIME.match(value):
            raise ValueError("write a Slurm time limit: MINUTES, HH:MM:SS or D-HH:MM:SS")
        return value

    @field_validator("extra")
    @classmethod
    def _extra(cls, lines: list[str]) -> list[str]:
        for line in lines:
            if not line.startswith("-") or "\n" in line or "\r" in line:
                raise ValueError(f"extra option {line!r} must be one sbatch option such as '--exclusive'")
        return lines


@dataclass(frozen=True)
class SlurmFacts:
    """What the cluster's Slurm supports, read before planning (`sbatch --version`,
    `scontrol show config`). `version` None: not detected (a dry run away from the
    cluster); the script then uses the options of current Slurm."""

    version: tuple[int, int, int] | None = None
    accounting: bool = False  # sacct has a database to ask (AccountingStorageType)

    def since(self, major: int, minor: int) -> bool:
        return self.version is None or self.version[:2] >= (major, minor)

    def describe(self) -> str:
        if self.version is None:
            return "Slurm's version not detected here: options of Slurm >= 19.05"
        major, minor, patch = self.version
        return f"for Slurm {major}.{minor:02d}.{patch}"  # Slurm's own spelling: 22.05.8


def parse_version(text: str) -> tuple[int, int, int]:
    """`slurm 23.11.4` / `slurm-wlm 22.05.8` (what `sbatch --version` prints) -> (22, 5, 8)."""
    m = re.search(r"\b(\d+)\.(\d+)\.(\d+)", text)
    if m is None:
        raise ConfigError(f"cannot read a Slurm version from {text.strip()!r}",
                          "check that `sbatch --version` works on this machine")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


class SlurmDefaults(StrictModel):
    """What every allocated node uses (they are not known before the allocation)."""

    python: str = "python3"
    workdir: str | None = None  # None: the directory `dtrain run` was started in
    env: dict[str, str] = {}


class SlurmCluster(StrictModel):
    scheduler: str = "slurm"
    slurm: SlurmSpec = SlurmSpec()
    defaults: SlurmDefaults = SlurmDefaults()

    @field_validator("scheduler")
    @classmethod
    def _slurm(cls, value: str) -> str:
        if value != "slurm":
            raise ValueError("this file describes a Slurm cluster: scheduler: slurm")
        return value


def slurm_from_args(cluster_file: str | Path | None, hosts: str | None, partition: str | None,
                    nodes: int | None, requeue: bool = False) -> SlurmCluster | None:
    """The Slurm request a `dtrain run` command line names, or None (an SSH/local run):
    a cluster.yaml with `scheduler: slurm`, or `--slurm-partition P [--nodes N]`; the
    flags override the file."""
    import sys

    data = None
    if cluster_file is not None and Path(cluster_file).is_file():
        loaded = read_mapping(cluster_file)  # bad YAML is a ConfigError, as for every other config file
        data = loaded if isinstance(loaded, dict) and loaded.get("scheduler") == "slurm" else None
    if data is None and partition is None and nodes is None:
        if requeue:
            raise ConfigError("--requeue applies to a Slurm job", "add --slurm-partition P, or a Slurm cluster file")
        return None
    if data is None and cluster_file is not None:
        raise ConfigError(f"{cluster_file} is not a Slurm cluster file",
                          "add `scheduler: slurm` to it, or drop --slurm-partition/--nodes")
    if hosts:
        raise ConfigError("--hosts names SSH nodes; a Slurm job gets its nodes from the allocation",
                          "drop --hosts (or drop the Slurm options)")
    flags = {k: v for k, v in (("partition", partition), ("nodes", nodes), ("requeue", requeue or None))
             if v is not None}
    if data is None:  # the quick form: this interpreter's path on every node, like --hosts
        return validate(SlurmCluster, {"slurm": flags, "defaults": {"python": sys.executable}}, "--slurm-partition")
    base = load_config(SlurmCluster, cluster_file)
    return validate(SlurmCluster, {**base.model_dump(), "slurm": {**base.slurm.model_dump(), **flags}}, "--nodes")


def slurm_plan(job: JobSpec, cluster: SlurmCluster, job_id: str, *, head_cwd: str,
               facts: SlurmFacts = SlurmFacts(), preflight: bool = True) -> LaunchPlan:
    """The frozen plan of a Slurm job: its batch script, which writes the job's output
    into the registry's job directory (`output.log`, as for every other backend)."""
    output = dtrain_home() / "jobs" / job_id / "output.log"  # planning creates nothing
    script = batch_script(job, cluster, job_id, workdir=cluster.defaults.workdir or head_cwd, output=str(output),
                          secret=secret_names(job, cluster), facts=facts, preflight=preflight)
    nodes = cluster.slurm.nodes
    return LaunchPlan(job_id=job_id, name=job.display_name(), rdzv="elastic", master_addr="", master_port=job.port,
                      nnodes=(nodes, nodes), hang_timeout=job.hang_timeout, grace=job.grace,
                      batch=BatchJob("slurm", script, nodes, nproc_per_node(job, cluster.slurm)))


def secret_names(job: JobSpec, cluster: SlurmCluster) -> frozenset[str]:
    """The env names kept out of the script: they reach the job through sbatch's environment."""
    return frozenset(job.secret_env) | frozenset(secrets.secret_names({**cluster.defaults.env, **job.env}))


def nproc_per_node(job: JobSpec, spec: SlurmSpec) -> int:
    return job.nproc_per_node or spec.gpus_per_node or 1


def header(spec: SlurmSpec, name: str, output: str, *, requeue: bool = False,
           facts: SlurmFacts = SlurmFacts()) -> list[str]:
    if any(c.isspace() for c in output):
        raise ConfigError(f"the job directory {output!r} contains whitespace, which #SBATCH cannot carry",
                          "set DTRAIN_HOME to a path without spaces")
    opts = [f"--job-name={_job_name(name)}", f"--nodes={spec.nodes}", "--ntasks-per-node=1"]
    for key, value in (("partition", spec.partition), ("account", spec.account), ("qos", spec.qos),
                       ("time", spec.time), _gpus(spec.gpus_per_node, facts), ("cpus-per-task", spec.cpus_per_task)):
        if value is not None:
            opts.append(f"--{key}={value}")
    opts.append(f"--output={output}")
    if requeue:  # a requeued run appends to the first run's output instead of truncating it
        opts += ["--requeue", "--open-mode=append"]
    opts += spec.extra
    return [f"#SBATCH {o}" for o in opts]


def _gpus(count: int | None, facts: SlurmFacts) -> tuple[str, str | int | None]:
    """--gpus-per-node came with Slurm 19.05; before it, --gres=gpu:N."""
    if count is None or facts.since(19, 5):
        return "gpus-per-node", count
    return "gres", f"gpu:{count}"


def batch_script(job: JobSpec, cluster: SlurmCluster, job_id: str, *, workdir: str, output: str,
                 secret: frozenset[str] = frozenset(), facts: SlurmFacts = SlurmFacts(),
                 preflight: bool = True) -> str:
    """The exact script `sbatch` runs, with only the options `facts.version` supports;
    with `preflight`, a first step runs `dtrain check`'s per-node checks (slurm_check.py).
    `secret`: env names left out of it (they reach the job through sbatch's own
    environment, never written to disk)."""
    if job.nnodes is not None or job.tf_config:
        raise ConfigError("--nnodes and --tf-config do not apply to a Slurm job (it runs on every node of its "
                          "allocation)", "drop them; ask for the nodes with --nodes N or slurm.nodes")
    spec, python = cluster.slurm, cluster.defaults.python
    env = {**cluster.defaults.env, **job.env}
    scratch = f"/tmp/dtrain-{job_id}-$node"
    wrapper = ['"$0"', "-m", "dtrain.launch.node", "--job", job_id, "--node", '"$node"',
               "--master", '"$DTRAIN_RDZV_HOST"', "--scratch", f'"{scratch}"', "--grace", str(job.grace),
               "--watch-stdin", "no", "--"]
    torchrun = ['"$0"', "-m", "torch.distributed.run", "--nnodes", '"$DTRAIN_NUM_NODES"',
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f'"$DTRAIN_RDZV_HOST:{job.port}"',
                "--rdzv-id", job_id, "--rdzv-conf", '"is_host=$is_host"', "--local-addr", '"$node"',
                # restarts are Slurm's (a requeue: the whole allocation afresh), not torchrun's
                "--max-restarts", "0", "--nproc-per-node", str(nproc_per_node(job, spec)),
                "--tee", "3", "--log-dir", f'"{scratch}/torchrun"',
                "--log-line-prefix-template", '"[$node:r\\${rank}] "', '"$@"']
    # Runs on every node, where Slurm's per-node values ($SLURMD_NODENAME, $SLURM_NODEID)
    # are expanded. The user's words (interpreter, command) come after it as $0 and "$@",
    # quoted once, so the script itself holds no quoting of quoting.
    per_node = "\n".join([
        'node="$SLURMD_NODENAME"',
        f'export DTRAIN_NODE_RANK="$SLURM_NODEID" DTRAIN_HEARTBEAT_DIR="{scratch}/heartbeat"',
        'if [ "$SLURM_NODEID" = 0 ]; then is_host=true; else is_host=false; fi',
        *_agent(job, job_id, scratch),
        "exec " + _words(wrapper) + " \\\n  " + _words(torchrun),
    ])
    requeue = spec.requeue or job.max_restarts > 0
    lines = ["#!/bin/bash", *header(spec, job.display_name(), output, requeue=requeue, facts=facts),
             f"# dtrain job {job_id}: one torchrun per node, c10d rendezvous on the allocation's first node",
             f"# {facts.describe()}",
             "set -euo pipefail",
             f"cd {shlex.quote(workdir)}",
             f"export DTRAIN_JOB_ID={job_id}",
             'export DTRAIN_NUM_NODES="$SLURM_JOB_NUM_NODES"',
             'export DTRAIN_NODE_ADDRS="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)"',
             'export DTRAIN_RDZV_HOST="${DTRAIN_NODE_ADDRS%%,*}"',
             "export PYTHONUNBUFFERED=1"]
    if requeue:  # a requeued run continues from the last checkpoint (`dtrain train --resume`)
        lines.append('if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then export DTRAIN_AUTO_RESUME=1; fi')
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in secret]
    if preflight:
        lines.append(_preflight_step(job, spec, python))
    # The head starts collecting from the node agents once it reads this line (they start with the step).
    lines.append(f'echo "{TRAINING_STEP} $DTRAIN_NODE_ADDRS"')
    # The wrapper's status lines are for an SSH head; under Slurm they are dropped.
    step = (f"srun --kill-on-bad-exit=1 --wait={SRUN_WAIT} --ntasks-per-node=1 --input=none "
            f"bash -c '{per_node}' \\\n  {shlex.join([python, *torchrun_target(job.command)])} "
            f"2>&1 | sed -u '/^{MARK.strip()} /d'")
    if not job.max_restarts:
        return "\n".join([*lines, step]) + "\n"
    n = job.max_restarts
    lines += [step + " && exit 0 || status=$?",
              f'if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {n} ]; then',
              f'  echo "[dtrain] the training step failed (exit $status): requeueing the job '
              f'(restart $((${{SLURM_RESTART_COUNT:-0}} + 1)) of {n})"',
              '  scontrol requeue "$SLURM_JOB_ID"',
              "fi",
              'exit "$status"']
    return "\n".join(lines) + "\n"


def _preflight_step(job: JobSpec, spec: SlurmSpec, python: str) -> str:
    """One task per node: the node's checks, one line each in the log; a failing node
    ends the job before the training step starts."""
    check = ['"$0"', "-m", "dtrain.launch.slurm_check", "--node", '"$SLURMD_NODENAME"', "--node-rank",
             '"$SLURM_NODEID"', "--master", '"$DTRAIN_RDZV_HOST"', "--port", str(job.port)]
    if spec.gpus_per_node:
        check += ["--gpus", str(spec.gpus_per_node)]
    return (f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 --input=none bash -c 'exec {_words(check)}' "
            f"{shlex.quote(python)} \\\n  || {{ echo '[dtrain] preflight failed: the training step was not started'; exit 1; }}")


def _agent(job: JobSpec, job_id: str, scratch: str) -> list[str]:
    """The monitor's node agent, started before `exec`: it becomes the node wrapper's
    child, so the wrapper's clean-up stops it with the job (the head collects from it)."""
    if not job.monitor:
        return []
    agent = ["nice", "-n", "10", '"$0"', "-m", "dtrain.monitor.node.agent", "--job", job_id, "--node", '"$node"',
             "--bind", '"$node"', "--port", str(job.monitor_port)]
    return [f'export DTRAIN_AGENT_ADDR=127.0.0.1:{job.monitor_port}',
            f'mkdir -p "{scratch}" && {_words(agent)} >"{scratch}/agent.log" 2>&1 &']


def _words(argv: list[str]) -> str:
    # every word here is dtrain's own: a job id, a number, a flag, or a "$var" expansion
    assert "'" not in "".join(argv)
    return " ".join(w if w.startswith('"') and w.endswith('"') else shlex.quote(w) for w in argv)


def _job_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64] or "dtrain"
