"""Checkpoints: the on-disk contract, atomic writes, resume and inference loading.

`OUTPUT/checkpoints/ckpt-epochNNNN.pt` after each checkpointed epoch and `last.pt`, the
newest, which `--resume` reads. One torch.save'd dict with the keys below. Files are
written to a temporary name and renamed, so a process killed mid-write never leaves a
torn `last.pt` behind.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dtrain.errors import DtrainError

LAST = "last.pt"
BEST = "best.pt"  # the lowest validation loss so far (TrainConfig.keep_best)
# Keys every checkpoint holds (the contract other parts of dtrain read).
KEYS = (
    "model", "optimizer", "scheduler", "scaler", "epoch", "step", "step_in_epoch", "rng",
    "config", "classes", "negative_class", "image_size", "mean", "std", "world_size", "run",
)


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def epoch_name(epoch: int) -> str:
    return f"ckpt-epoch{epoch:04d}.pt"


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary sibling, fsync, rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def publish_last(src: Path, name: str = LAST) -> Path:
    """Point `last.pt` (or `name`) at `src` atomically: a hard link when the filesystem has them."""
    last = src.with_name(name)
    if src == last:
        return last
    tmp = src.with_name(f".{name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # e.g. some network mounts: fall back to a copy
        shutil.copyfile(src, tmp)
    os.replace(tmp, last)
    return last


def save(payload: dict[str, Any], output_dir: str | Path, *, epoch_end: bool, keep: int = 3) -> Path:
    """Write a checkpoint; at an epoch end also keep it as ckpt-epochNNNN.pt (the newest
    `keep` of those stay)."""
    missing = [k for k in KEYS if k not in payload]
    assert not missing, f"checkpoint payload lacks {missing}"
    folder = checkpoint_dir(output_dir)
    target = folder / (epoch_name(payload["epoch"]) if epoch_end else LAST)
    atomic_save(payload, target)
    last = publish_last(target)
    for old in sorted(folder.glob("ckpt-epoch*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return last


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise DtrainError(f"checkpoint not found: {path}", "train first, or check the path")
    try:
        # Our own files hold numpy RNG state and plain config dicts, so not weights_only.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # several exception types for a damaged or foreign file
        raise DtrainError(f"cannot read checkpoint {path}: {exc}", "pass a last.pt / ckpt-epochNNNN.pt written by dtrain train") from None


def find_resume(output_dir: str | Path) -> Path | None:
    last = checkpoint_dir(output_dir) / LAST
    return last if last.is_file() else None


def load_for_inference(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """The trained network in eval mode, and what is needed to feed it and read it."""
    from dtrain.models import ModelConfig, build_model

    ckpt = load(path)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "classes" not in ckpt:
        raise DtrainError(f"{path} is not a dtrain checkpoint (no model/classes)", "pass a file from OUTPUT/checkpoints/")
    model_cfg = ModelConfig.model_validate({**ckpt["config"]["model"], "pretrained": None})
    model = build_model(model_cfg, len(ckpt["classes"]))
    model.load_state_dict(ckpt["model"])
    model.to(map_location).eval()
    meta = {k: ckpt[k] for k in ("classes", "negative_class", "image_size", "mean", "std", "config")}
    # "run": what trained it (dtrain.train.facts); absent in checkpoints before it existed.
    meta.update(epoch=ckpt["epoch"], step=ckpt["step"], run=ckpt.get("run"))
    return model, meta
