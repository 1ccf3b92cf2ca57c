"""The Slurm backend's pure parts: the request's validation, the exact batch script,
Slurm's job states and the partition check (no Slurm needed)."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

from dtrain.errors import ConfigError
from dtrain.jobs.registry import JobState
from dtrain.launch.launcher import start
from dtrain.launch.plan import LaunchPlan
from dtrain.launch.slurm import SlurmCluster, SlurmFacts, SlurmSpec, batch_script, parse_version, slurm_from_args
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
# for Slurm 22.05.8
set -euo pipefail
cd '/shared/my job'
export DTRAIN_JOB_ID=J1
export DTRAIN_NUM_NODES="$SLURM_JOB_NUM_NODES"
export DTRAIN_NODE_ADDRS="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)"
export DTRAIN_RDZV_HOST="${DTRAIN_NODE_ADDRS%%,*}"
export PYTHONUNBUFFERED=1
export MODE='a b'
srun --kill-on-bad-exit=1 --ntasks-per-node=1 --input=none bash -c 'exec "$0" -m dtrain.launch.slurm_check --node "$SLURMD_NODENAME" --node-rank "$SLURM_NODEID" --master "$DTRAIN_RDZV_HOST" --port 29500 --gpus 4' /opt/venv/bin/python \
  || { echo '[dtrain] preflight failed: the training step was not started'; exit 1; }
echo "[dtrain] training step on $DTRAIN_NODE_ADDRS"
srun --kill-on-bad-exit=1 --wait=30 --ntasks-per-node=1 --input=none bash -c 'node="$SLURMD_NODENAME"
export DTRAIN_NODE_RANK="$SLURM_NODEID" DTRAIN_HEARTBEAT_DIR="/tmp/dtrain-J1-$node/heartbeat"
if [ "$SLURM_NODEID" = 0 ]; then is_host=true; else is_host=false; fi
export DTRAIN_AGENT_ADDR=127.0.0.1:9464
mkdir -p "/tmp/dtrain-J1-$node" && nice -n 10 "$0" -m dtrain.monitor.node.agent --job J1 --node "$node" --bind "$node" --port 9464 >"/tmp/dtrain-J1-$node/agent.log" 2>&1 &
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
                        output="/home/ana/.dtrain/jobs/J1/output.log", secret=frozenset({"HF_TOKEN"}),
                        facts=SlurmFacts((22, 5, 8)))
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
    assert "dtrain.monitor.node.agent" not in text and "DTRAIN_AGENT_ADDR" not in text


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
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: slurm\nslurm: {partition: gpu\n")  # a brace left open: a ConfigError, no traceback
    with pytest.raises(ConfigError, match="is not valid YAML"):
        slurm_from_args(bad, None, None, None)


def test_the_first_failing_node_is_read_from_sruns_report(tmp_path):
    log = tmp_path / "output.log"
    log.write_text("[h1:r0] step 1\nsrun: error: h2: task 1: Exited with exit code 1\n"
                   "srun: error: h1: task 0: Killed\n")
    assert first_task_error(log) == "h2 (Exited with exit code 1)"
    assert first_task_error(tmp_path / "missing.log") == ""


def test_a_node_whose_ranks_only_lost_their_peers_is_not_the_first_failure(tmp_path):
    """h2's rank was SIGKILLed (no traceback); h1's ranks then failed on gloo's lost peer and
    srun happened to report h1 first: the culprit is still h2."""
    peer = ("[h1:r{r}] [rank{r}]: Traceback (most recent call last):\n[h1:r{r}] [rank{r}]:   File \"x.py\"\n"
            "[h1:r{r}] [rank{r}]: RuntimeError: [pair.cc:561] Connection closed by peer [10.0.0.2]:36032.\n")
    log = tmp_path / "output.log"
    log.write_text("[h1:r0] epoch 0 step 2\n[h2:r2] epoch 0 step 2\n" + peer.format(r=0) + peer.format(r=1)
                   + "srun: error: h1: task 0: Exited with exit code 1\n"
                   + "srun: error: h2: task 1: Exited with exit code 1\n")
    assert first_task_error(log) == "h2 (Exited with exit code 1)"
    # a rank that raised its own error is no echo, even beside a local peer's lost connection
    own = "[h2:r3] [rank3]: Traceback (most recent call last):\n[h2:r3] [rank3]: ValueError: planned failure\n"
    log.write_text(peer.format(r=0) + own + "srun: error: h1: task 0: Exited with exit code 1\n"
                   "srun: error: h2: task 1: Exited with exit code 1\n")
    assert first_task_error(log) == "h2 (Exited with exit code 1)"
    # a node failed on its own: the nodes' addresses are not looked up
    looked: list[int] = []
    assert first_task_error(log, lambda: looked.append(1) or {}) == "h2 (Exited with exit code 1)" and not looked
    # every node an echo (or none printed anything): srun's order decides
    log.write_text(peer.format(r=0) + "srun: error: h1: task 0: Exited with exit code 1\n")
    assert first_task_error(log) == "h1 (Exited with exit code 1)"


def test_when_every_node_only_echoes_the_address_they_name_is_the_culprit(tmp_path):
    """Seen once under load (session 31): h2's rank 2 was SIGKILLed, its sibling rank 3 then lost it
    ("Connection reset by peer") as h1's ranks did, and srun reported h1 first. Both nodes show only
    echoes; gloo names the peer it lost, and every echo names h2's address."""
    tb = "[{n}:r{r}] [rank{r}]: Traceback (most recent call last):\n[{n}:r{r}] [rank{r}]: RuntimeError: {msg}\n"
    log = tmp_path / "output.log"
    log.write_text("[h2:r2] [W socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved.\n"
                   + tb.format(n="h2", r=3, msg="[pair.cc:545] Read error [10.0.0.2]:37582: Connection reset by peer.")
                   + tb.format(n="h1", r=0, msg="[pair.cc:561] Connection closed by peer [10.0.0.2]:44695.")
                   + tb.format(n="h1", r=1, msg="[pair.cc:561] Connection closed by peer [10.0.0.2]:44697.")
                   + "srun: error: h1: task 0: Exited with exit code 1\n"
                   + "srun: error: h2: task 1: Exited with exit code 1\n")
    assert first_task_error(log) == "h1 (Exited with exit code 1)"  # srun's order, without addresses
    assert first_task_error(log, {"h1": "10.0.0.1", "h2": "10.0.0.2"}) == "h2 (Exited with exit code 1)"
    # a lookup (scontrol, one call per node) instead of a table: the same answer
    assert first_task_error(log, lambda: {"h1": "10.0.0.1", "h2": "10.0.0.2"}) == "h2 (Exited with exit code 1)"
    # echoes that name several nodes, or an address of no node, leave srun's order
    log.write_text(log.read_text().replace("[10.0.0.2]:44697", "[10.0.0.1]:44697"))
    assert first_task_error(log, {"h1": "10.0.0.1", "h2": "10.0.0.2"}) == "h1 (Exited with exit code 1)"
    assert first_task_error(log, {"h1": "10.0.0.7", "h2": "10.0.0.8"}) == "h1 (Exited with exit code 1)"


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


