"""Images/s delivered to one rank (decode + augment, 2 loader workers): dtrain shards vs a
torchvision ImageFolder + PIL DataLoader over the same JPEG images, from a local folder
and from an S3 API server on loopback (moto, started here).

    .venv/bin/python bench/data_throughput.py [--images 800] [--size 384] [--out 224]

- ours, local:  `dtrain data push` to a local folder, then the shard dataset
  (torchvision decode_image -> resize -> uint8 v2 augmentation) in a DataLoader.
- ours, S3:     pushed to s3://, read cold (empty node-local cache: a batch's byte
  ranges are merged per shard, a batch needing most of a shard reads it whole and
  hands it to the cache, other shards are pulled into it in the background), and again
  with the cache disabled by a tiny limit (every batch reads merged byte ranges).
- baseline, local: torchvision.datasets.ImageFolder (PIL loader) + the tutorial
  transforms (Resize, flips, ColorJitter, ToTensor).
- baseline, S3: the same transforms over one object per image, listed and read
  through s3fs (`fs.find`, then `fs.open(path).read()` per image), as a naive user would.

Every pipeline reads each image once (one epoch, batch 32, no drop_last); the timer
covers building the dataset (listings included) to the last batch.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BATCH, WORKERS = 32, 2


def make_jpegs(root: Path, images: int, size: int) -> None:
    """Realistic inspection photos: the synthetic metal textures, saved as JPEG q90."""
    from PIL import Image

    from dtrain.data.synth import synthesize

    png = root.parent / "png"
    synthesize(png, images=images, size=size, seed=0)
    for path in png.rglob("*.png"):
        dest = root / path.relative_to(png).with_suffix(".jpg")
        dest.parent.mkdir(parents=True, exist_ok=True)
        Image.open(path).convert("RGB").save(dest, quality=90)
    shutil.rmtree(png)


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def baseline_transform(out: int):
    from torchvision import transforms as T

    return T.Compose([T.Resize((out, out)), T.RandomHorizontalFlip(), T.RandomVerticalFlip(),
                      T.ColorJitter(brightness=0.1, contrast=0.1), T.ToTensor()])


class S3ImageFolder(Dataset):
    """ImageFolder over s3fs: one listing, then one object read per image."""

    def __init__(self, url: str, transform) -> None:
        import s3fs

        self.url, self.transform = url, transform
        fs = s3fs.S3FileSystem()
        self.files = sorted(p for p in fs.find(url) if p.lower().endswith((".jpg", ".png")))
        self.classes = sorted({p.split("/")[-2] for p in self.files})
        self.fs = None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        from PIL import Image
        import s3fs

        if self.fs is None:  # one client per worker process
            self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        path = self.files[i]
        with self.fs.open(path, "rb") as f:
            img = Image.open(io.BytesIO(f.read())).convert("RGB")
        return self.transform(img), self.classes.index(path.split("/")[-2])


def timed(make_dataset, collate=None) -> tuple[float, int]:
    t0 = time.perf_counter()
    ds = make_dataset()
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS, collate_fn=collate,
                        generator=torch.Generator().manual_seed(0))
    n = sum(int(x.shape[0]) for x, _ in loader)
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=800)
    ap.add_argument("--size", type=int, default=384, help="side of the stored JPEGs")
    ap.add_argument("--out", type=int, default=224, help="side of the images delivered")
    ap.add_argument("--shard-size", default="8MB")
    args = ap.parse_args()

    from torchvision.datasets import ImageFolder

    from dtrain.data.config import DataConfig
    from dtrain.data.datasets import collate_skip_bad, open_split
    from dtrain.data.shard_push import parse_size, push
    from dtrain.data.storage import open_store

    work = Path(tempfile.mkdtemp(prefix="dtrain-bench-data-"))
    moto = None
    try:
        src = work / "jpeg"
        make_jpegs(src, args.images, args.size)
        train = src / "train"
        n_bytes = sum(p.stat().st_size for p in train.rglob("*.jpg"))
        n_img = len(list(train.rglob("*.jpg")))
        print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores shared)")
        print(f"data: {n_img} train JPEGs of {args.size} px, {n_bytes / 1e6:.1f} MB "
              f"(mean {n_bytes / n_img / 1e3:.0f} kB); delivered at {args.out} px, batch {BATCH}, {WORKERS} workers")

        moto, endpoint = start_moto()
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        import boto3

        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="bench")
        for p in train.rglob("*.jpg"):  # the naive layout: one object per image
            s3.upload_file(str(p), "bench", f"folder/{p.relative_to(src)}")
        size = parse_size(args.shard_size)
        push(DataConfig(root=str(src)), open_store(str(work / "shards")), size, splits=["train"])
        t0 = time.perf_counter()
        report = push(DataConfig(root=str(src)), open_store("s3://bench/shards"), size, splits=["train"])
        print(f"push to s3: {report.shards_total} shards, {report.bytes_uploaded / 1e6:.1f} MB "
              f"in {time.perf_counter() - t0:.1f} s")

        def ours(root: str, **extra):
            cfg = DataConfig(root=root, layout="shards", image_size=args.out, **extra)
            return lambda: open_split(cfg, "train", train=True)

        tf = baseline_transform(args.out)
        runs = [
            ("local", "baseline ImageFolder+PIL", lambda: ImageFolder(str(train), transform=tf), None),
            ("local", "dtrain shards", ours(str(work / "shards")), collate_skip_bad),
            ("s3", "baseline ImageFolder over s3fs", lambda: S3ImageFolder("bench/folder/train", tf), None),
            ("s3", "dtrain shards (cold cache)", ours("s3://bench/shards", cache_dir=str(work / "cache")), collate_skip_bad),
            ("s3", "dtrain shards (no cache: merged range GETs)",
             ours("s3://bench/shards", cache_dir=str(work / "nocache"), cache_limit_gb=1e-6), collate_skip_bad),
        ]
        results: dict[tuple[str, str], float] = {}
        for where, name, make, collate in runs:
            seconds, n = timed(make, collate)
            assert n == n_img, (name, n, n_img)
            results[(where, name)] = n / seconds
            print(f"  {where:5s} {name:46s} {n / seconds:8.1f} images/s  ({seconds:.1f} s)")
        print(f"load average at end: {os.getloadavg()[0]:.2f}")
        print("ratios (dtrain / baseline, same run):")
        for where, base in (("local", "baseline ImageFolder+PIL"), ("s3", "baseline ImageFolder over s3fs")):
            for (w, name), ips in results.items():
                if w == where and not name.startswith("baseline"):
                    print(f"  {where:5s} {name:46s} {ips / results[(where, base)]:.2f}x")
    finally:
        if moto is not None:
            moto.terminate()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
