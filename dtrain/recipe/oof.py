"""Out-of-fold P(defect) and the final model: k + 1 ordinary training runs, one after another.

Each fold is a folder of links (dtrain/recipe/folds.py) and a config that differs from
the final one in `data.root` and `epochs` only (the same images seen per run). The runs
go through `train(config_path)`, the quickstart's local DDP launch. They are
independent: on a cluster the k fold runs could run side by side, one job each
(DESIGN.md, "Evaluation"); on this machine they share its cores, so in sequence.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import yaml

from dtrain.data.config import DataConfig
from dtrain.evaluation.predict import Predictions
from dtrain.recipe.folds import assign_folds, link_split

HELD_OUT = "heldout"
SCORES = "heldout_scores.npz"  # a finished fold's class probabilities on its held-out images


def labelled(data: DataConfig):
    """Every labelled image outside the test split: (classes, paths, targets) of train + val."""
    from dtrain.data.layouts import scan

    train = scan(data, data.train_split)
    val = scan(data, data.val_split) if data.val_split else None
    paths, targets = list(train.paths), list(train.targets)
    if val is not None:
        paths += val.paths
        targets += val.targets
    return train.classes, paths, targets


def run_folds(
    cfg: dict[str, Any], data: DataConfig, k: int, epochs_for: Callable[[int], int], workdir: Path,
    train: Callable[[Path], Path], stream: TextIO, done: set[int] | None = None,
    on_done: Callable[[int], None] = lambda i: None,
) -> tuple[Predictions, dict[str, Any]]:
    """Train k fold models and score each one's held-out fold -> (out-of-fold predictions, the
    final model's config, not yet trained: its data root holds all of train + val).
    `epochs_for(n)`: a run's epochs for its n training images; `train(config)` -> its checkpoint.
    `done`: None for a fresh start (the folds folder is emptied); else the folds an unfinished
    run finished, whose held-out scores (SCORES in each fold's folder) are read back rather than
    trained again, while the other folds' run folders are kept for `train` to continue.
    `on_done(i)` once fold i's scores are saved."""
    from dtrain.data.mask_targets import mask_files
    from dtrain.evaluation.evaluate import load_scores, save_scores

    classes, paths, targets = labelled(data)
    # Pixel labels travel with the photos into the folders of links (folds.link_split).
    masks = mask_files(paths) if cfg.get("mask_loss") is not None else None
    folds = assign_folds(targets, k, int(cfg.get("seed", 0)))
    root = workdir / "folds"
    if done is None:
        shutil.rmtree(root, ignore_errors=True)
    chunks: list[Predictions] = []
    for i in range(k):
        fold_dir = root / f"fold{i}"
        inside = [j for j, f in enumerate(folds) if f != i]
        out = [j for j, f in enumerate(folds) if f == i]
        if done is not None and i in done and (fold_dir / SCORES).is_file():
            print(f"folds: fold {i + 1}/{k}: finished by the unfinished run, its held-out scores read back", file=stream)
            chunks.append(load_scores(fold_dir / SCORES))
            continue
        for split in ("train", HELD_OUT):  # links are cheap: drawn again (the same draw), the run folder kept
            shutil.rmtree(fold_dir / split, ignore_errors=True)
        link_split(fold_dir, "train", classes, [paths[j] for j in inside], [targets[j] for j in inside],
                   None if masks is None else [masks[j] for j in inside])
        link_split(fold_dir, HELD_OUT, classes, [paths[j] for j in out], [targets[j] for j in out])
        fold_cfg = run_config(cfg, fold_dir, epochs_for(len(inside)), fold_dir / "run")
        path = fold_dir / "train.yaml"
        path.write_text(yaml.safe_dump(fold_cfg, sort_keys=False))
        print(f"folds: fold {i + 1}/{k}: training on {len(inside)} images, {len(out)} held out "
              f"({fold_cfg['epochs']} epochs)", file=stream)
        chunks.append(predict_held_out(train(path), fold_dir))
        save_scores(fold_dir / SCORES, chunks[-1])
        on_done(i)
    all_dir = root / "all"
    shutil.rmtree(all_dir, ignore_errors=True)
    link_split(all_dir, "train", classes, paths, targets, masks)
    oof = Predictions(
        probs=np.concatenate([c.probs for c in chunks]),
        targets=np.concatenate([c.targets for c in chunks]),
        paths=[p for c in chunks for p in c.paths],
        bad_files=[p for c in chunks for p in c.bad_files],
    )
    return oof, run_config(cfg, all_dir, epochs_for(len(paths)), Path(cfg["output_dir"]))


def run_config(cfg: dict[str, Any], root: Path, n_epochs: int, output_dir: Path) -> dict[str, Any]:
    """The recipe's config on a linked folder: its own data root (ImageFolder, train split
    and no val split: a fold's held-out part is predicted after training) and epochs."""
    out = copy.deepcopy(cfg)
    # test_split stays: `dtrain eval CHECKPOINT DATA --threshold-scores` reads it from the checkpoint.
    out["data"].update(root=str(root), layout="imagefolder", category=None, train_split="train", val_split="",
                       val_from_train=0.0)
    out.update(epochs=n_epochs, output_dir=str(output_dir))
    return out


def predict_held_out(checkpoint: Path, fold_dir: Path) -> Predictions:
    """The fold model's class probabilities on its held-out images, named by the original files."""
    import torch

    from dtrain.data.datasets import open_split
    from dtrain.evaluation.predict import predict_split
    from dtrain.train.checkpoint import load_for_inference

    model, meta = load_for_inference(str(checkpoint), map_location="cpu")
    from dtrain.train.checkpoint import input_fields

    cfg = DataConfig(root=str(fold_dir), **input_fields(meta), val_split="", test_split="",
                     negative_class=meta["negative_class"])
    ds = open_split(cfg, HELD_OUT, train=False)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pred = predict_split(model, ds, mean=meta["mean"], std=meta["std"], device=dev)
    pred.paths = [os.readlink(p) for p in pred.paths]
    pred.bad_files = [os.readlink(p) for p in pred.bad_files]
    return pred
