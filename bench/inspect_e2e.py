"""The acceptance benchmark of issue 12: the whole `dtrain inspect` command against the
loop a plant engineer writes, on the same images and the same trained network.

    python bench/inspect_e2e.py                                  # quickstart size: small_resnet, 64 px, 7000 images
    python bench/inspect_e2e.py --arch resnet18 --size 224       # where inference dominates
    python bench/inspect_e2e.py --checkpoint C --data D          # an existing run and its data set
    python bench/inspect_e2e.py --quick                          # a smoke test (tiny; numbers mean nothing)

Without --checkpoint it trains a short run on the synthesised data (`dtrain data synth`)
and exports it with `dtrain export` (its defaults pick the backend). Then:

- dtrain inspect: the command as a subprocess over every image of the data set, timed
  from launch to exit (start-up, imports and model load included);
- the naive loop: the checkpoint in eager fp32 torch, one image at a time, PIL decode
  and torchvision's Resize/ToTensor/Normalize; its start-up (imports, model load) is
  not counted. `--naive-images` caps it to the first N images (it is slow at 224 px);
  images/s, agreement and both test miss rates are then over those (the paths are
  sorted, so N = the test split's size covers exactly the test split).

Reported: images/s of both and their ratio, verdict agreement, the miss rate on the test
split for both (and, paired image by image, which test defects each one misses, with the
exact McNemar p-value), dtrain inspect's stage breakdown, and images/s against the machine's
limit: FLOPs per image (multiply-adds x 2 of every Conv/Gemm/MatMul in the ONNX graph)
x images/s vs the cores' fp32 peak (see `cpu_peak`). Always say the load: the numbers
of a shared machine are lower bounds.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NEGATIVE = "ok"


def dtrain(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dtrain", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=capture, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr if capture else ''}")
    return proc


def synth(data: Path, images: int, size: int) -> None:
    if (data / "manifest.json").is_file():
        return
    dtrain("data", "synth", str(data), "--images", str(images), "--size", str(size))


def train(data: Path, out: Path, arch: str, size: int, epochs: int, max_steps: int | None) -> Path:
    ckpt = out / "checkpoints" / "last.pt"
    if ckpt.is_file():
        return ckpt
    sets = {"data.root": data, "data.image_size": size, "model.arch": arch, "epochs": epochs, "batch_size": 32,
            "optim.name": "adamw", "optim.lr": 2e-3, "optim.warmup_steps": 10, "val_every_epoch": False,
            "output_dir": out, "device": "cpu"}
    if max_steps:
        sets["max_steps"] = max_steps
    cmd = [sys.executable, "-m", "dtrain.train"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    if subprocess.run(cmd, cwd=REPO).returncode != 0:
        raise SystemExit("training failed")
    return ckpt


def images_of(data: Path) -> list[Path]:
    from dtrain.serve.inspect_batch import collect_inputs

    return collect_inputs([str(data)])


def run_inspect(model: Path, data: Path, out: Path, extra: list[str]) -> tuple[float, dict, dict[str, str]]:
    """Wall seconds of the whole command, its JSON summary, and path -> verdict."""
    start = time.perf_counter()
    proc = dtrain("inspect", str(model), str(data), "--out", str(out), "--json", *extra, capture=True)
    wall = time.perf_counter() - start
    with open(out, newline="") as f:
        verdicts = {row["path"]: row["verdict"] for row in csv.DictReader(f)}
    return wall, json.loads(proc.stdout), verdicts


def naive_loop(checkpoint: Path, paths: list[Path], threshold: float, threads: int | None) -> tuple[float, dict[str, str]]:
    """What a plant engineer writes around the checkpoint; seconds exclude start-up (imports,
    model load, one warm-up image). `threads`: torch's intra-op threads (None: its default)."""
    import torch
    from PIL import Image
    from torchvision import transforms as T

    from dtrain.train.checkpoint import load_for_inference

    if threads:
        torch.set_num_threads(threads)
    model, meta = load_for_inference(checkpoint)
    neg = meta["classes"].index(meta["negative_class"])
    size = meta["image_size"]
    prep = T.Compose([T.Resize((size, size)), T.ToTensor(), T.Normalize(meta["mean"], meta["std"])])

    def verdict(path: Path) -> str:
        x = prep(Image.open(path).convert("RGB")).unsqueeze(0)
        p = torch.softmax(model(x).double(), dim=1)[0]
        return "defect" if 1.0 - float(p[neg]) >= threshold else "ok"

    with torch.no_grad():
        verdict(paths[0])
        start = time.perf_counter()
        verdicts = {str(path): verdict(path) for path in paths}
    return time.perf_counter() - start, verdicts


def defective_test_images(paths) -> list[str]:
    """The defective images of the test split among `paths` (class = parent folder)."""
    return [p for p in paths if Path(p).parent.parent.name == "test" and Path(p).parent.name != NEGATIVE]


