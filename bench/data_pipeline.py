"""Input pipeline throughput: dtrain.data vs the textbook torchvision pipeline.

Baseline (PyTorch tutorials): `torchvision.datasets.ImageFolder` + PIL decode +
`Resize` / flip / `ToTensor` / `Normalize` in the workers (float32 crosses the process
boundary), default collate. Ours: `open_split` (torchvision.io decode, uint8 v2
augmentation) + `collate_skip_bad`, then `normalize_batch` in the training process as
the trainer does; and the same with `data.cache_decoded`. Same images, same batch size,
same number of workers; each pipeline is timed over whole epochs, best of `--repeat`
rounds taken in turn so that background load hits all of them alike.

    python bench/data_pipeline.py [--root DIR] [--images 3000] [--size 64] [--workers 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader


def baseline_loader(root: Path, size: int, batch: int, workers: int) -> DataLoader:
    from torchvision import datasets, transforms

    tf = transforms.Compose(
        [
            transforms.Resize((size, size)),
            transforms.RandomHorizontalFlip(),
            transforms.RandomVerticalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    ds = datasets.ImageFolder(str(root / "train"), transform=tf)
    return DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0)


def ours_loader(root: Path, size: int, batch: int, workers: int, cached: bool) -> DataLoader:
    from dtrain.data.config import DataConfig
    from dtrain.data.datasets import collate_skip_bad, open_split

    cfg = DataConfig(root=str(root), image_size=size, cache_decoded=cached)
    ds = open_split(cfg, "train", train=True)
    return DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=collate_skip_bad, persistent_workers=workers > 0
    )


def epoch_rate(loader: DataLoader, normalize: bool, channels_last: bool = True) -> float:
    from dtrain.data.transforms import normalize_batch

    start, n = time.perf_counter(), 0
    for images, _labels in loader:
        if normalize:
            images = normalize_batch(images, channels_last)
        n += images.shape[0]
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="an ImageFolder data set (default: synthesise one)")
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if root is None:
            from dtrain.data.synth import synthesize

            root = Path(tmp) / "data"
            synthesize(root, images=args.images, size=args.size, seed=0)
        t0 = time.perf_counter()
        loaders = {
            "baseline (ImageFolder+PIL, float in workers)": (baseline_loader(root, args.size, args.batch, args.workers), False),
            "dtrain (decode_image, uint8, normalize_batch)": (ours_loader(root, args.size, args.batch, args.workers, False), True),
        }
        t1 = time.perf_counter()
        loaders["dtrain + cache_decoded"] = (ours_loader(root, args.size, args.batch, args.workers, True), True)
        cache_s = time.perf_counter() - t1
        best = {name: 0.0 for name in loaders}
        for _ in range(args.repeat):
            for name, (loader, norm) in loaders.items():
                best[name] = max(best[name], epoch_rate(loader, norm))
        base = next(iter(best.values()))
        print(f"images: {len(loaders['dtrain + cache_decoded'][0].dataset)} train, {args.size} px, batch {args.batch}, "
              f"workers {args.workers}; best of {args.repeat} epochs (setup {t1 - t0:.1f}s, cache fill {cache_s:.1f}s)")
        for name, rate in best.items():
            print(f"  {name:48s} {rate:9.0f} img/s  x{rate / base:.2f}")


if __name__ == "__main__":
    main()
