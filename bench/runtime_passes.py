"""Memory and speed of the inspection runtime's forward passes: a batch as one pass (before)
vs passes of at most CPU_PASS pictures, views counted (dtrain/passes.py, `Backend.runner`).

A batch of parts on 8 views is 8 pictures a part, so `dtrain inspect`'s default batch of
32 parts was one ONNX Runtime pass of 256 pictures. Each contender runs in its own fresh
process (peak RSS is per process), on the same random uint8 batch, through the same
exported network: an untrained small_resnet (memory and time do not depend on the
weights), exported as `dtrain export` does. Contenders alternate, `--repeats` each.

    python bench/runtime_passes.py                  # 320 px, 8 views, batch 32
    python bench/runtime_passes.py --side 512 --views 8 --batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def export_network(side: int, views: int, path: Path) -> None:
    import torch

    from dtrain.models import ModelConfig, build_model
    from dtrain.models.views import ViewAverage
    from dtrain.serve.export import Deployable, _export_onnx

    torch.manual_seed(0)
    net = build_model(ModelConfig(arch="small_resnet", input_norm="per_image", pool="avgmax", stem_stride=2), 6).eval()
    wrapped = Deployable(ViewAverage(net, views) if views > 1 else net, [0.5] * 3, [0.25] * 3).eval()
    example = torch.randint(0, 255, (2, 3, side, side), dtype=torch.uint8)
    _export_onnx(wrapped, example, ({0: torch.export.Dim("batch", min=1, max=1024)},), path)


def child(network: str, side: int, views: int, batch: int, sliced: bool, seconds: float) -> dict:
    """In a fresh process: parts per second and the process's peak RSS for one contender."""
    from dtrain.serve.backends import get_backend

    backend = get_backend("ort-fp32")
    run = backend.runner(Path(network), views) if sliced else backend.load(Path(network))
    images = np.random.default_rng(0).integers(0, 256, (batch, 3, side, side), dtype=np.uint8)
    first = run(images)  # warm-up (ORT's first run plans its memory)
    n, start = 0, time.perf_counter()
    while n == 0 or time.perf_counter() - start < seconds:
        run(images)
        n += batch
    return {"parts_per_s": n / (time.perf_counter() - start), "peak_rss_gb": peak_rss_gb(), "checksum": float(np.abs(first).sum())}


def peak_rss_gb() -> float:
    """This process's peak resident memory. VmHWM, not getrusage's ru_maxrss: ru_maxrss
    survives execve, so a child started by a parent that had imported torch and exported
    the network would report the parent's larger peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=320)
    ap.add_argument("--views", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="parts per batch (dtrain inspect's --batch default)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        network, sliced = args.child.rsplit(":", 1)
        print(json.dumps(child(network, args.side, args.views, args.batch, sliced == "1", args.seconds)))
        return
    from dtrain.passes import images_per_pass

    with tempfile.TemporaryDirectory() as tmp:
        network = Path(tmp) / "model.onnx"
        export_network(args.side, args.views, network)
        results: dict[str, list[dict]] = {"one pass": [], "passes": []}
        for _ in range(args.repeats):
            for name, sliced in (("one pass", "0"), ("passes", "1")):
                out = subprocess.run([sys.executable, __file__, "--side", str(args.side), "--views", str(args.views),
                                      "--batch", str(args.batch), "--seconds", str(args.seconds), "--child", f"{network}:{sliced}"],
                                     check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    per = images_per_pass(args.views, gpu=False)
    print(f"ort-fp32, {args.side} px, {args.views} views, batch {args.batch} parts ({args.batch * args.views} pictures); "
          f"passes of {per} parts ({per * args.views} pictures)")
    for name, rows in results.items():
        speed = [r["parts_per_s"] for r in rows]
        print(f"  {name:9s} parts/s {' '.join(f'{s:.1f}' for s in speed)}  peak RSS {max(r['peak_rss_gb'] for r in rows):.2f} GB")
    a, b = (np.median([r["parts_per_s"] for r in results[k]]) for k in ("one pass", "passes"))
    same = results["one pass"][0]["checksum"], results["passes"][0]["checksum"]
    print(f"  passes / one pass: speed {b / a:.2f}x, memory {max(r['peak_rss_gb'] for r in results['passes']) / max(r['peak_rss_gb'] for r in results['one pass']):.2f}x; "
          f"output checksums {same[0]:.6g} / {same[1]:.6g}")


if __name__ == "__main__":
    main()
