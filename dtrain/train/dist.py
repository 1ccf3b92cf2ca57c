"""Who am I in the job: process group setup/teardown and cross-rank reductions.

The same code runs in a plain process (no RANK in the environment: a world of one, no
process group at all), under `torchrun`, and under `dtrain train --nproc N` (torch's
elastic launcher sets the same variables torchrun does).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtrain.cores import usable_cores as cpu_count  # noqa: F401  (the trainer's name for it)
from dtrain.errors import ConfigError

# The collective backend for each device type; a new accelerator is one more entry.
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def exit_with_launcher(poll_s: float = 1.0) -> None:
    """Under torch's elastic agent (torchrun, `dtrain train`), end this rank when the
    agent dies.

    The agent starts every rank in a session of its own, so a SIGKILLed agent (kill -9,
    the OOM killer, a lost SSH session) would leave its ranks training as orphans, and a
    later `--resume` would race them for last.pt. A daemon thread notices the re-parenting
    and kills this rank (its loader workers follow: they watch their parent too).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # a plain process: its lifetime is the user's business
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dtrain-launcher-watch", daemon=True).start()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda was asked for but no CUDA GPU is visible", "set device: cpu or auto")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(requested)


def setup(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the process group named by the environment (if any) and pick the device."""
    env = os.environ
    if "RANK" not in env:
        return DistContext(0, 0, 1, 1, pick_device(device, 0))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    dev = pick_device(device, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=BACKENDS[dev.type],
            timeout=timedelta(seconds=timeout_s),
            # Binding the device lets NCCL set up its communicator eagerly.
            device_id=dev if dev.type == "cuda" else None,
            **_incarnation_store(rank, world, timeout_s),
        )
    return DistContext(rank, local_rank, world, local_world, dev)


def _incarnation_store(rank: int, world: int, timeout_s: float) -> dict:
    """Under torch's elastic agent, a store namespace of this restart round's own.

    The agent hosts the store at MASTER_ADDR:MASTER_PORT for the whole run, and the
    process group's keys (each rank's gloo address) carry no round: after a restart a
    new rank could read the previous round's address of a peer and dial a dead
    listener ("Connection refused" in connectFullMesh). Every restart starts every rank
    once, so a per-rank counter in the store is the same round number on every rank.
    Outside the elastic agent: {} (init_process_group's own env:// rendezvous).
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env:
        return {}
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=timeout_s))  # fmt: skip
    round_no = store.add(f"dtrain/incarnation/rank{rank}", 1)
    return {"store": dist.PrefixStore(f"dtrain/round{round_no}", store), "rank": rank, "world_size": world}


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum a few scalars over all ranks in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_mean(values: list[float], ctx: DistContext) -> list[float]:
    return [v / ctx.world_size for v in all_reduce_sum(values, ctx)]


def gather_objects(obj: object, ctx: DistContext) -> list[object]:
    if not ctx.distributed:
        return [obj]
    out: list[object] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()
