"""Issue 14 on a real Slurm cluster (tests/slurm.py): slurmctld on the head, one slurmd
per namespace host, every host seeing this repository and virtualenv at the same paths."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import subprocess
import sys
import time

from pathlib import Path

import pytest
import torch

from dtrain.launch.slurm import parse_version
from dtrain.launch.slurm_job import SlurmClient
from dtrain.monitor.head.metrics_db import MetricsDB

from launch_helpers import REPO, SCRIPTS, dtrain, free_port, job_id_of, job_processes, wait_gone
from test_launch_netns import _recipe_sets, assert_nothing_left, kill_workers

pytestmark = [pytest.mark.netns, pytest.mark.slow]
PLAIN = str(SCRIPTS / "plain_ddp.py")


# What a job leaves on a host while it runs: a test that fails before it stops its job must
# not leave these to the next test (a torchrun kept port 29500 and failed the 5 tests after it).
JOB_PROCESSES = ("torch.distributed.run", "dtrain.launch.node", "dtrain.monitor.node.agent", "plain_ddp.py")


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(slurm_cluster):
    yield
    slurm_cluster.cmd("scancel", "--user", getpass.getuser())
    deadline = time.monotonic() + 30
    while True:
        left = [(pid, cmd) for h in slurm_cluster.netns.hosts for pid, cmd in slurm_cluster.netns.processes(h)
                if any(p in cmd for p in JOB_PROCESSES)]
        if not left and not slurm_cluster.cmd("squeue", "--noheader").stdout.strip():  # nor a job completing
            return
        if time.monotonic() > deadline:  # Slurm did not end them: end them here
            for pid, _ in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.5)


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


def assert_report_shows_both_nodes(slurm_cluster, dtrain_home, job_id: str, tmp_path, *, samples: int) -> None:
    """The head collected both nodes' agents (at least `samples` each) and `dtrain report` shows them."""
    store = MetricsDB.for_job(dtrain_home / "jobs" / job_id, readonly=True)
    nodes = store.node_series()
    store.close()
    assert set(nodes) == {"h1", "h2"} and all(len(s["t"]) >= samples for s in nodes.values()), nodes
    rep = dtrain("report", job_id, "--out", str(tmp_path / "report"), env=slurm_cluster.env(), timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["totals"]["nodes"] == 2


def test_plain_torchrun_script_on_a_two_node_allocation(slurm_cluster, dtrain_home, tmp_path):
    res = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "2", "--",
                 "python", PLAIN, "--epochs", "1", env=slurm_cluster.env(), timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for prefix in ("[h1:r0]", "[h1:r1]", "[h2:r2]", "[h2:r3]"):
        assert prefix in out, out
    assert "[h1:r0] done world=4" in out, out
    assert "@@dtrain@@" not in out
    assert "[dtrain] preflight h1: ok (python " in out and "[dtrain] preflight h2: ok (python " in out, out
    # not at the start (the collector waits for the agents' step, after the preflight's), nor
    # at the end (each agent ends with its node's ranks, before Slurm says the job ended)
    assert "stopped reporting" not in out
    job_id = job_id_of(out)
    rec = status(slurm_cluster, job_id)
    assert rec["state"] == "succeeded" and rec["world_size"] == 4 and rec["nodes"] == ["h1", "h2"], rec
    assert rec["extra"]["slurm_job_id"].isdigit()
    # one launch path: job.json holds the plan (its batch script is what sbatch ran) and Slurm's id
    saved = json.loads((dtrain_home / "jobs" / job_id / "job.json").read_text())
    assert set(saved) == {"plan", "cluster", "job", "slurm_job_id"}, saved.keys()
    assert saved["slurm_job_id"] == rec["extra"]["slurm_job_id"]
    assert saved["plan"]["batch"]["script"] == (dtrain_home / "jobs" / job_id / "job.sbatch").read_text()
    assert "\n# for Slurm " in saved["plan"]["batch"]["script"]  # the detected version
    assert not wait_gone(job_id)
    # the node agents ran beside the ranks and the head collected them: dtrain report works
    assert_report_shows_both_nodes(slurm_cluster, dtrain_home, job_id, tmp_path, samples=1)


def test_the_defect_recipe_runs_unchanged_on_a_two_node_allocation(slurm_cluster, dtrain_home, synth_data, tmp_path):
    out = tmp_path / "run"
    res = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "2", "--",
                 "dtrain", "train", *_recipe_sets(synth_data, out), env=slurm_cluster.env(), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[h2:r3]" in res.stdout and "[h1:r0]" in res.stdout, res.stdout
    assert "stopped reporting" not in res.stdout, res.stdout
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert state["model"], state.keys()
    assert status(slurm_cluster, job_id_of(res.stdout))["state"] == "succeeded"


def test_a_script_and_an_argument_in_bytes_that_are_not_utf8_reach_every_node(slurm_cluster, dtrain_home, tmp_path):
    """The batch script was written as UTF-8 text, which refused them: the job never started."""
    folder = os.fsencode(tmp_path)
    with open(folder + b"/d\xe9faut.py", "w") as fh:
        fh.write("import os, sys\nprint('arg', os.fsencode(sys.argv[1]).hex(), flush=True)\n")
    res = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "1", "--", "python",
                 os.fsdecode(folder + b"/d\xe9faut.py"), os.fsdecode(b"lot\xff"), env=slurm_cluster.env(), timeout=150,
                 errors="surrogateescape")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[h1:r0] arg 6c6f74ff" in res.stdout and "[h2:r1] arg 6c6f74ff" in res.stdout, res.stdout
    script = (dtrain_home / "jobs" / job_id_of(res.stdout) / "job.sbatch").read_bytes()
    assert b"d\xe9faut.py" in script and b"lot\xff" in script


