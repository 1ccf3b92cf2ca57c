"""Issue 14 on a real Slurm cluster (tests/slurm.py): slurmctld on the head, one slurmd
per namespace host, every host seeing this repository and virtualenv at the same paths."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from pathlib import Path

import pytest
import torch

from dtrain.monitor.store import Store

from launch_helpers import REPO, SCRIPTS, dtrain, job_id_of, wait_gone
from test_launch_netns import _recipe_sets, assert_nothing_left, kill_workers

pytestmark = [pytest.mark.netns, pytest.mark.slow]
PLAIN = str(SCRIPTS / "plain_ddp.py")


def cluster_file(slurm_cluster, tmp_path, *, nodes: int = 2, extra: str = "") -> str:
    path = tmp_path / "slurm.yaml"
    path.write_text(
        "scheduler: slurm\n"
        f"slurm: {{partition: {slurm_cluster.partition}, nodes: {nodes}, time: '5:00'{extra}}}\n"
        f"defaults: {{python: {sys.executable}, workdir: {REPO}}}\n"
    )
    return str(path)


def status(slurm_cluster, job_id: str) -> dict:
    res = dtrain("status", job_id, "--json", env=slurm_cluster.env())
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_plain_torchrun_script_on_a_two_node_allocation(slurm_cluster, dtrain_home, tmp_path):
    res = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "2", "--",
                 "python", PLAIN, "--epochs", "1", env=slurm_cluster.env(), timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for prefix in ("[h1:r0]", "[h1:r1]", "[h2:r2]", "[h2:r3]"):
        assert prefix in out, out
    assert "[h1:r0] done world=4" in out, out
    assert "@@dtrain@@" not in out
    job_id = job_id_of(out)
    rec = status(slurm_cluster, job_id)
    assert rec["state"] == "succeeded" and rec["world_size"] == 4 and rec["nodes"] == ["h1", "h2"], rec
    assert rec["extra"]["slurm_job_id"].isdigit()
    # one launch path: job.json holds the plan (its batch script is what sbatch ran) and Slurm's id
    saved = json.loads((dtrain_home / "jobs" / job_id / "job.json").read_text())
    assert set(saved) == {"plan", "cluster", "job", "slurm_job_id"}, saved.keys()
    assert saved["slurm_job_id"] == rec["extra"]["slurm_job_id"]
    assert saved["plan"]["batch"]["script"] == (dtrain_home / "jobs" / job_id / "job.sbatch").read_text()
    assert not wait_gone(job_id)
    # the node agents ran beside the ranks and the head collected them: dtrain report works
    store = Store.for_job(dtrain_home / "jobs" / job_id, readonly=True)
    nodes = store.node_series()
    store.close()
    assert set(nodes) == {"h1", "h2"} and all(len(s["t"]) >= 1 for s in nodes.values()), nodes
    rep = dtrain("report", job_id, "--out", str(tmp_path / "report"), env=slurm_cluster.env(), timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["totals"]["nodes"] == 2


def test_the_defect_recipe_runs_unchanged_on_a_two_node_allocation(slurm_cluster, dtrain_home, synth_data, tmp_path):
    out = tmp_path / "run"
    res = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "2", "--",
                 "dtrain", "train", *_recipe_sets(synth_data, out), env=slurm_cluster.env(), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[h2:r3]" in res.stdout and "[h1:r0]" in res.stdout, res.stdout
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert state["model"], state.keys()
    assert status(slurm_cluster, job_id_of(res.stdout))["state"] == "succeeded"


def test_stop_cancels_a_queued_and_a_running_job(slurm_cluster, dtrain_home, tmp_path):
    queued = dtrain("run", cluster_file(slurm_cluster, tmp_path, extra=", extra: ['--begin=now+1hour']"),
                    "--detach", "--", "python", PLAIN, env=slurm_cluster.env(), timeout=60)
    assert queued.returncode == 0, queued.stdout + queued.stderr
    running = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "1", "--detach", "--",
                     "python", PLAIN, "--epochs", "100", "--sleep", "0.2", env=slurm_cluster.env(), timeout=60)
    assert running.returncode == 0, running.stdout + running.stderr
    queued_id, running_id = job_id_of(queued.stdout), job_id_of(running.stdout)
    assert status(slurm_cluster, queued_id)["state"] == "pending"
    deadline = time.monotonic() + 90
    while "epoch 0" not in (log := dtrain("logs", running_id, env=slurm_cluster.env()).stdout):
        assert time.monotonic() < deadline, log
        time.sleep(1)
    assert status(slurm_cluster, running_id)["state"] == "running"
    for job_id in (queued_id, running_id):
        res = dtrain("stop", job_id, env=slurm_cluster.env(), timeout=90)
        assert res.returncode == 0, res.stdout + res.stderr
        rec = status(slurm_cluster, job_id)
        assert rec["state"] == "stopped", rec
        slurm_id = rec["extra"]["slurm_job_id"]
        shown = slurm_cluster.cmd("scontrol", "show", "job", "-o", slurm_id).stdout
        assert "JobState=CANCELLED" in shown, shown
    assert not wait_gone(running_id)


def test_a_request_the_partition_cannot_satisfy_is_refused_before_submission(slurm_cluster, dtrain_home,
                                                                              tmp_path):
    res = dtrain("run", "--slurm-partition", "debgu", "--nodes", "2", "--", "python", PLAIN,
                 env=slurm_cluster.env(), timeout=60)
    assert res.returncode != 0
    assert "no partition 'debgu'" in res.stderr and "did you mean 'debug'" in res.stderr, res.stderr
    too_many = dtrain("run", "--slurm-partition", "debug", "--nodes", "9", "--", "python", PLAIN,
                      env=slurm_cluster.env(), timeout=60)
    assert too_many.returncode != 0 and "has 3 node(s), the job asks for 9" in too_many.stderr, too_many.stderr
    gpus = dtrain("run", cluster_file(slurm_cluster, tmp_path, extra=", gpus_per_node: 1"), "--", "python", PLAIN,
                  env=slurm_cluster.env(), timeout=60)
    assert gpus.returncode != 0 and "has 0 GPU(s) in all" in gpus.stderr, gpus.stderr
    assert dtrain("jobs", "--json", env=slurm_cluster.env()).stdout.strip() == "[]"


def test_a_failing_task_fails_the_job_and_names_its_node(slurm_cluster, dtrain_home, tmp_path):
    t0 = time.monotonic()
    res = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "2", "--", "python", PLAIN,
                 "--epochs", "50", "--sleep", "0.1", "--fail-rank", "3", "--fail-step", "3",
                 env=slurm_cluster.env(), timeout=150)
    assert res.returncode == 5, res.stdout + res.stderr  # ExitStatus.JOB_FAILED
    assert "planned failure on rank 3" in res.stdout
    job_id = job_id_of(res.stdout)
    rec = status(slurm_cluster, job_id)
    assert rec["state"] == "failed" and "first failure on h2" in rec["reason"], rec
    assert "failed" in res.stderr and "h2" in res.stderr, res.stderr
    shown = slurm_cluster.cmd("scontrol", "show", "job", "-o", rec["extra"]["slurm_job_id"]).stdout
    assert "JobState=FAILED" in shown, shown
    assert time.monotonic() - t0 < 120
    assert not wait_gone(job_id)


def test_killing_a_task_on_one_node_ends_the_job_within_30_s(slurm_cluster, dtrain_home, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", cluster_file(slurm_cluster, tmp_path),
                             "--nproc-per-node", "2", "--", "python", PLAIN, "--epochs", "100", "--sleep", "0.2"],
                            cwd=REPO, env=slurm_cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:  # until training runs on every rank
        lines.append(line)
        if "epoch 0 step 2" in line:
            break
    assert kill_workers(slurm_cluster.netns, "h2", "plain_ddp.py"), "".join(lines)
    t0 = time.monotonic()
    rest, err = proc.communicate(timeout=90)
    assert proc.returncode == 5 and time.monotonic() - t0 < 30, (proc.returncode, "".join(lines) + rest, err)
    job_id = job_id_of("".join(lines))
    rec = status(slurm_cluster, job_id)
    assert rec["state"] == "failed" and "first failure on h2" in rec["reason"], rec
    shown = slurm_cluster.cmd("scontrol", "show", "job", "-o", rec["extra"]["slurm_job_id"]).stdout
    assert "JobState=FAILED" in shown, shown
    assert_nothing_left(slurm_cluster.netns, job_id)


def test_a_job_past_its_time_limit_is_reported_as_timed_out(slurm_cluster, dtrain_home, tmp_path):
    path = cluster_file(slurm_cluster, tmp_path)
    Path(path).write_text(Path(path).read_text().replace("time: '5:00'", "time: '1'"))  # one minute
    res = dtrain("run", path, "--nproc-per-node", "1", "--", "python", PLAIN, "--epochs", "1000", "--sleep", "0.2",
                 env=slurm_cluster.env(), timeout=170)
    assert res.returncode == 5, res.stdout + res.stderr
    rec = status(slurm_cluster, job_id_of(res.stdout))
    assert rec["state"] == "failed" and rec["reason"].startswith("timed out"), rec
    assert "timed out" in res.stderr
    assert not wait_gone(rec["id"])


def test_ctrl_c_on_a_followed_job_cancels_it_in_slurm(slurm_cluster, dtrain_home, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "run", cluster_file(slurm_cluster, tmp_path),
                             "--nproc-per-node", "1", "--", "python", PLAIN, "--epochs", "100", "--sleep", "0.2"],
                            cwd=REPO, env=slurm_cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "epoch 0 step 1" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, ("".join(lines) + rest, err)
    rec = status(slurm_cluster, job_id_of("".join(lines)))
    assert rec["state"] == "stopped", rec
    assert "JobState=CANCELLED" in slurm_cluster.cmd("scontrol", "show", "job", "-o", rec["extra"]["slurm_job_id"]).stdout
    assert not wait_gone(rec["id"])
