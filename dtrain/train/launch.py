"""`dtrain train --nproc N` and the quickstart: N ranks on this machine, launched like any
cluster job (`dtrain.launch.launcher.start` on the `local` backend).

So a local run gets what a cluster job gets: a registry row and a job directory
(`dtrain jobs / status / logs / stop`), the node agent and collector (`dtrain top /
report / dashboard`), fail-fast and the root-cause summary. Its data is checked here,
once, before any rank is spawned: a missing data root or an empty split is one error
line, not a traceback from every rank.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, TextIO

from dtrain.errors import DtrainError
from dtrain.ports import free_port as _free_port


# Device files a GPU driver creates (NVIDIA's, and AMD's ROCm, which torch.cuda also drives).
# Without any of them torch can see no GPU, so the launcher need not import torch to count.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def default_nproc(driver_files: tuple[str, ...] = GPU_DRIVER_FILES) -> int:
    """One rank per GPU; on CPUs two ranks (DDP for real) but never more than the cores."""
    from dtrain.cores import usable_cores

    if any(os.path.exists(f) for f in driver_files):
        import torch  # seconds of start-up, paid only where a GPU may be

        if torch.cuda.is_available() and torch.cuda.device_count():
            return torch.cuda.device_count()
    return max(1, min(2, usable_cores()))


def check_data(config: str | None, overrides: list[str]) -> None:
    """The training split must exist and hold images (local layouts; remote shards are
    the ranks' to open). Raises DtrainError, before anything is launched."""
    from dtrain.configio import load_config
    from dtrain.data.layouts import scan
    from dtrain.train.config import TrainConfig

    data = load_config(TrainConfig, config, overrides).data
    if data.layout == "shards" or "://" in data.root:
        return
    if not scan(data, data.train_split).paths:
        raise DtrainError(f"the training split '{data.train_split}' of {data.root} holds no images",
                          f"put the images in {data.root}/{data.train_split}/<class>/, or point data.root elsewhere")


def train_command(config: str | None, overrides: list[str], resume: bool) -> list[str]:
    argv = ["dtrain", "train"]
    if config:
        argv.append(str(config))
    for item in overrides:
        argv += ["--set", item]
    if resume:
        argv.append("--resume")
    return argv


def launch_local(config: str | None, overrides: list[str], resume: bool, nproc: int, *, monitor: bool = True,
                 out: TextIO = sys.stderr, on_job: Callable[[str], None] | None = None) -> int:
    """Run N ranks on this machine as one job; returns its exit status (0, or 130 when
    stopped) and raises JobFailed naming the first rank that failed."""
    from dtrain.cluster.spec import cluster_from_args
    from dtrain.launch.launcher import start
    from dtrain.launch.spec import JobSpec

    check_data(config, overrides)
    job = JobSpec(
        name="train", command=train_command(config, overrides, resume), nproc_per_node=nproc,
        # Free ports, as torchrun --standalone picks: several local runs side by side.
        port=_free_port(), monitor=monitor, monitor_port=_free_port(),
        # Each rank sets its own thread count; this only stops torchrun's warning.
        env={} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"},
    )
    cluster = cluster_from_args(None, None, default_local=True)
    return start(job, cluster, out=out, run_preflight=False, on_job=on_job).exit_status


def say_job(monitor: bool, stream: TextIO = sys.stderr) -> Callable[[str], None]:
    """What the user is told once a local run has its job id: how to watch it."""

    def say(job_id: str) -> None:
        head = (f"[dtrain] monitoring job {job_id}: `dtrain top {job_id}` live, `dtrain report {job_id}` afterwards;"
                if monitor else f"[dtrain] job {job_id}:")
        print(f"{head} `dtrain logs {job_id}`, `dtrain stop {job_id}`", file=stream, flush=True)

    return say