def test_stop_cancels_a_queued_and_a_running_job(slurm_cluster, dtrain_home, tmp_path):
    queued = dtrain("run", cluster_file(slurm_cluster, tmp_path, extra=", extra: ['--begin=now+1hour']"),
                    "--detach", "--", "python", PLAIN, env=slurm_cluster.env(), timeout=60)
    assert queued.returncode == 0, queued.stdout + queued.stderr
    running = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "1", "--detach", "--",
                     "python", PLAIN, "--epochs", "100", "--sleep", "0.2", env=slurm_cluster.env(), timeout=60)
    assert running.returncode == 0, running.stdout + running.stderr
    queued_id, running_id = job_id_of(queued.stdout), job_id_of(running.stdout)
    assert status(slurm_cluster, queued_id)["state"] == "pending"
    deadline = time.monotonic() + 180  # a hang guard: under a loaded suite the step took over 90 s to start once
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


# In the job's first run (no $SLURM_RESTART_COUNT), rank 3 - a task on h2 - is killed
# right after optimizer step 3; a requeued run trains on.
_KILL_ONCE = """
import os, signal
import dtrain.monitor.rank.client as _report

_report_step = _report.report_step


def report_step(**values):
    _report_step(**values)
    if values["step"] == 3 and os.environ.get("RANK") == "3" and "SLURM_RESTART_COUNT" not in os.environ:
        os.kill(os.getpid(), signal.SIGKILL)


_report.report_step = report_step
"""


def test_with_max_restarts_a_killed_task_requeues_the_job_which_resumes_from_its_checkpoint(
        slurm_cluster, dtrain_home, synth_data, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_KILL_ONCE)
    env = {**slurm_cluster.env(), "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH"))
                                                                 if p)}
    out = tmp_path / "run"
    res = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "2", "--max-restarts", "1", "--",
                 "dtrain", "train", *_recipe_sets(synth_data, out), "--set", "max_steps=4",
                 "--set", "checkpoint_every_steps=2", env=env, timeout=420)  # two runs of the recipe, under load
    assert res.returncode == 0, res.stdout + res.stderr
    assert "requeueing the job (restart 1 of 1)" in res.stdout, res.stdout
    # the requeued run continued from the step-2 checkpoint the first run wrote, and finished
    assert "resumed from" in res.stdout and "epoch 0, step 2" in res.stdout, res.stdout
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert state["step"] == 4, state["step"]
    rec = status(slurm_cluster, job_id_of(res.stdout))
    assert rec["state"] == "succeeded", rec
    shown = slurm_cluster.cmd("scontrol", "show", "job", "-o", rec["extra"]["slurm_job_id"]).stdout
    assert "JobState=COMPLETED" in shown and "Restarts=1" in shown, shown
    assert not wait_gone(rec["id"])


