"""Training from pushed shards, with real processes (gloo on CPU):

- push -> verify -> 2 epochs on 2 ranks from s3://... (moto server, loopback) ends with
  the same parameters as 2 epochs from the local folder with the same seed (fp32, 1e-5);
- one epoch over 2 nodes x 2 ranks x 2 loader workers delivers every sample exactly once
  (plus DistributedSampler's padding: the first `pad` ids of the epoch's permutation are
  repeated so that every rank gets ceil(N / world) samples);
- a run SIGKILLed mid-epoch (after a step-based checkpoint) and resumed fetches each
  remaining sample exactly once.

Sample ids come from DTRAIN_DATA_TRACE: each loader worker appends one line per batch.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from torch.utils.data import DistributedSampler

from dtrain.data.config import DataConfig
from dtrain.data.shard_push import parse_size, push
from dtrain.data.shard_verify import load_manifest, verify
from dtrain.data.storage import open_store
from dtrain.ports import free_port

from stall_hook import stall_env

pytestmark = pytest.mark.slow  # end to end: ./dev test -m 'not slow' leaves it out

TRACE = "DTRAIN_DATA_TRACE"


def write_config(path: Path, root: str, out: Path, *, epochs: int, batch: int, workers: int = 1, **data) -> Path:
    cfg = {
        "data": {"root": root, "image_size": 32, "num_workers": workers, "cache_dir": str(out / "cache"), **data},
        "model": {"arch": "resnet18"},
        "epochs": epochs,
        "batch_size": batch,
        "precision": "fp32",
        "channels_last": False,
        "seed": 7,
        "output_dir": str(out),
        "log_every": 1000,
        "optim": {"warmup_steps": 2},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(argv, env=None, timeout=600):
    proc = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, **(env or {})), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def final_params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["model"]


def read_trace(folder: Path, split: str = "train") -> dict[str, list[list[int]]]:
    """{'rank0-worker1': [[ids of batch], ...]} in fetch order."""
    out = {}
    for f in sorted(folder.glob(f"{split}-rank*-worker*.txt")):
        out[f.stem.split("-", 1)[1]] = [list(map(int, line.split())) for line in f.read_text().splitlines()]
    return out


def test_two_ranks_from_s3_match_the_local_folder(synth_data, s3_server, tmp_path):
    env = s3_server.env()
    bucket = s3_server.new_bucket()
    dest = f"s3://{bucket}/defects"
    run([sys.executable, "-m", "dtrain", "data", "push", str(synth_data), dest, "--shard-size", "64kB"], env)
    run([sys.executable, "-m", "dtrain", "data", "verify", dest], env)

    local, remote = tmp_path / "local", tmp_path / "s3"
    for out, root in ((local, str(synth_data)), (remote, dest)):
        # No loader workers: the slow part of this test is process start-up.
        cfg = write_config(tmp_path / f"{out.name}.yaml", root, out, epochs=2, batch=16, workers=0)
        trace = {TRACE: str(tmp_path / "trace")} if out is remote else {}
        run([sys.executable, "-m", "dtrain", "train", str(cfg), "--nproc", "2"], dict(env, **trace))
    a, b = final_params(local), final_params(remote)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=key)
    assert read_trace(tmp_path / "trace")  # the s3 run really read through the shard dataset
    assert list((remote / "cache").rglob("*.tar"))  # and filled the node-local cache


RANK_SCRIPT = r'''
import os, sys
from dtrain.configio import load_config
from dtrain.train import dist, loaders
from dtrain.train.config import TrainConfig

# This 2-core test machine stands in for nodes with more cores: without this the
# trainer would cap loader workers at cores / ranks = 1.
loaders.cpu_count = lambda: 16
cfg = load_config(TrainConfig, sys.argv[1])
ctx = dist.setup("cpu")
data = loaders.build_loaders(cfg.data, ctx, batch_size=cfg.batch_size, seed=cfg.seed)
assert data.train.num_workers == 2, data.train.num_workers
data.sampler.set_epoch(0)
n = sum(len(labels) for _, labels in data.train)
print(f"rank {ctx.rank}: {n} samples")
dist.barrier(ctx)
dist.teardown()
'''


def test_two_nodes_two_ranks_two_workers_see_each_sample_once(synth_data, tmp_path):
    dest = tmp_path / "shards"
    push(DataConfig(root=str(synth_data)), open_store(str(dest)), parse_size("64kB"), splits=["train"])
    n = load_manifest(open_store(str(dest))).splits["train"].count
    world = 4
    per_rank = -(-n // world)
    batch = max(d for d in range(1, 13) if per_rank % d == 0)  # drop_last drops nothing
    if batch == 1:
        batch = per_rank
    cfg = write_config(tmp_path / "cfg.yaml", str(dest), tmp_path / "out", epochs=1, batch=batch, workers=2,
                       val_split="", layout="shards")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    trace = tmp_path / "trace"
    trace.mkdir()
    port = free_port()
    nodes = []
    for node in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                str(script), str(cfg)]
        env = dict(os.environ, **{TRACE: str(trace), "OMP_NUM_THREADS": "1", "DTRAIN_NODE_RANK": str(node)})
        nodes.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outputs)

    batches = read_trace(trace)
    assert sorted(batches) == [f"rank{r}-worker{w}" for r in range(world) for w in range(2)]
    seen = collections.Counter(i for lines in batches.values() for b in lines for i in b)
    pad = per_rank * world - n
    assert set(seen) == set(range(n))  # nothing missed
    assert sum(seen.values()) == n + pad  # and nothing extra but the padding
    assert sum(1 for c in seen.values() if c == 2) == pad and max(seen.values()) <= 2
    for r in range(world):  # each rank: ceil(n / world) samples, split over both workers
        assert sum(len(b) for w in range(2) for b in batches[f"rank{r}-worker{w}"]) == per_rank


def _kill_process_groups(proc: subprocess.Popen) -> None:
    """SIGKILL every process group of the run at once, as a power cut would: the launcher's
    and each rank's (torch's elastic agent starts every rank in its own session); loader
    workers share their rank's group."""
    tree = [psutil.Process(proc.pid)]
    with contextlib.suppress(psutil.NoSuchProcess):
        tree += tree[0].children(recursive=True)
    groups = set()
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(p.pid))
    assert os.getpgid(0) not in groups  # never this test's own group
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive


