"""`dtrain train --nproc N`: N local ranks through torch's own elastic launcher.

The workers are `python -m dtrain.train CONFIG ...` subprocesses started by
`torch.distributed.launcher.api.elastic_launch` with a standalone c10d rendezvous on
localhost (what `torchrun --standalone` does), so each one sees exactly the environment
torchrun would give it, plus dtrain's own variables (DESIGN.md's environment contract).
"""

from __future__ import annotations

import os
import sys
import uuid

from dtrain.errors import JobFailed


def default_nproc() -> int:
    """One rank per GPU; on CPUs two ranks (DDP for real) but never more than the cores."""
    import torch

    from dtrain.train.dist import cpu_count

    if torch.cuda.is_available() and torch.cuda.device_count():
        return torch.cuda.device_count()
    return max(1, min(2, cpu_count()))


def worker_argv(config: str | None, overrides: list[str], resume: bool) -> list[str]:
    argv = ["-m", "dtrain.train"]
    if config:
        argv.append(str(config))
    for item in overrides:
        argv += ["--set", item]
    if resume:
        argv.append("--resume")
    return argv


def launch_local(config: str | None, overrides: list[str], resume: bool, nproc: int, *, max_restarts: int = 0) -> None:
    """Run N ranks on this machine; raises JobFailed naming the first rank that failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_id = os.environ.get("DTRAIN_JOB_ID") or f"train-{uuid.uuid4().hex[:8]}"
    # Variables the workers inherit; a dtrain multi-node launch sets them itself.
    for key, value in {
        "DTRAIN_JOB_ID": run_id,
        "DTRAIN_NODE_RANK": "0",
        "DTRAIN_NUM_NODES": "1",
        "DTRAIN_NODE_ADDRS": "127.0.0.1",
        # Each rank sets its own thread count; this only stops torch's launcher warning.
        "OMP_NUM_THREADS": "1",
    }.items():
        os.environ.setdefault(key, value)
    config_ = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: a free port, as torchrun --standalone
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
    )
    try:
        elastic_launch(config_, sys.executable)(*worker_argv(config, overrides, resume))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise JobFailed(
            f"training rank {rank} exited with code {failure.exitcode} ({nproc} ranks on this machine)",
            "the rank's own error is printed above; fix it and rerun (add --resume to continue from the last checkpoint)",
        ) from None
