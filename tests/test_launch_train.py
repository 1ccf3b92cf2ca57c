"""`dtrain train --nproc N` is a job like any cluster job: registry row, logs, stop, job.json
with the plan; and its data is checked once, before any rank is spawned."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml
from launch_helpers import REPO, dtrain, job_id_of, wait_gone
from stall_hook import stall_env


def _config(path, data_root, out_dir):
    path.write_text(yaml.safe_dump({
        "data": {"root": str(data_root), "image_size": 16, "num_workers": 0, "augment": False},
        "optim": {"warmup_steps": 1}, "precision": "fp32", "device": "cpu", "threads": 1, "epochs": 1,
        "batch_size": 8, "output_dir": str(out_dir),
    }))
    return path


@pytest.mark.slow
def test_a_local_train_is_listed_logged_and_stopped_like_a_cluster_job(synth_data, tmp_path, dtrain_home):
    cfg = _config(tmp_path / "cfg.yaml", synth_data, tmp_path / "out")
    log = tmp_path / "train.log"
    with open(log, "wb") as fh:  # the ranks wait after step 1 until stopped (stall_hook)
        # -X importtime: the launcher's own imports (not its children's) are listed in the log.
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "dtrain", "train", str(cfg), "--nproc", "2"], cwd=REPO,
                                stdout=fh, stderr=subprocess.STDOUT, env=stall_env(tmp_path / "stall", 1))
    try:
        deadline = time.monotonic() + 300
        while log.read_text(errors="replace").count("stalled after step 1") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        job_id = job_id_of(log.read_text())
        listed = {j["id"]: j for j in json.loads(dtrain("jobs", "--json").stdout)}
        assert listed[job_id]["state"] == "running" and listed[job_id]["world_size"] == 2
        assert listed[job_id]["nodes"] == ["local"]
        logs = dtrain("logs", job_id).stdout
        assert "[local:r0] dtrain: rank 0 stalled after step 1" in logs
        assert "[local:r1] dtrain: rank 1 stalled after step 1" in logs
        # The same job.json as a cluster job's: the plan it ran, the cluster, the job.
        saved = json.loads((dtrain_home / "jobs" / job_id / "job.json").read_text())
        assert saved["plan"]["nodes"][0]["nproc"] == 2 and saved["job"]["command"][:2] == ["dtrain", "train"]

        stopped = dtrain("stop", job_id)
        assert stopped.returncode == 0 and f"job {job_id} stopped" in stopped.stdout, stopped.stderr
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads(dtrain("status", job_id, "--json").stdout)["state"] == "stopped"
    assert wait_gone(job_id) == []
    # The launcher reads the config, checks the data and starts torchrun without importing
    # torch: seconds of start-up on a CPU, paid by the ranks that use it, not once more by it.
    imported = [line.rsplit("|", 1)[-1].strip() for line in log.read_text().splitlines() if line.startswith("import time:")]
    assert "dtrain.launch.launcher" in imported and "dtrain.train.config" in imported
    assert "torch" not in imported and "torchvision" not in imported


@pytest.mark.slow  # two `dtrain train --nproc 2` processes: ~12 s CPU, ~45-55 s on the loaded 2-core machine
def test_missing_or_empty_data_is_one_error_before_any_rank(tmp_path, dtrain_home):
    empty = tmp_path / "data"
    for cls in ("ok", "scratch"):
        (empty / "train" / cls).mkdir(parents=True)
    for root, expect in [(tmp_path / "nowhere", "data directory not found"),
                         (empty, "the training split 'train' of")]:
        res = dtrain("train", str(_config(tmp_path / "cfg.yaml", root, tmp_path / "out")), "--nproc", "2")
        assert res.returncode != 0 and expect in res.stderr, res.stderr
        assert "Traceback" not in res.stderr + res.stdout and res.stderr.count("dtrain: error:") == 1
    assert not (dtrain_home / "jobs").exists() or not list((dtrain_home / "jobs").iterdir())


def test_default_nproc_counts_gpus_only_where_a_gpu_driver_is(tmp_path):
    """No GPU driver's device files: two ranks (capped by the cores), and torch not imported
    to learn it. With one (a stand-in file here), torch is asked: one rank per GPU it sees."""
    script = (
        "import sys\n"
        "from dtrain.cores import usable_cores\n"
        "from dtrain.train.launch import default_nproc\n"
        f"assert default_nproc(({str(tmp_path / 'absent')!r},)) == min(2, usable_cores())\n"
        "assert 'torch' not in sys.modules\n"
        f"n = default_nproc(({str(tmp_path)!r},))\n"
        "import torch\n"
        "gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
        "assert n == (gpus or min(2, usable_cores())), n\n"
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