def test_run_killed_mid_epoch_resumes_with_each_remaining_sample_once(synth_data, tmp_path):
    """`dtrain train --nproc 2` checkpoints every 3 steps; every rank stalls after step 7
    (tests/stall_hook.py, so the kill lands at a known point, not a race); the test SIGKILLs all
    its process groups, then `--resume`s. The resumed
    run must fetch exactly the samples after the checkpointed step, each once, and none
    the checkpoint already covered; step 7, trained but lost with the kill, is redone."""
    dest = tmp_path / "shards"
    push(DataConfig(root=str(synth_data)), open_store(str(dest)), parse_size("64kB"), splits=["train"])
    n = load_manifest(open_store(str(dest))).splits["train"].count
    batch, world, every, stall = 8, 2, 3, 7
    assert n % world == 0  # the test data has no padding, so any repeat is a bug
    steps = (n // world) // batch
    assert stall < steps - 1
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.yaml", str(dest), out, epochs=1, batch=batch, workers=1, val_split="",
                       layout="shards")
    first, second = tmp_path / "trace1", tmp_path / "trace2"
    first.mkdir(), second.mkdir()
    train = [sys.executable, "-m", "dtrain", "train", str(cfg), "--nproc", str(world),
             "--set", f"checkpoint_every_steps={every}"]
    log = tmp_path / "killed.log"
    env = stall_env(tmp_path / "stall", stall, **{TRACE: str(first)})
    with open(log, "wb") as fh:
        proc = subprocess.Popen(train, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while log.read_text(errors="replace").count(f"stalled after step {stall}") < world:
            assert proc.poll() is None, f"the run ended ({proc.returncode}) before stalling:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        _kill_process_groups(proc)
    blob = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    done = (stall // every) * every  # the last checkpoint before the stall
    assert (blob["epoch"], blob["step_in_epoch"], blob["step"]) == (0, done, done)
    run(train + ["--resume"], {TRACE: str(second)})
    assert torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["epoch"] == 1

    killed, resumed = read_trace(first), read_trace(second)
    assert sorted(resumed) == [f"rank{r}-worker0" for r in range(world)]
    before, after = [], []
    for r in range(world):
        # The epoch's order for this rank, cut into its batches (what the trainer's
        # sampler is built on: DistributedSampler, seed 7, epoch 0).
        order = list(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=7))
        batches = [order[i * batch:(i + 1) * batch] for i in range(steps)]
        # One loader worker per rank: its trace lines are its batches in order (the
        # killed run fetched past the stall: prefetching).
        assert len(killed[f"rank{r}-worker0"]) >= stall
        assert killed[f"rank{r}-worker0"][:stall] == batches[:stall]
        assert resumed[f"rank{r}-worker0"] == batches[done:]  # the rest, once, in order
        before += [i for b in batches[:done] for i in b]
        after += [i for b in resumed[f"rank{r}-worker0"] for i in b]
    assert len(after) == len(set(after)) == (steps - done) * batch * world
    assert not set(before) & set(after)  # nothing the checkpoint covered is seen again
    assert n - len(before) - len(after) == world * ((n // world) % batch)  # all but drop_last's tail
