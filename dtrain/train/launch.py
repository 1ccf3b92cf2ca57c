"""`dtrain train --nproc N`: N local ranks through torch's own elastic launcher.

The workers are `python -m dtrain.train CONFIG ...` subprocesses started by
`torch.distributed.launcher.api.elastic_launch` with a standalone c10d rendezvous on
localhost (what `torchrun --standalone` does), so each one sees exactly the environment
torchrun would give it, plus dtrain's own variables (DESIGN.md's environment contract).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

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


@contextlib.contextmanager
def watched(job_id: str, nproc: int, enabled: bool) -> Iterator[dict[str, str]]:
    """The node agent and collector for a local run (as `dtrain run` starts on every node):
    metrics go to `$DTRAIN_HOME/jobs/<job_id>/`, where `dtrain top / report / dashboard`
    find them. Yields the environment the ranks need; best effort, like on a cluster."""
    if not enabled:
        yield {}
        return
    from dtrain.monitor.local import monitored
    from dtrain.paths import job_dir, write_text_atomic

    directory = job_dir(job_id)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"id": job_id, "name": "dtrain train (local)", "nodes": ["local"], "world_size": nproc,
            "state": "running", "started": time.time()}  # fmt: skip
    write_text_atomic(directory / "job.json", json.dumps(meta, indent=1))
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    say(f"[dtrain] monitoring job {job_id}: `dtrain top {job_id}` live, `dtrain report {job_id}` afterwards")
    state = "failed"
    try:
        with monitored(directory, job_id, say=say) as env:
            yield env
        state = "succeeded"
    except KeyboardInterrupt:
        state = "stopped"
        raise
    finally:
        write_text_atomic(directory / "job.json", json.dumps({**meta, "state": state, "ended": time.time()}, indent=1))


def launch_local(config: str | None, overrides: list[str], resume: bool, nproc: int, *, max_restarts: int = 0,
                 monitor: bool = True) -> None:  # fmt: skip
    """Run N ranks on this machine; raises JobFailed naming the first rank that failed."""
    from dtrain.jobs.registry import new_job_id

    # Under `dtrain run` the job has an id and its node already has an agent.
    own_job = "DTRAIN_JOB_ID" not in os.environ
    run_id = os.environ.get("DTRAIN_JOB_ID") or new_job_id(time.time())
    with watched(run_id, nproc, monitor and own_job) as env:
        os.environ.update(env)
        _elastic(config, overrides, resume, nproc, run_id, max_restarts)


def _elastic(config: str | None, overrides: list[str], resume: bool, nproc: int, run_id: str, max_restarts: int) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