def test_the_clusters_slurm_version_is_detected_and_sacct_is_left_alone_without_accounting(slurm_cluster):
    facts = SlurmClient(env=slurm_cluster.env()).facts()
    assert facts.version == parse_version(slurm_cluster.cmd("scontrol", "--version").stdout), facts
    assert facts.version >= (19, 5) and facts.since(19, 5)
    assert facts.accounting is False  # the test cluster keeps no accounting database: sacct is never asked


def test_a_node_failing_preflight_fails_the_job_before_training_and_is_named(slurm_cluster, dtrain_home, tmp_path):
    port = free_port()
    # node 0 of the allocation hosts the rendezvous on `port`. The job takes every node, so
    # node 0 is h1 whichever node an earlier test left completing (with 2 of 3 it could be h2).
    first = slurm_cluster.netns.hosts[0]
    holder = slurm_cluster.netns.popen(first, [sys.executable, "-c", (
        "import socket, time\ns = socket.socket()\ns.bind(('0.0.0.0', %d))\ns.listen()\n"
        "print('ready', flush=True)\ntime.sleep(300)" % port)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        res = dtrain("run", cluster_file(slurm_cluster, tmp_path, nodes=len(slurm_cluster.nodes)),
                     "--nproc-per-node", "1", "--port", str(port), "--",
                     "python", PLAIN, env=slurm_cluster.env(), timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 5, res.stdout + res.stderr
    assert f"[dtrain] preflight failed on {first.name}: port: master port {port} is already in use" in res.stdout
    assert "training step was not started" in res.stdout and f"[{first.name}:r0]" not in res.stdout, res.stdout
    rec = status(slurm_cluster, job_id_of(res.stdout))
    assert rec["state"] == "failed" and f"first failure on {first.name} (preflight: port:" in rec["reason"], rec
    assert f"{first.name} (preflight: port:" in res.stderr, res.stderr


def _watchers(job_id: str) -> list[int]:
    """The detached watcher of `job_id` (python -m dtrain.launch.supervisor JOB), if alive."""
    return [pid for pid, cmd in _supervisors() if cmd.endswith(f"dtrain.launch.supervisor {job_id}")]


def _supervisors() -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if "dtrain.launch.supervisor" in cmd:
            found.append((int(entry.name), cmd))
    return found


def test_a_detached_job_has_an_agent_on_every_node_and_its_report_shows_them(slurm_cluster, dtrain_home, tmp_path):
    res = dtrain("run", cluster_file(slurm_cluster, tmp_path), "--nproc-per-node", "1", "--detach", "--",
                 "python", PLAIN, "--epochs", "8", "--sleep", "0.2", env=slurm_cluster.env(), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id = job_id_of(res.stdout)
    assert _watchers(job_id), "no watcher collects the detached job's metrics"
    # Generous: under the full suite on 2 loaded cores, Slurm's start plus two torch imports took
    # over 90 s once (session 20); the test is about where the agents run, not how fast.
    deadline = time.monotonic() + 180
    while "epoch 1" not in (logs := dtrain("logs", job_id, env=slurm_cluster.env())).stdout:
        assert time.monotonic() < deadline, (logs.stdout[-2000:], logs.stderr[-2000:], status(slurm_cluster, job_id))
        time.sleep(1)
    agents = [cmd for _, cmd in job_processes(job_id) if "dtrain.monitor.node.agent" in cmd]
    assert any("--node h1" in a for a in agents) and any("--node h2" in a for a in agents), agents
    while status(slurm_cluster, job_id)["state"] != "succeeded":
        assert time.monotonic() < deadline + 60, status(slurm_cluster, job_id)
        time.sleep(1)
    while _watchers(job_id):  # it stops with the job, after writing its last samples
        assert time.monotonic() < deadline + 90
        time.sleep(0.5)
    assert not wait_gone(job_id)
    assert_report_shows_both_nodes(slurm_cluster, dtrain_home, job_id, tmp_path, samples=2)