def test_the_version_is_read_from_sbatch_and_only_its_options_are_used():
    assert parse_version("slurm-wlm 22.05.8\n") == (22, 5, 8)
    assert parse_version("slurm 23.11.4") == (23, 11, 4)
    with pytest.raises(ConfigError, match="cannot read a Slurm version"):
        parse_version("sbatch: fatal: Could not establish a configuration source")
    job = JobSpec(command=["python", "t.py"])
    old = batch_script(job, cluster(), "J1", workdir="/w", output="/o", facts=SlurmFacts((18, 8, 9)))
    assert "#SBATCH --gres=gpu:4\n" in old and "--gpus-per-node" not in old and "# for Slurm 18.08.9" in old
    assert "#SBATCH --gpus-per-node=4\n" in batch_script(job, cluster(), "J1", workdir="/w", output="/o")


def test_with_max_restarts_the_script_requeues_itself_and_a_requeued_run_resumes():
    job = JobSpec(command=["dtrain", "train", "c.yaml"], rdzv="elastic", max_restarts=2)
    text = batch_script(job, cluster(), "J1", workdir="/w", output="/o")
    assert "#SBATCH --requeue\n#SBATCH --open-mode=append\n" in text
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then export DTRAIN_AUTO_RESUME=1; fi' in text
    assert "--max-restarts 0" in text  # the restarts are Slurm's, not torchrun's
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -lt 2 ]; then' in text
    assert text.endswith('  scontrol requeue "$SLURM_JOB_ID"\nfi\nexit "$status"\n')
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    plain = batch_script(JobSpec(command=["python", "t.py"]), cluster(), "J1", workdir="/w", output="/o")
    assert "--requeue" not in plain and "SLURM_RESTART_COUNT" not in plain and "scontrol requeue" not in plain
    # --requeue alone: Slurm requeues on a node failure; a failed step still ends the job
    node_only = batch_script(JobSpec(command=["python", "t.py"]), cluster(requeue=True), "J1", workdir="/w",
                             output="/o")
    assert "#SBATCH --requeue" in node_only and "scontrol requeue" not in node_only


def test_without_preflight_the_script_has_one_step():
    text = batch_script(JobSpec(command=["python", "t.py"]), cluster(), "J1", workdir="/w", output="/o",
                        preflight=False)
    assert "slurm_check" not in text and text.count("srun ") == 1


def test_a_failed_preflight_is_the_reason_named_with_its_node(tmp_path):
    log = tmp_path / "output.log"
    log.write_text("[dtrain] preflight h1: ok (python 3.11.7, torch 2.4.0, 0 GPU(s), interface eth0)\n"
                   "[dtrain] preflight failed on h2: port: master port 29500 is already in use\n"
                   "srun: error: h2: task 1: Exited with exit code 1\n")
    assert first_task_error(log) == "h2 (preflight: port: master port 29500 is already in use)"


def test_the_readme_shows_the_script_the_dry_run_prints():
    import yaml

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Run on Slurm", 1)[1]
    yaml_block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    script = section.split("dtrain train recipe.yaml`\nprints", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    readme_cluster = SlurmCluster.model_validate(yaml.safe_load(yaml_block))
    assert script == batch_script(JobSpec(command=["dtrain", "train", "recipe.yaml"]), readme_cluster, "JOB",
                                  workdir=readme_cluster.defaults.workdir,
                                  output="/home/ana/.dtrain/jobs/JOB/output.log", facts=SlurmFacts((22, 5, 8)))
