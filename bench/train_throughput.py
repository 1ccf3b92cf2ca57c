"""Training throughput: the dtrain trainer vs a plain hand-written DDP loop, same run.

    python bench/train_throughput.py [--images 1200] [--size 64] [--batch 32] [--steps 20]
    python bench/train_throughput.py --arch resnet50 --size 224 --device cuda --nproc 1   # on a GPU

Both sides train ResNet-18 (random init) on the same synthetic defect images, world
size 2 on gloo, per-rank batch `--batch`, AdamW lr 2e-3. The baseline is the pattern of
PyTorch's DDP tutorial: `mp.spawn`, `torchvision.datasets.ImageFolder` (PIL) with
Resize/ToTensor/Normalize, a default `DataLoader` with a `DistributedSampler`, fp32,
NCHW, torch's default thread count. dtrain runs `dtrain train --nproc 2` with its
defaults (uint8 pipeline in workers, normalisation + channels_last on the device, one
intra-op thread per rank, precision auto = fp32 on this CPU).

On a GPU (`--device cuda`) the baseline is the tutorial's GPU form (NCCL, one GPU per
rank, fp32) and dtrain picks the GPU itself (precision auto = bf16 where supported).

Images/s is the steady state: steps after the first `--warmup` ones, timed by rank 0 of
each side from its own step timestamps. Also printed: wall time including start-up.
Writes OUT/loss.png (both loss curves) and OUT/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LR = 2e-3


# ---- baseline: the DDP tutorial pattern ------------------------------------------------


def baseline_worker(rank: int, world: int, port: int, data: str, size: int, batch: int, steps: int, out: str,
                    arch: str = "resnet18", device: str = "cpu") -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    from torchvision import transforms

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # The tutorial's GPU form: NCCL, one GPU per rank, model and batches moved to it.
    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    tf = transforms.Compose([
        transforms.Resize((size, size)),
        transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])
    dataset = torchvision.datasets.ImageFolder(os.path.join(data, "train"), transform=tf)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)
    net = getattr(torchvision.models, arch)(weights=None, num_classes=len(dataset.classes)).to(dev)
    model = DDP(net, device_ids=[rank] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.05)
    log, step, epoch = [], 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            optimizer.zero_grad()
            images, labels = images.to(dev), labels.to(dev)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            step += 1
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            log.append({"step": step, "time": time.time(), "loss": reduced.item() / world})
            if step >= steps:
                break
        epoch += 1
    if rank == 0:
        Path(out).write_text(json.dumps(log))
    dist.destroy_process_group()


def run_baseline(data: Path, size: int, batch: int, steps: int, out: Path, *, arch: str = "resnet18",
                 device: str = "cpu", world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(baseline_worker, args=(world, port, str(data), size, batch, steps, str(out), arch, device), nprocs=world, join=True)
    return json.loads(out.read_text())


# ---- ours: dtrain train --nproc 2 ------------------------------------------------------


def run_dtrain(data: Path, size: int, batch: int, steps: int, out_dir: Path, extra: list[str], nproc: int = 2) -> list[dict]:
    import shutil

    shutil.rmtree(out_dir, ignore_errors=True)
    sets = {
        "data.root": data, "data.image_size": size, "batch_size": batch, "max_steps": steps, "epochs": 1000,
        "log_every": 1, "optim.lr": LR, "optim.warmup_steps": 0, "optim.min_lr_ratio": 1.0,
        "output_dir": out_dir, "checkpoint_every": 1000,
        # The baseline validates nothing, so neither does this side (no val pass timed).
        "val_every_epoch": False,
    }
    argv = [sys.executable, "-m", "dtrain", "train", "--nproc", str(nproc)]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")] + [a for e in extra for a in ("--set", e)]
    subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "time": r["time"], "loss": r["loss"]} for r in rows if r["kind"] == "train"]


# ---- comparison ---------------------------------------------------------------------------


def steady_rate(log: list[dict], warmup: int, global_batch: int) -> float:
    """Images/s between the end of step `warmup` and the end of the last step."""
    start = next(r for r in log if r["step"] == warmup)
    end = log[-1]
    return (end["step"] - start["step"]) * global_batch / (end["time"] - start["time"])


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, log in curves.items():
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], label=name)
    ax.set_xlabel("step (global batch = 2 x per-rank batch)")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the rate")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "train_throughput")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra dtrain config override")
    ap.add_argument("--arch", default="resnet18", help="torchvision model of both sides")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the baseline's (dtrain picks its own)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of each side")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from dtrain.data.synth import synthesize

    data = args.out / f"data-{args.images}-{args.size}"
    if not (data / "manifest.json").exists():  # same seed, same bytes: reuse a finished set
        synthesize(data, images=args.images, size=args.size, seed=0)
    steps = args.steps + args.warmup
    gb = args.nproc * args.batch
    extra = [f"model.arch={args.arch}", *args.extra]

    # The load average says how much else ran on the machine during each side.
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    base = run_baseline(data, args.size, args.batch, steps, args.out / "baseline.json", arch=args.arch,
                        device=args.device, world=args.nproc)
    t_base, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    t0 = time.perf_counter()
    ours = run_dtrain(data, args.size, args.batch, steps, args.out / "dtrain", extra, args.nproc)
    t_ours, load2 = time.perf_counter() - t0, os.getloadavg()[0]

    result = {
        "cpus": os.cpu_count(), "world_size": args.nproc, "arch": args.arch, "device": args.device,
        "image_size": args.size, "batch_per_rank": args.batch,
        "steps_timed": args.steps, "extra": extra, "loadavg_start_mid_end": [load0, load1, load2],
        "baseline_images_per_s": steady_rate(base, args.warmup, gb),
        "dtrain_images_per_s": steady_rate(ours, args.warmup, gb),
        "baseline_wall_s": t_base, "dtrain_wall_s": t_ours,
        "baseline_final_loss": base[-1]["loss"], "dtrain_final_loss": ours[-1]["loss"],
    }
    result["ratio"] = result["dtrain_images_per_s"] / result["baseline_images_per_s"]
    plot({"baseline (DDP tutorial)": base, "dtrain": ours}, args.out / "loss.png")
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(f"baseline (DDP tutorial loop): {result['baseline_images_per_s']:8.1f} images/s   wall {t_base:6.1f} s   loss {base[0]['loss']:.3f} -> {base[-1]['loss']:.3f}")
    print(f"dtrain train --nproc {args.nproc}:       {result['dtrain_images_per_s']:8.1f} images/s   wall {t_ours:6.1f} s   loss {ours[0]['loss']:.3f} -> {ours[-1]['loss']:.3f}")
    print(f"ratio dtrain / baseline: {result['ratio']:.2f}x   (loss curves: {args.out / 'loss.png'})")
    print(f"1-min load average at start / between / end: {load0:.1f} / {load1:.1f} / {load2:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
