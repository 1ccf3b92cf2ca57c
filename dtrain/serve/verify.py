"""The images an export is checked and calibrated on, and the check itself.

The validation split is read once into memory as the networks' own input (uint8
[N, 3, S, S]); the checkpoint and every exported backend then see exactly the same bytes.
A checkpoint trained without a validation split (the final model of a k-fold quickstart,
trained on train + val) is verified, when its threshold is given, on the val split of
--data, or else on its own training images: whether the backends agree with the
checkpoint needs no held-out images; choosing a threshold would.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.data.decode import FULL_BITS
from dtrain.errors import DtrainError
from dtrain.passes import images_per_pass
from dtrain.serve.model_dir import Verification

DECODE_THREADS = 4
NO_VAL_HINT = ("pass --data ROOT: a data set with the model's classes (its val split, e.g. the images given to "
               "`dtrain quickstart --data`), to verify the backends on")


@dataclass
class ValData:
    images: np.ndarray  # uint8 [N, 3, S, S]
    labels: np.ndarray  # int64 [N]
    split: str
    data_cfg: Any  # the DataConfig the split came from
    note: str = ""  # what a reader must know about these images (not held out), for model.json


def data_config(root: str | None, meta: dict[str, Any]):
    """The training run's data settings, at `root` if given, at the model's image size."""
    from dtrain.evaluation.run_data import run_data_config

    cfg = run_data_config(meta, None if root is None else str(root))
    if "://" not in cfg.root and not Path(cfg.root).is_dir():
        raise DtrainError(f"data directory not found: {cfg.root}",
                          "pass the data set root with --data DIR" if cfg.val_split else NO_VAL_HINT)
    return cfg


def load_val(root: str | None, meta: dict[str, Any], *, choosing: bool = True) -> ValData:
    """The images to verify on: the validation split; `choosing`: the threshold is chosen on them."""
    from dtrain.data.config import DataConfig
    from dtrain.data.datasets import open_split

    cfg = data_config(root, meta)
    split, note = cfg.val_split, ""
    if not split:
        if choosing:
            raise DtrainError(
                "the checkpoint was trained without a validation split (a k-fold quickstart's final model: on train + val), so the "
                "export has no held-out images to choose the threshold on",
                "take the threshold the quickstart chose: --threshold-from WORKDIR/report.json (or --threshold P)",
            )
        split = DataConfig.model_fields["val_split"].default if root is not None else cfg.train_split
        trained_on = f"its training images ({split!r} split of {cfg.root})" if root is None else f"the {split!r} split of {cfg.root}"
        note = (f"the checkpoint was trained without a validation split (as a k-fold quickstart's final model is, on "
                f"train + val): agreement and miss rate are "
                f"measured on {trained_on}; agreement between backends needs no held-out images, and the threshold "
                f"was not chosen on them")
    ds = open_split(cfg, split, train=False)
    if list(ds.classes) != list(meta["classes"]):
        raise DtrainError(f"the data set's classes {list(ds.classes)} differ from the model's {list(meta['classes'])}",
                          "verify on the data set the model was trained on (--data)")
    with ThreadPoolExecutor(max_workers=DECODE_THREADS) as pool:  # decoders release the GIL
        samples = [s for s in pool.map(ds.__getitem__, range(len(ds))) if s is not None]
    if not samples:
        raise DtrainError(f"the {split!r} split of {cfg.root} has no readable images", "the export verifies on it; check --data")
    images = np.stack([s[0].numpy() for s in samples])
    labels = np.array([int(s[1]) for s in samples], dtype=np.int64)
    return ValData(images=images, labels=labels, split=split, data_cfg=cfg, note=note)


def reference_logits(wrapped, images: np.ndarray, views: int) -> np.ndarray:
    """The checkpoint's own fp32 logits on the CPU, the yardstick for every backend; in
    passes of at most CPU_PASS pictures, each image's `views` counted (dtrain/passes.py)."""
    import torch

    step = images_per_pass(views, gpu=False)
    out = []
    with torch.inference_mode():
        for i in range(0, len(images), step):
            out.append(wrapped(torch.from_numpy(images[i : i + step])).float().numpy())
    return np.concatenate(out)