def miss_rate(verdicts: dict[str, str]) -> float | None:
    """Missed defects / defective images of the test split."""
    defective = defective_test_images(verdicts)
    if not defective:
        return None
    return sum(verdicts[p] == "ok" for p in defective) / len(defective)


def paired_misses(inspect: dict[str, str], naive: dict[str, str]) -> dict:
    """The test defects each contender misses, paired image by image: a miss rate differing
    by one or two images says nothing on its own, so also the exact McNemar test (two-sided
    binomial on the discordant pairs): p near 1 = no evidence that the miss rates differ."""
    defective = defective_test_images(naive)
    both = sum(inspect[p] == "ok" and naive[p] == "ok" for p in defective)
    only_inspect = sum(inspect[p] == "ok" and naive[p] != "ok" for p in defective)
    only_naive = sum(inspect[p] != "ok" and naive[p] == "ok" for p in defective)
    n, k = only_inspect + only_naive, min(only_inspect, only_naive)
    p_value = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"defective": len(defective), "missed_by_both": both, "missed_by_inspect_only": only_inspect,
            "missed_by_naive_only": only_naive, "mcnemar_p": p_value}


def onnx_flops(model_file: Path) -> float:
    """FLOPs of one image: 2 x multiply-adds of every Conv, Gemm and MatMul, from the
    graph's inferred shapes (batch 1); element-wise ops are left out (a few %)."""
    import numpy as np
    import onnx
    from onnx import shape_inference

    graph = shape_inference.infer_shapes(onnx.load(str(model_file))).graph
    shapes = {}
    for v in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = v.type.tensor_type.shape.dim
        shapes[v.name] = [d.dim_value if d.HasField("dim_value") else 1 for d in dims]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    flops = 0.0
    for node in graph.node:
        out = shapes.get(node.output[0])
        if node.op_type == "Conv" and out is not None:
            w = shapes[node.input[1]]  # [Cout, Cin/groups, kh, kw]
            flops += 2.0 * np.prod(out) * np.prod(w[1:])
        elif node.op_type in ("Gemm", "MatMul") and out is not None:
            a = shapes.get(node.input[0])
            if a:
                flops += 2.0 * np.prod(out) * a[-1]
    return flops


