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
from pathlib import Path

from pydantic import Field, field_validator

from dtrain.configio import StrictModel, load_config, validate
from dtrain.errors import ConfigError
from dtrain.jobs import secrets
from dtrain.launch.node import MARK
from dtrain.launch.plan import BatchJob, LaunchPlan
from dtrain.launch.spec import JobSpec, torchrun_target
from dtrain.paths import dtrain_home

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
                    nodes: int | None) -> SlurmCluster | None:
    """The Slurm request a `dtrain run` command line names, or None (an SSH/local run):
    a cluster.yaml with `scheduler: slurm`, or `--slurm-partition P [--nodes N]`; the
    flags override the file."""
    import sys

    import yaml

    data = None
    if cluster_file is not None and Path(cluster_file).is_file():
        loaded = yaml.safe_load(Path(cluster_file).read_text())
        data = loaded if isinstance(loaded, dict) and loaded.get("scheduler") == "slurm" else None
    if data is None and partition is None and nodes is None:
        return None
    if data is None and cluster_file is not None:
        raise ConfigError(f"{cluster_file} is not a Slurm cluster file",
                          "add `scheduler: slurm` to it, or drop --slurm-partition/--nodes")
    if hosts:
        raise ConfigError("--hosts names SSH nodes; a Slurm job gets its nodes from the allocation",
                          "drop --hosts (or drop the Slurm options)")
    flags = {k: v for k, v in (("partition", partition), ("nodes", nodes)) if v is not None}
    if data is None:  # the quick form: this interpreter's path on every node, like --hosts
        return validate(SlurmCluster, {"slurm": flags, "defaults": {"python": sys.executable}}, "--slurm-partition")
    base = load_config(SlurmCluster, cluster_file)
    return validate(SlurmCluster, {**base.model_dump(), "slurm": {**base.slurm.model_dump(), **flags}}, "--nodes")


def slurm_plan(job: JobSpec, cluster: SlurmCluster, job_id: str, *, head_cwd: str) -> LaunchPlan:
    """The frozen plan of a Slurm job: its batch script, which writes the job's output
    into the registry's job directory (`output.log`, as for every other backend)."""
    output = dtrain_home() / "jobs" / job_id / "output.log"  # planning creates nothing
    script = batch_script(job, cluster, job_id, workdir=cluster.defaults.workdir or head_cwd, output=str(output),
                          secret=secret_names(job, cluster))
    nodes = cluster.slurm.nodes
    return LaunchPlan(job_id=job_id, name=job.display_name(), rdzv="elastic", master_addr="", master_port=job.port,
                      nnodes=(nodes, nodes), hang_timeout=job.hang_timeout, grace=job.grace,
                      batch=BatchJob("slurm", script, nodes, nproc_per_node(job, cluster.slurm)))


def secret_names(job: JobSpec, cluster: SlurmCluster) -> frozenset[str]:
    """The env names kept out of the script: they reach the job through sbatch's environment."""
    return frozenset(job.secret_env) | frozenset(secrets.secret_names({**cluster.defaults.env, **job.env}))


def nproc_per_node(job: JobSpec, spec: SlurmSpec) -> int:
    return job.nproc_per_node or spec.gpus_per_node or 1


def header(spec: SlurmSpec, name: str, output: str) -> list[str]:
    if any(c.isspace() for c in output):
        raise ConfigError(f"the job directory {output!r} contains whitespace, which #SBATCH cannot carry",
                          "set DTRAIN_HOME to a path without spaces")
    opts = [f"--job-name={_job_name(name)}", f"--nodes={spec.nodes}", "--ntasks-per-node=1"]
    for key, value in (("partition", spec.partition), ("account", spec.account), ("qos", spec.qos),
                       ("time", spec.time), ("gpus-per-node", spec.gpus_per_node),
                       ("cpus-per-task", spec.cpus_per_task)):
        if value is not None:
            opts.append(f"--{key}={value}")
    opts += [f"--output={output}", *spec.extra]
    return [f"#SBATCH {o}" for o in opts]


def batch_script(job: JobSpec, cluster: SlurmCluster, job_id: str, *, workdir: str, output: str,
                 secret: frozenset[str] = frozenset()) -> str:
    """The exact script `sbatch` runs. `secret`: env names left out of it (they reach the
    job through sbatch's own environment, never written to disk)."""
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
                "--max-restarts", str(job.max_restarts), "--nproc-per-node", str(nproc_per_node(job, spec)),
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
    lines = ["#!/bin/bash", *header(spec, job.display_name(), output),
             f"# dtrain job {job_id}: one torchrun per node, c10d rendezvous on the allocation's first node",
             "set -euo pipefail",
             f"cd {shlex.quote(workdir)}",
             f"export DTRAIN_JOB_ID={job_id}",
             'export DTRAIN_NUM_NODES="$SLURM_JOB_NUM_NODES"',
             'export DTRAIN_NODE_ADDRS="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)"',
             'export DTRAIN_RDZV_HOST="${DTRAIN_NODE_ADDRS%%,*}"',
             "export PYTHONUNBUFFERED=1"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in secret]
    # The wrapper's status lines are for an SSH head; under Slurm they are dropped.
    lines += [f"srun --kill-on-bad-exit=1 --wait={SRUN_WAIT} --ntasks-per-node=1 --input=none "
              f"bash -c '{per_node}' \\\n  {shlex.join([python, *torchrun_target(job.command)])} "
              f"2>&1 | sed -u '/^{MARK.strip()} /d'"]
    return "\n".join(lines) + "\n"


def _agent(job: JobSpec, job_id: str, scratch: str) -> list[str]:
    """The monitor's node agent, started before `exec`: it becomes the node wrapper's
    child, so the wrapper's clean-up stops it with the job (the head collects from it)."""
    if not job.monitor:
        return []
    agent = ["nice", "-n", "10", '"$0"', "-m", "dtrain.monitor.agent", "--job", job_id, "--node", '"$node"',
             "--bind", '"$node"', "--port", str(job.monitor_port)]
    return [f'export DTRAIN_AGENT_ADDR=127.0.0.1:{job.monitor_port}',
            f'mkdir -p "{scratch}" && {_words(agent)} >"{scratch}/agent.log" 2>&1 &']


def _words(argv: list[str]) -> str:
    # every word here is dtrain's own: a job id, a number, a flag, or a "$var" expansion
    assert "'" not in "".join(argv)
    return " ".join(w if w.startswith('"') and w.endswith('"') else shlex.quote(w) for w in argv)


def _job_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64] or "dtrain"
