"""Checkpoints: the on-disk contract, atomic writes, resume and inference loading.

`OUTPUT/checkpoints/ckpt-epochNNNN.pt` after each checkpointed epoch and `last.pt`, the
newest, which `--resume` reads. One torch.save'd dict with the keys below. Files are
written to a temporary name and renamed, so a process killed mid-write never leaves a
torn `last.pt` behind, and `--resume` removes what a killed writer left (`.last.pt.tmp-PID`).

Checkpoints hold tensors and plain Python values only (the RNG states too, see
`rng_state`), and every checkpoint dtrain reads is loaded with `weights_only=True`
(`load_weights_only`): a .pt file is a pickle, and a pickle that holds anything else
could run code when loaded, so such a file is refused with one line and nothing of it runs.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dtrain.errors import DtrainError
from dtrain.models.config import SCORE_CLASSIFIER, SCORE_POOLED, ModelConfig

LAST = "last.pt"
BEST = "best.pt"  # the lowest validation loss so far (TrainConfig.keep_best)
# Keys every checkpoint holds (the contract other parts of dtrain read).
KEYS = (
    "model", "optimizer", "scheduler", "scaler", "epoch", "step", "step_in_epoch", "rng",
    "config", "classes", "negative_class", "image_size", "mean", "std", "world_size", "run",
)
# What --resume needs ("run" came later: older checkpoints lack it), and what inference
# needs (export, eval).
RESUME_KEYS = tuple(k for k in KEYS if k != "run")
INFERENCE_KEYS = ("model", "config", "classes", "negative_class", "image_size", "mean", "std", "epoch", "step")


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def epoch_name(epoch: int) -> str:
    return f"ckpt-epoch{epoch:04d}.pt"


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (what weights_only loads)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"] = {"key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                            "pos": int(numpy_state["state"]["pos"])}
    state = {
        "torch": torch.get_rng_state(),
        "numpy": numpy_state,
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {"key": state["numpy"]["state"]["key"].numpy().astype(np.uint32),
                            "pos": state["numpy"]["state"]["pos"]}
    np.random.set_state(numpy_state)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
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


def load_weights_only(path: Path, what: str = "checkpoint", error: type[DtrainError] = DtrainError) -> Any:
    """torch.load with weights_only=True; a file holding other Python objects is refused
    (one line, and none of it runs), a damaged one named as such."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch names a class or function it would have had to call ("Unsupported global");
        # any other refusal of its weights-only unpickler is a file that is no torch.save
        # output at all (damaged, truncated, random bytes), which the old message called code.
        if "Unsupported global" not in str(exc):
            raise error(f"cannot read the {what} {path}: it is not a file torch.save wrote, or it is damaged "
                        "(nothing in it was run)", "pass a last.pt / ckpt-epochNNNN.pt written by dtrain train") from None
        raise error(f"refused to load {path}: the {what} holds Python objects besides tensors and plain values, "
                    "which could run code when loaded; dtrain loads only weights-only files such as dtrain train writes") from None
    except Exception as exc:  # several exception types for a damaged or foreign file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(f"cannot read the {what} {path}: {first}", "pass a last.pt / ckpt-epochNNNN.pt written by dtrain train") from None


def load(path: str | Path, *, require: tuple[str, ...] = RESUME_KEYS) -> dict[str, Any]:
    """A dtrain checkpoint that holds at least the keys `require`."""
    path = Path(path)
    if not path.is_file():
        raise DtrainError(f"checkpoint not found: {path}", "train first, or check the path")
    blob = load_weights_only(path)
    missing = [k for k in require if k not in blob] if isinstance(blob, dict) else list(require)
    if missing:
        raise DtrainError(f"{path} is not a complete dtrain checkpoint: it has no {', '.join(missing)}",
                          "pass a last.pt / ckpt-epochNNNN.pt from OUTPUT/checkpoints/ of dtrain train")
    if "config" in require and not isinstance(blob["config"].get("model") if isinstance(blob["config"], dict) else None, dict):
        raise DtrainError(f"{path} is not a complete dtrain checkpoint: its config has no model section",
                          "pass a last.pt / ckpt-epochNNNN.pt from OUTPUT/checkpoints/ of dtrain train")
    return blob


def find_resume(output_dir: str | Path) -> Path | None:
    last = checkpoint_dir(output_dir) / LAST
    return last if last.is_file() else None


def remove_stale_temporaries(output_dir: str | Path) -> list[Path]:
    """Delete the `.NAME.tmp-PID` files a killed writer left (call before writing again)."""
    stale = sorted(checkpoint_dir(output_dir).glob(".*.tmp-*"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def load_for_inference(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """The trained network in eval mode, and what is needed to feed it and read it."""
    from dtrain.models import ModelConfig, build_model
    from dtrain.models.views import with_views

    ckpt = load(path, require=INFERENCE_KEYS)
    model_cfg = ModelConfig.model_validate({**ckpt["config"]["model"], "pretrained": None})
    model = build_model(model_cfg, len(ckpt["classes"]))
    model.load_state_dict(ckpt["model"])
    pooled = pooled_score(model, model_cfg, ckpt)
    model = pooled if pooled is not None else model
    # Every consumer of a trained network scores it alike, on the views it was trained for.
    model = with_views(model, model_cfg.views)
    model.to(map_location).eval()
    meta = {k: ckpt[k] for k in ("classes", "negative_class", "image_size", "mean", "std", "config")}
    # "run": what trained it (dtrain.train.facts); absent in checkpoints before it existed.
    meta.update(epoch=ckpt["epoch"], step=ckpt["step"], run=ckpt.get("run"))
    meta["image_width"] = ckpt.get("image_width")  # absent before inputs could be rectangles: a square
    meta["score"] = SCORE_POOLED if pooled is not None else SCORE_CLASSIFIER
    return model, meta


def pooled_score(model: nn.Module, model_cfg: ModelConfig, ckpt: dict[str, Any]) -> nn.Module | None:
    """The classifier with its trained mask head pooled into P(defect)
    (dtrain/models/defect_score.py), where the checkpoint has a head and a defect-free
    class and model.score_with_mask allows it; else None."""
    from dtrain.models.build import NORMS
    from dtrain.models.defect_score import PooledDefectScore
    from dtrain.models.mask_head import with_mask_head

    negative = ckpt.get("negative_class")
    if not model_cfg.score_with_mask or "mask_head" not in ckpt or negative is None:
        return None
    scored = with_mask_head(model, NORMS[model_cfg.norm])
    scored.head.load_state_dict(ckpt["mask_head"])
    return PooledDefectScore(scored, list(ckpt["classes"]).index(negative), len(ckpt["classes"]))


def input_fields(meta: dict) -> dict:
    """The DataConfig fields that say how a loaded checkpoint's input is prepared
    (load_for_inference's meta): its size and the training data's sample_bits."""
    return {"image_size": int(meta["image_size"]), "image_width": meta.get("image_width"),
            "sample_bits": sample_bits(meta)}


def sample_bits(meta: dict) -> int:
    """The training data's DataConfig.sample_bits (16 in checkpoints from before it existed)."""
    from dtrain.data.decode import FULL_BITS

    return int(((meta.get("config") or {}).get("data") or {}).get("sample_bits", FULL_BITS))


def input_hw(meta: dict) -> tuple[int, int]:
    """(rows, columns) of a loaded checkpoint's input (load_for_inference's meta)."""
    from dtrain.data.config import input_hw as hw

    return hw(meta["image_size"], meta.get("image_width"))