def cpu_peak() -> tuple[float, str]:
    """The cores' fp32 peak in FLOP/s, estimated from lscpu: cores x clock x fp32 lanes
    of the widest vector unit in the flags (avx512f 16, avx2 8, else 4) x 2 (an FMA is
    two FLOPs) x 2 FMA pipes per core. The clock is lscpu's max MHz when it gives one,
    else /proc/cpuinfo's current MHz. On AMD Zen 4, AVX-512 runs as two 256-bit halves,
    so its real peak is half this: the estimate is an upper bound."""
    from dtrain.cores import usable_cores

    info = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = set(info.get("Flags", "").split())
    mhz = float(info.get("CPU max MHz", 0) or 0)
    if not mhz:
        with open("/proc/cpuinfo") as f:
            mhz = next((float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")), 0.0)
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    cores = usable_cores()
    peak = cores * mhz * 1e6 * lanes * 2 * 2
    extras = [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni") if f in flags]
    desc = (f"{info.get('Model name', '?')}, {cores} cores at {mhz:.0f} MHz, {lanes} fp32 lanes x FMA x 2 pipes "
            f"= {peak / 1e9:.0f} GFLOP/s fp32 (flags: {', '.join(extras) or 'no bf16/vnni'})")
    return peak, desc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench_inspect_e2e")
    ap.add_argument("--checkpoint", type=Path, help="a trained checkpoint (default: train a short run)")
    ap.add_argument("--data", type=Path, help="the data set to inspect (default: synthesise one)")
    ap.add_argument("--model", type=Path, help="an exported model directory of the checkpoint (default: export it)")
    ap.add_argument("--arch", default="small_resnet")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--images", type=int, default=7000, help="images to synthesise (>= 5000 for the acceptance check)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--naive-images", type=int, default=None, help="time the naive loop on the first N images only")
    ap.add_argument("--naive-threads", type=int, default=None,
                    help="torch threads of the naive loop (default: torch's; on a loaded machine 1 is faster)")
    ap.add_argument("--export-args", default="", help="extra `dtrain export` arguments, space-separated")
    ap.add_argument("--inspect-args", default="", help="extra `dtrain inspect` arguments, space-separated")
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 120 images at 32 px, a few training steps, the naive loop on 40 of them")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.size, args.epochs, args.max_steps = 120, 32, 1, 3
        args.naive_images, args.naive_threads = args.naive_images or 40, args.naive_threads or 1
        args.export_args = args.export_args or "--format onnx --target-miss-rate 0.2"

    work = args.workdir / f"{args.arch}-{args.size}"
    work.mkdir(parents=True, exist_ok=True)
    data = args.data or work / "data"
    if args.data is None:
        synth(data, args.images, args.size)
    checkpoint = args.checkpoint or train(data, work / "train", args.arch, args.size, args.epochs, args.max_steps)
    model = args.model or work / "model"
    if args.model is None:
        dtrain("export", str(checkpoint), "--out", str(model), "--data", str(data), *args.export_args.split())
    card = json.loads((model / "model.json").read_text())

    paths = images_of(data)
    load = os.getloadavg()
    wall, summary, inspect_verdicts = run_inspect(model, data, work / "results.csv", args.inspect_args.split())
    naive_paths = paths[: args.naive_images] if args.naive_images else paths
    naive_s, naive_verdicts = naive_loop(checkpoint, naive_paths, card["threshold"], args.naive_threads)
    load_after = os.getloadavg()

    common = [str(p) for p in naive_paths]
    agreement = sum(inspect_verdicts[p] == naive_verdicts[p] for p in common) / len(common)
    inspect_ips, naive_ips = len(paths) / wall, len(naive_paths) / naive_s
    backend = summary["backend"]
    flops = onnx_flops(model / card["backends"].get("ort-fp32", "model.onnx")) if "ort-fp32" in card["backends"] else None
    fp32_peak, peak_desc = cpu_peak()
    # An int8 network's multiply-adds run as VNNI dot products (4 per 32-bit lane), a
    # bf16 one's as AVX512-BF16 ones (2 per lane): its limit is that many times fp32's.
    flags = peak_desc.rsplit("flags: ", 1)[-1]
    peak = fp32_peak * (4 if "int8" in backend and "vnni" in flags else 2 if "bf16" in backend and "avx512_bf16" in flags else 1)
    result = {
        "arch": card["arch"], "image_size": card["preprocessing"]["image_size"], "images": len(paths),
        "backend": backend, "load_before": load, "load_after": load_after,
        # Both miss rates over the test images both contenders saw (--naive-images may cut
        # the naive loop short), so "the same miss rate" compares like with like.
        "inspect": {"seconds": wall, "images_per_s": inspect_ips, "summary": summary,
                    "test_miss_rate": miss_rate({p: inspect_verdicts[p] for p in common})},
        "naive": {"seconds": naive_s, "images": len(naive_paths), "images_per_s": naive_ips, "threads": args.naive_threads,
                  "test_miss_rate": miss_rate(naive_verdicts)},
        "ratio": inspect_ips / naive_ips, "verdict_agreement": agreement,
        "test_misses_paired": paired_misses(inspect_verdicts, naive_verdicts),
        "flops_per_image": flops, "backend_peak_flops": peak, "fp32_peak_flops": fp32_peak, "cpu": peak_desc,
    }
    if flops:
        for who, ips, limit in (("inspect", inspect_ips, peak), ("naive", naive_ips, fp32_peak)):
            result[who]["gflops"] = flops * ips / 1e9
            result[who]["share_of_peak"] = flops * ips / limit
    stages = summary["stages_s"]
    print(f"{card['arch']} {result['image_size']} px, {len(paths)} images, backend {backend}; "
          f"load {load[0]:.1f} -> {load_after[0]:.1f}; {peak_desc}")
    print(f"  dtrain inspect (whole command): {wall:.1f} s, {inspect_ips:.0f} images/s; "
          f"stages: {', '.join(f'{k} {v:.1f} s' for k, v in stages.items())}")
    print(f"  naive loop (eager fp32, batch 1, {len(naive_paths)} images, torch threads {args.naive_threads or 'default'}): "
          f"{naive_s:.1f} s, {naive_ips:.0f} images/s")
    print(f"  ratio {result['ratio']:.2f}x, verdict agreement {agreement:.2%}, test miss rate "
          f"inspect {result['inspect']['test_miss_rate']} / naive {result['naive']['test_miss_rate']}")
    pm = result["test_misses_paired"]
    print(f"  test defects missed ({pm['defective']}): by both {pm['missed_by_both']}, by dtrain inspect only "
          f"{pm['missed_by_inspect_only']}, by the naive loop only {pm['missed_by_naive_only']}; exact McNemar p = {pm['mcnemar_p']:.2f}")
    if flops:
        print(f"  {flops / 1e6:.1f} MFLOP per image: inspect {result['inspect']['gflops']:.1f} GFLOP/s "
              f"({result['inspect']['share_of_peak']:.1%} of {backend}'s peak, {peak / 1e9:.0f}), "
              f"naive {result['naive']['gflops']:.1f} GFLOP/s ({result['naive']['share_of_peak']:.1%} of fp32's)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
