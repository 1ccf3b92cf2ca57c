"""Batched, gradient-free class probabilities for every image of a data set split."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dtrain.models.views import ViewAverage
from dtrain.passes import images_per_pass


@dataclass
class Predictions:
    """Softmax probabilities [N, C] and true labels [N] of the readable images of a split."""

    probs: np.ndarray
    targets: np.ndarray
    paths: list[str]
    bad_files: list[str]

    def __len__(self) -> int:
        return len(self.targets)


class _Indexed(Dataset):
    """Keeps each sample's index so predictions can be traced back to files even
    though unreadable images are dropped from the batch."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        return i, self.ds[i]


def _collate(batch: Sequence[tuple[int, tuple[torch.Tensor, int] | None]]):
    kept = [(i, s) for i, s in batch if s is not None]
    if not kept:
        return len(batch), None, None, None
    idx = torch.tensor([i for i, _ in kept], dtype=torch.int64)
    images = torch.stack([s[0] for _, s in kept])
    labels = torch.tensor([int(s[1]) for _, s in kept], dtype=torch.int64)
    return len(batch), idx, images, labels


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float], channels_last: bool) -> torch.Tensor:
    """uint8 [B, 3, S, S] -> float, with the statistics stored in the checkpoint (0..1 units)."""
    m = torch.tensor(mean, dtype=torch.float32, device=images.device).view(1, -1, 1, 1) * 255.0
    s = torch.tensor(std, dtype=torch.float32, device=images.device).view(1, -1, 1, 1) * 255.0
    x = (images.float() - m) / s
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@torch.no_grad()
def predict_split(
    model: torch.nn.Module,
    dataset: Dataset,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    num_workers: int = 1,
    progress: Callable[[int], None] | None = None,
) -> Predictions:
    """Run `model` (already in eval mode) over `dataset`; `progress(n)` after each batch of n images."""
    device = torch.device(device)
    # channels_last is the fast layout for convolutions on both CPU (oneDNN) and GPU.
    channels_last = True
    model = model.to(device).to(memory_format=torch.channels_last)
    loader = DataLoader(
        _Indexed(dataset),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_collate,
        pin_memory=device.type == "cuda",
    )
    n = len(dataset)  # type: ignore[arg-type]
    views = next((m.n for m in model.modules() if isinstance(m, ViewAverage)), 1)
    # The loader's batches (256 images) are cut into passes of at most CPU_PASS / GPU_PASS
    # pictures, views counted (dtrain/passes.py); on a CPU small passes are also faster per
    # picture (14.7 ms a view at 16 vs 19-20 ms at 64-128, 384 px, Xeon with AMX, session 31).
    step = images_per_pass(views, device.type == "cuda")
    chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for attempted, idx, images, labels in loader:
        if idx is not None:
            x = normalize(images.to(device, non_blocking=True), mean, std, channels_last)
            logits = torch.cat([model(x[i:i + step]).float() for i in range(0, x.shape[0], step)])
            p = torch.softmax(logits, dim=1).cpu().numpy()
            chunks.append((idx.numpy(), p, labels.numpy()))
        if progress is not None:
            progress(attempted)
    all_paths = list(getattr(dataset, "paths", [str(i) for i in range(n)]))
    bad = list(getattr(dataset, "bad_files", []))
    if chunks:
        idx = np.concatenate([c[0] for c in chunks])
        probs = np.concatenate([c[1] for c in chunks])
        targets = np.concatenate([c[2] for c in chunks])
    else:
        idx = np.zeros(0, dtype=np.int64)
        probs = np.zeros((0, 0), dtype=np.float32)
        targets = np.zeros(0, dtype=np.int64)
    # With worker processes the dataset copy in the main process never saw the bad
    # files; the indices that did not come back are exactly those.
    missing = sorted(set(range(n)) - set(idx.tolist()))
    bad = sorted(set(bad) | {all_paths[i] for i in missing})
    return Predictions(probs=probs, targets=targets, paths=[all_paths[i] for i in idx], bad_files=bad)
