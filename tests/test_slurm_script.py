"""The Slurm backend's pure parts: the request's validation, the exact batch script,
Slurm's job states and the partition check (no Slurm needed)."""

from __future__ import annotations

import io
import json
import subprocess

import pytest

from dtrain.errors import ConfigError
from dtrain.jobs.registry import JobState
from dtrain.launch.launcher import start
from dtrain.launch.plan import LaunchPlan
from dtrain.launch.slurm import SlurmCluster, SlurmSpec, batch_script, slurm_from_args
from dtrain.launch.slurm_job import check_request, first_task_error, minutes, parse_job
from dtrain.launch.spec import JobSpec

EXPECTED = r"""#!/bin/bash
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --partition=gpu
#SBATCH --account=vision
#SBATCH --time=1-00:00:00
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --output=/home/ana/.dtrain/jobs/J1/output.log
#SBATCH --exclusive
# dtrain job J1: one torchrun per node, c10d rendezvous on the allocation's first node
set -euo pipefail
cd '/shared/my job'
export DTRAIN_JOB_ID=J1
export DTRAIN_NUM_NODES="$SLURM_JOB_NUM_NODES"
export DTRAIN_NODE_ADDRS="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)"
export DTRAIN_RDZV_HOST="${DTRAIN_NODE_ADDRS%%,*}"
export PYTHONUNBUFFERED=1
export MODE='a b'
srun --kill-on-bad-exit=1 --wait=30 --ntasks-per-node=1 --input=none bash -c 'node="$SLURMD_NODENAME"
export DTRAIN_NODE_RANK="$SLURM_NODEID" DTRAIN_HEARTBEAT_DIR="/tmp/dtrain-J1-$node/heartbeat"
if [ "$SLURM_NODEID" = 0 ]; then is_host=true; else is_host=false; fi
export DTRAIN_AGENT_ADDR=127.0.0.1:9464
mkdir -p "/tmp/dtrain-J1-$node" && nice -n 10 "$0" -m dtrain.monitor.agent --job J1 --node "$node" --bind "$node" --port 9464 >"/tmp/dtrain-J1-$node/agent.log" 2>&1 &
exec "$0" -m dtrain.launch.node --job J1 --node "$node" --master "$DTRAIN_RDZV_HOST" --scratch "/tmp/dtrain-J1-$node" --grace 5.0 --watch-stdin no -- \
  "$0" -m torch.distributed.run --nnodes "$DTRAIN_NUM_NODES" --rdzv-backend c10d --rdzv-endpoint "$DTRAIN_RDZV_HOST:29500" --rdzv-id J1 --rdzv-conf "is_host=$is_host" --local-addr "$node" --max-restarts 0 --nproc-per-node 4 --tee 3 --log-dir "/tmp/dtrain-J1-$node/torchrun" --log-line-prefix-template "[$node:r\${rank}] " "$@"' \
  /opt/venv/bin/python train.py --note 'it'"'"'s' 2>&1 | sed -u '/^@@dtrain@@ /d'
"""


def cluster(**slurm) -> SlurmCluster:
    return SlurmCluster.model_validate({
        "slurm": {"partition": "gpu", "nodes": 2, "time": "1-00:00:00", "account": "vision", "gpus_per_node": 4,
                  "cpus_per_task": 8, "extra": ["--exclusive"], **slurm},
        "defaults": {"python": "/opt/venv/bin/python", "workdir": "/shared/my job", "env": {"MODE": "a b"}},
    })


def test_the_batch_script_is_exactly_this():
    job = JobSpec(command=["python", "train.py", "--note", "it's"], env={"HF_TOKEN": "s3cret"})
    text = batch_script(job, cluster(), "J1", workdir="/shared/my job",
                        output="/home/ana/.dtrain/jobs/J1/output.log", secret=frozenset({"HF_TOKEN"}))
    assert text == EXPECTED
    assert "s3cret" not in text  # secret values travel in sbatch's environment, not the file
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


@pytest.mark.parametrize("field", [{"rdzv": "elastic", "nnodes": "1:2"}, {"tf_config": True}])
def test_options_that_do_not_apply_to_an_allocation_are_refused(field):
    with pytest.raises(ConfigError, match="do not apply to a Slurm job"):
        batch_script(JobSpec(command=["python", "t.py"], **field), cluster(), "J1", workdir="/w", output="/o")


def test_without_monitoring_no_agent_starts():
    job = JobSpec(command=["python", "train.py"], monitor=False)
    text = batch_script(job, cluster(), "J1", workdir="/w", output="/o/output.log")
    assert "dtrain.monitor.agent" not in text and "DTRAIN_AGENT_ADDR" not in text


@pytest.mark.parametrize("field, value", [
    ("time", "two hours"), ("partition", "gpu --qos=x"), ("extra", ["exclusive"]), ("extra", ["--a\n#SBATCH --b"]),
    ("nodes", 0),
])
def test_a_bad_request_is_refused_when_read(field, value):
    with pytest.raises(ValueError):
        SlurmSpec.model_validate({field: value})


