"""Inference throughput: a naive PyTorch eager fp32 loop vs dtrain's exported model.

One run, the same decoded test images for every contender (decoding is excluded from
the timings; `dtrain inspect` overlaps it with inference in threads), the same
threshold, and the verdicts of each contender compared with the naive loop's.

    python bench/inference.py                       # the quickstart's model and data
    python bench/inference.py --checkpoint C --data D [--images 512] [--seconds 3]

Needs a trained checkpoint: by default the quickstart's (run `./dev quickstart` first).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dtrain.data.datasets import open_split  # noqa: E402
from dtrain.evaluation.predict import normalize  # noqa: E402
from dtrain.serve.backends import get_backend  # noqa: E402
from dtrain.serve.export import ExportOptions, export  # noqa: E402
from dtrain.serve.predictor import softmax64  # noqa: E402
from dtrain.serve.verify import data_config  # noqa: E402
from dtrain.train.checkpoint import load_for_inference  # noqa: E402


def timed(fn, items, seconds: float) -> tuple[float, list]:
    """Images/s of calling fn on every item of `items` (repeated for >= `seconds`), and
    the outputs of the first pass."""
    outputs = [fn(x) for x in items]  # warm-up pass, also the verdicts
    n_images, passes, start = 0, 0, time.perf_counter()
    while passes == 0 or time.perf_counter() - start < seconds:
        for x in items:
            fn(x)
        n_images += sum(len(x) for x in items)
        passes += 1
    return n_images / (time.perf_counter() - start), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(REPO / "runs/quickstart/train/checkpoints/last.pt"))
    ap.add_argument("--data", default=None, help="data root (default: the checkpoint's training data)")
    ap.add_argument("--model-dir", default=None, help="reuse this export instead of exporting again")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=3.0, help="minimum timing per contender")
    ap.add_argument("--target-miss-rate", type=float, default=0.005)
    ap.add_argument("--backends", default=None, help="comma-separated candidates for the export (default: all)")
    args = ap.parse_args()
    if not Path(args.checkpoint).is_file():
        sys.exit(f"no checkpoint at {args.checkpoint}: run `./dev quickstart` first, or pass --checkpoint/--data")

    model, meta = load_for_inference(args.checkpoint)
    cfg = data_config(args.data, meta)
    neg = meta["classes"].index(meta["negative_class"])
    model_dir = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(prefix="dtrain-bench-")) / "model"
    if not args.model_dir:
        print(f"exporting to {model_dir} (ONNX fp32 + int8, torch program; every backend verified and timed) ...", flush=True)
        export(ExportOptions(checkpoint=args.checkpoint, out=str(model_dir), format="all", quantize="int8",
                             data=cfg.root, target_miss_rate=args.target_miss_rate,
                             backends=args.backends.split(",") if args.backends else None),
               step=lambda msg: print(f"  {msg}", flush=True))
    from dtrain.serve.model_dir import load_card

    card = load_card(model_dir)
    ds = open_split(cfg, cfg.test_split, train=False)
    samples = [s for s in (ds[i] for i in range(min(len(ds), args.images))) if s is not None]
    images = np.stack([s[0].numpy() for s in samples])
    n = len(images) - len(images) % 32
    images = images[:n]
    size = images.shape[-1]
    print(f"\n{n} test images of {size} px, {meta['config']['model']['arch']}, torch threads {torch.get_num_threads()}, "
          f"threshold {card.threshold:.4f}\n")

    def naive(x: np.ndarray) -> np.ndarray:
        # What a first service does: one image at a time through the eager fp32 model.
        with torch.no_grad():
            t = torch.from_numpy(x)
            return model(normalize(t, meta["mean"], meta["std"], channels_last=False)).numpy()

    singles = [images[i : i + 1] for i in range(n)]
    batches = [images[i : i + 32] for i in range(0, n, 32)]
    rows = []
    naive_ips, naive_out = timed(naive, singles, args.seconds)
    p_naive = 1.0 - softmax64(np.concatenate(naive_out))[:, neg]
    naive_cls = _classes(naive_out, neg, card.threshold)
    rows.append(("naive PyTorch eager fp32", 1, naive_ips, 1.0, 1.0, 0.0))

    def compare(out, threshold: float = card.threshold) -> tuple[float, float, float]:
        # Each contender at the threshold it decides at (a quantised backend has its own), the naive loop at the checkpoint's.
        same_class = float(np.mean(_classes(out, neg, threshold) == naive_cls))
        return _agree(out, p_naive, neg, threshold, card.threshold), same_class, _dmax(out, p_naive, neg)

    eager32_ips, eager32_out = timed(naive, batches, args.seconds)
    rows.append(("PyTorch eager fp32", 32, eager32_ips, *compare(eager32_out)))
    for name in sorted(card.backends, key=lambda b: (b != card.preferred_backend, b)):
        backend = get_backend(name)
        run = backend.load(model_dir / card.backends[name])
        for batch, items in ((1, singles), (32, batches)):
            if batch == 1 and name != card.preferred_backend:
                continue
            ips, out = timed(run, items, args.seconds)
            label = f"dtrain {name}" + (" (chosen)" if name == card.preferred_backend else "")
            rows.append((label, batch, ips, *compare(out, card.threshold_for(name))))

    print("| contender | batch | images/s | vs naive | verdicts = naive | classes = naive | max abs dP(defect) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, batch, ips, agree, same_class, dmax in rows:
        print(f"| {label} | {batch} | {ips:.1f} | {ips / naive_ips:.2f}x | {agree:.2%} | {same_class:.2%} | {dmax:.1e} |")
    chosen = next(r for r in rows if "(chosen)" in r[0] and r[1] == 32)
    print(f"\nchosen backend at batch 32: {chosen[2] / naive_ips:.2f}x the naive loop, {chosen[3]:.2%} same verdicts "
          f"(target >= 5x, >= 99.5 %)")
    assert chosen[3] >= 0.995, "the chosen backend changed more than 0.5 % of the naive loop's verdicts"


def _p(out, neg: int) -> np.ndarray:
    return 1.0 - softmax64(np.concatenate(out))[:, neg]


def _classes(out, neg: int, threshold: float) -> np.ndarray:
    """The class each image is reported as (the threshold applied, as dtrain inspect does)."""
    from dtrain.evaluation.metrics import decide

    return decide(softmax64(np.concatenate(out)), neg, threshold)


def _agree(out, p_naive: np.ndarray, neg: int, threshold: float, naive_threshold: float) -> float:
    return float(np.mean((_p(out, neg) >= threshold) == (p_naive >= naive_threshold)))


def _dmax(out, p_naive: np.ndarray, neg: int) -> float:
    return float(np.max(np.abs(_p(out, neg) - p_naive)))


if __name__ == "__main__":
    main()