def verify_backend(logits: np.ndarray, val: ValData, ref_logits: np.ndarray, negative_index: int | None, threshold: float,
                   own_threshold: float | None = None) -> Verification:
    """A backend's validation logits against the checkpoint's: the checkpoint decides at
    `threshold`, the backend at `own_threshold` (default: the same)."""
    from dtrain.evaluation.metrics import false_alarm_rate, miss_rate, p_defect
    from dtrain.serve.predictor import softmax64

    own = threshold if own_threshold is None else own_threshold
    probs_ref, probs = softmax64(ref_logits), softmax64(logits)
    p_ref, p = p_defect(probs_ref, negative_index), p_defect(probs, negative_index)
    if negative_index is None:  # a classifier: its verdict is the class (P(defect) is 1)
        is_defect = np.ones(len(p), bool)
        agreement = float(np.mean(probs.argmax(1) == probs_ref.argmax(1)))
        diff = float(np.max(np.abs(probs - probs_ref)))
    else:
        is_defect = val.labels != negative_index
        agreement = float(np.mean((p >= own) == (p_ref >= threshold)))
        diff = float(np.max(np.abs(p - p_ref)))
    return Verification(
        split=val.split,
        n_images=len(p),
        n_defective=int(is_defect.sum()),
        verdict_agreement=agreement,
        max_abs_p_defect_diff=diff,
        miss_rate=miss_rate(p, is_defect, own).rate,
        false_alarm_rate=false_alarm_rate(p, is_defect, own).rate,
        threshold=own,
    )


def describe_disagreement(name: str, p: np.ndarray, p_ref: np.ndarray, is_defect: np.ndarray, threshold: float,
                          own: float, needed: float) -> str:
    """Why a backend's validation verdicts left the checkpoint's, for the export's notes:
    which way they flipped, how far it moves scores, and how crowded the threshold is.

    On the networks measured (BENCHMARKS.md, "Session 9"), int8 moves each score's odds by
    ~25 % whatever the quantiser settings; the flips are OK parts that sit near the
    threshold, so their number, not the quantiser, decides the agreement.
    """
    mine, ref = p >= own, p_ref >= threshold
    n, differ = len(p), int(np.sum(mine != ref))
    rejects = int(np.sum(mine & ~ref))
    allowed = int(np.floor((1 - needed) * n + 1e-9))

    def log_odds(x):
        x = np.clip(np.asarray(x, dtype=np.float64), 1e-12, 1 - 1e-12)
        return np.log(x) - np.log1p(-x)

    moved = float(np.exp(np.sqrt(np.mean((log_odds(p) - log_odds(p_ref)) ** 2))))
    crowded = int(np.sum(~is_defect & (np.abs(log_odds(p_ref) - log_odds(threshold)) < np.log(3))))
    return (f"{name} not chosen: its verdicts differ from the checkpoint's on {differ} of {n} validation images "
            f"({allowed} may for {needed:.1%} agreement): it rejects {rejects} the checkpoint passes and passes "
            f"{differ - rejects} it rejects. It moves a score's odds by a factor {moved:.2f} (root mean square), and "
            f"{crowded} OK parts score within a factor 3 of the threshold: a network with fewer OK parts that close "
            f"(trained on more distinct images) keeps its verdicts under {name}; to ship it anyway: --backends {name}")


def calibration_sample(images: np.ndarray, limit: int, seed: int = 0) -> np.ndarray:
    """The default int8 calibration set: a fixed random sample of up to `limit` of the
    validation images (already in memory; only activation ranges are taken from them)."""
    order = np.random.default_rng(seed).permutation(len(images))[:limit]
    return np.ascontiguousarray(images[np.sort(order)])


def calibration_images(source: str, size: tuple[int, int], limit: int, seed: int = 0, sample_bits: int = FULL_BITS) -> np.ndarray:
    """Up to `limit` images to calibrate int8 on, from files under `source` (directories, globs);
    `size`: the input's (rows, columns)."""
    from dtrain.serve.images import ImageRejected, prepare_file
    from dtrain.serve.inspect_batch import collect_inputs

    paths = collect_inputs([source])
    random.Random(seed).shuffle(paths)
    out = []
    for path in paths:
        try:
            out.append(prepare_file(path, size, sample_bits=sample_bits))
        except (ImageRejected, OSError):
            continue  # an unreadable calibration file is no reason to stop
        if len(out) == limit:
            break
    return np.stack(out) if out else np.zeros((0, 3, *size), np.uint8)
