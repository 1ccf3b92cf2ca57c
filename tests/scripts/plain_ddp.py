"""An ordinary torchrun script, written without dtrain in mind.

Plain init_process_group, DistributedSampler and DDP; it reads only torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT via env://).
Rank 0 writes the final parameters to --out. With --ckpt it resumes from that
checkpoint if it exists (printing `start world=W epoch=E`) and rank 0 saves it after
every epoch (`saved epoch E world=W`): what an elastic restart needs to go on.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default="")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--ckpt", default="")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.arange(8.0) + 1.0
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = 0
    if args.ckpt and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = state["epoch"] + 1
    if args.ckpt and rank == 0:
        print(f"start world={world} epoch={first}", flush=True)
    step = 0
    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if rank == args.fail_rank and step == args.fail_step:
                raise RuntimeError(f"planned failure on rank {rank} at step {step}")
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            step += 1
            time.sleep(args.sleep)
        if args.ckpt:
            if rank == 0:
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
                torch.save(state, args.ckpt + ".tmp")
                os.replace(args.ckpt + ".tmp", args.ckpt)
                print(f"saved epoch {epoch} world={world}", flush=True)
            dist.barrier()
    if rank == 0:
        print(f"done world={world} steps={step}", flush=True)
        if args.out:
            torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, args.out)
    # Every rank reaches the end, then leaves without tearing gloo down: a peer closing
    # its pairs while another is still in destroy_process_group aborts that one
    # ("terminate called without an active exception", exit -6 after "done": seen in CI
    # on rank 1 without this barrier, and in session 37's suite on rank 0 with it).
    # os._exit skips gloo's destructors, which would race the same way at interpreter exit.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