def test_slurm_states_map_to_dtrain_states():
    timeout = parse_job("JobId=7 JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15 NodeList=h[1-2]")
    assert timeout.dtrain_state == JobState.FAILED and timeout.describe().startswith("timed out")
    assert timeout.exit_code == 143 and timeout.nodes == ["h[1-2]"]
    assert parse_job("JobState=CANCELLED+ Reason=None ExitCode=0:0").dtrain_state == JobState.STOPPED
    assert parse_job("JobState=PENDING Reason=BeginTime NodeList=(null)").dtrain_state == JobState.PENDING
    assert parse_job("JobState=COMPLETED ExitCode=0:0").dtrain_state == JobState.SUCCEEDED
    assert parse_job("JobState=NODE_FAIL ExitCode=0:0").dtrain_state == JobState.FAILED


def test_the_partition_is_checked_before_submission():
    parts = {"debug": {"TotalNodes": "3"}, "gpu-a100": {"TotalNodes": "8"}}
    with pytest.raises(ConfigError, match="did you mean 'gpu-a100'"):
        check_request(SlurmSpec(partition="gpu-a10", nodes=1), parts)
    with pytest.raises(ConfigError, match="has 3 node"):
        check_request(SlurmSpec(partition="debug", nodes=4), parts)
    check_request(SlurmSpec(partition="debug", nodes=3), parts)


def test_gpus_and_time_limits_are_checked_before_submission():
    parts = {"gpu": {"TotalNodes": "2", "TRES": "cpu=64,mem=500G,node=2,billing=64,gres/gpu=8", "MaxTime": "1-00:00:00"},
             "cpu": {"TotalNodes": "4", "TRES": "cpu=64,node=4", "MaxTime": "UNLIMITED"}}
    check_request(SlurmSpec(partition="gpu", nodes=2, gpus_per_node=4, time="24:00:00"), parts)
    with pytest.raises(ConfigError, match="has 8 GPU"):
        check_request(SlurmSpec(partition="gpu", nodes=2, gpus_per_node=8), parts)
    with pytest.raises(ConfigError, match="has 0 GPU"):
        check_request(SlurmSpec(partition="cpu", nodes=1, gpus_per_node=1), parts)
    with pytest.raises(ConfigError, match="at most 1-00:00:00"):
        check_request(SlurmSpec(partition="gpu", nodes=1, time="1-00:01"), parts)
    check_request(SlurmSpec(partition="cpu", nodes=1, time="30-00:00:00"), parts)
    assert [minutes(t) for t in ("90", "1:30", "01:30:00", "2-0", "1-01:01", "INFINITE")] == [90, 1.5, 90, 2880, 1501, None]


def test_flags_and_files_choose_slurm(tmp_path):
    assert slurm_from_args(None, None, None, None) is None
    ssh_file = tmp_path / "c.yaml"
    ssh_file.write_text("nodes: [gpu1]\n")
    assert slurm_from_args(ssh_file, None, None, None) is None
    with pytest.raises(ConfigError, match="not a Slurm cluster file"):
        slurm_from_args(ssh_file, None, "debug", None)
    slurm_file = tmp_path / "s.yaml"
    slurm_file.write_text("scheduler: slurm\nslurm: {partition: gpu, nodes: 4}\n")
    assert slurm_from_args(slurm_file, None, None, 2).slurm.model_dump()["nodes"] == 2
    assert slurm_from_args(None, None, "debug", None).slurm.nodes == 1
    with pytest.raises(ConfigError, match="--hosts"):
        slurm_from_args(None, "gpu1", "debug", None)


def test_the_first_failing_node_is_read_from_sruns_report(tmp_path):
    log = tmp_path / "output.log"
    log.write_text("[h1:r0] step 1\nsrun: error: h2: task 1: Exited with exit code 1\n"
                   "srun: error: h1: task 0: Killed\n")
    assert first_task_error(log) == "h2 (Exited with exit code 1)"
    assert first_task_error(tmp_path / "missing.log") == ""


def test_the_dry_run_prints_the_plans_batch_script_and_the_plan_round_trips(dtrain_home):
    out = io.StringIO()
    job = JobSpec(command=["python", "train.py"])
    started = start(job, cluster(), out=out, dry_run=True, head_cwd="/w")
    plan = started.plan
    assert out.getvalue() == plan.batch.script == batch_script(
        job, cluster(), started.job_id, workdir="/shared/my job",
        output=str(dtrain_home / "jobs" / started.job_id / "output.log"))
    assert plan.world_size == 8 and plan.nodes == [] and plan.batch.scheduler == "slurm"
    assert LaunchPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert not (dtrain_home / "jobs" / started.job_id).exists()  # a dry run creates nothing
