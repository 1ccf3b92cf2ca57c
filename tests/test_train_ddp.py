"""Real multi-process training on CPU (gloo): DDP equivalence, resume after SIGKILL,
and the plain `torchrun` entry. Tiny images (16 px) and a few steps keep them quick."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from stall_hook import stall_env

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600


def write_config(path: Path, data_root: Path, output_dir: Path, **top) -> Path:
    cfg = {
        "data": {"root": str(data_root), "image_size": 16, "num_workers": 0, "augment": False},
        "model": {"arch": "resnet18"},
        "optim": {"name": "adamw", "lr": 1e-3, "warmup_steps": 2},
        "precision": "fp32",
        "device": "cpu",
        "threads": 1,
        "log_every": 5,
        "output_dir": str(output_dir),
    }
    for key, value in top.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def small_copy(src: Path, dst: Path, per_class: dict[str, int]) -> Path:
    """A smaller data set of symlinks into `src`: the first n files of every class."""
    for split, n in per_class.items():
        for cls in sorted((src / split).iterdir()):
            (dst / split / cls.name).mkdir(parents=True)
            for f in sorted(cls.iterdir())[:n]:
                (dst / split / cls.name / f.name).symlink_to(f)
    return dst


def write_masks(root: Path, seed: int = 0, size: int = 32, difficulty: float = 0.5) -> None:
    """Beside every defective picture of a copy of synth_data, its defect mask, as
    `dtrain data synth --masks` writes it (the fixture's seed, size and difficulty)."""
    from PIL import Image

    from dtrain.data.synth import CLASSES, SPLITS, defect_mask, render_image

    for photo in sorted(root.glob("*/*/*.png")):
        split, cls = photo.parent.parent.name, photo.parent.name
        if cls == "ok":
            continue
        args = (seed, SPLITS.index(split), CLASSES.index(cls), int(photo.stem.split("_")[1]), size, difficulty)
        mask = defect_mask(render_image(*args), render_image(*args, with_defect=False))
        Image.fromarray(mask).save(photo.with_name(f"{photo.stem}_mask.png"))


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def final_state(output_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(output_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((x.double() - b[k].double()).abs().max().item() for k, x in a.items() if x.numel())


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_process_with_double_batch(synth_data, tmp_path):
    """2 ranks x batch 8 (under plain torchrun) == 1 process x batch 16, after 4 steps.

    Why they must be equal: the same seed gives both the same initial weights; the
    DistributedSampler permutes the same way for any world size (seed + epoch), and rank
    r takes positions r, r+2, ..., so each global step's 16 samples are the same set;
    DDP averages the two ranks' mean-loss gradients, which is the 16-sample mean. What
    would break it is excluded: no augmentation, GroupNorm instead of BatchNorm (batch
    statistics would differ per 8-sample half), fp32, drop_last so no ragged batch, and
    SGD: Adam divides by sqrt(v), which turns the float rounding differences of two
    summation orders into lr-sized steps for near-zero gradients (measured: 3e-5 after
    4 steps). Only the summation order differs, hence the 1e-5 tolerance.
    """
    common = dict(model={"norm": "group"}, optim={"name": "sgd", "lr": 0.05}, max_steps=4, epochs=1)
    two = write_config(tmp_path / "two.yaml", synth_data, tmp_path / "two", batch_size=8, **common)
    one = write_config(tmp_path / "one.yaml", synth_data, tmp_path / "one", batch_size=16, **common)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = run(torchrun + ["-m", "dtrain.train", str(two)])
    assert "world 2 on cpu" in out.stderr + out.stdout
    run([sys.executable, "-m", "dtrain.train", str(one)])
    a, b = final_state(tmp_path / "two"), final_state(tmp_path / "one")
    assert a["step"] == b["step"] == 4 and a["world_size"] == 2 and b["world_size"] == 1
    assert max_diff(a["model"], b["model"]) <= 1e-5
    # ... and training moved the weights far more than that, so the check has teeth.
    assert max_diff(_fresh_weights(), b["model"]) > 1e-3


def _fresh_weights() -> dict[str, torch.Tensor]:
    from dtrain.models import ModelConfig, build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(norm="group"), 6).state_dict()


def _kill_tree(proc: subprocess.Popen) -> None:
    parent = psutil.Process(proc.pid)
    for p in parent.children(recursive=True) + [parent]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [False, True], ids=["plain", "recipe-options"])
def test_resume_after_sigkill_matches_an_uninterrupted_run(synth_data, tmp_path, dtrain_cmd, recipe):
    """`dtrain train --nproc 2` checkpointing every 4 steps (6 steps per epoch), every
    process SIGKILLed while the ranks wait after step 9 (tests/stall_hook.py, so the
    kill lands at a known point), then `--resume` from the mid-epoch checkpoint of step 8:
    the final weights equal an uninterrupted run's (CPU fp32).

    With augmentation on, a DataLoader worker per rank and BatchNorm: resume has to
    restore model, optimizer, scheduler, epoch/step and RNG, skip the samples the epoch
    already trained on, and the per-sample seeded augmentation must not depend on worker
    history. `recipe-options`: what `quickstart --data` adds (class-weighted sampling with
    replacement, per-image standardisation, avg+max pooling, the weight average, the mask head
    on masks beside the photos, defects transplanted onto good parts; and mixup, an option) resumes as exactly.
    """
    data = small_copy(synth_data, tmp_path / "data", {"train": 16, "val": 4})
    extra = dict(epochs=2, batch_size=8, checkpoint_every_steps=4, data={"augment": True, "num_workers": 1})
    if recipe:
        extra["data"]["sampling"] = "sqrt_inverse"
        extra["model"] = {"arch": "resnet18", "input_norm": "per_image", "pool": "avgmax"}
        extra["ema_decay"] = 0.9  # the average of the weights and its update count resume too
        extra["mixup_alpha"] = 0.4  # blends drawn per (rank, step): a resumed run mixes as the uninterrupted one
        extra["mask_loss"] = 1.0  # the mask head's weights and optimiser state resume too
        extra["data"]["transplant"] = 0.5  # defects laid on good parts, drawn per sample: the same after resume
        write_masks(data)
    full = write_config(tmp_path / "full.yaml", data, tmp_path / "full", **extra)
    killed = write_config(tmp_path / "killed.yaml", data, tmp_path / "killed", **extra)
    run(dtrain_cmd + ["train", str(full), "--nproc", "2"])

    log = tmp_path / "killed.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(dtrain_cmd + ["train", str(killed), "--nproc", "2"], cwd=REPO, stdout=fh,
                                stderr=subprocess.STDOUT, env=stall_env(tmp_path / "stall", 9))
    try:
        deadline = time.monotonic() + TIMEOUT
        while log.read_text(errors="replace").count("stalled after step 9") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        _kill_tree(proc)
    interrupted = final_state(tmp_path / "killed")
    assert (interrupted["epoch"], interrupted["step_in_epoch"], interrupted["step"]) == (1, 2, 8)

    out = run(dtrain_cmd + ["train", str(killed), "--nproc", "2", "--resume"])
    assert "resumed from" in out.stderr + out.stdout
    a, b = final_state(tmp_path / "full"), final_state(tmp_path / "killed")
    assert a["epoch"] == b["epoch"] == 2 and a["step"] == b["step"] == 12
    assert max_diff(a["model"], b["model"]) <= 1e-6
    assert max_diff(a["model"], interrupted["model"]) > 1e-3
    if recipe:  # "model" is the average, "live_model" the trained weights: both resumed
        assert a["ema_updates"] == b["ema_updates"] == 12
        assert max_diff(a["live_model"], b["live_model"]) <= 1e-6
        assert max_diff(a["model"], a["live_model"]) > 1e-4
        assert max_diff(a["mask_head"], b["mask_head"]) <= 1e-6
        assert max_diff(a["mask_head"], interrupted["mask_head"]) > 1e-3


@pytest.mark.slow
def test_batches_of_only_unreadable_images_do_not_stop_ddp_training(synth_data, tmp_path, dtrain_cmd):
    """One readable training image among 12 (2 per class), 2 ranks x batch 2, BatchNorm:
    most steps have an empty batch on one rank or both (collate_skip_bad drops every
    image), and once per epoch exactly one rank has the good image. The empty rank must
    still join the step's gradient all-reduce (or the ranks hang) and BatchNorm must not
    see an empty batch. Every val image is unreadable too: evaluation skips them."""
    data = tmp_path / "data"
    small_copy(synth_data, data, {"train": 2, "val": 1})
    files = sorted((data / "train").rglob("*.png")) + sorted((data / "val").rglob("*.png"))
    for f in files[1:]:
        f.unlink()
        f.write_bytes(b"not an image")
    # 64 px: a one-image batch still has 2x2 values per channel at ResNet's last BatchNorm.
    cfg = write_config(tmp_path / "bad.yaml", data, tmp_path / "out", epochs=2, batch_size=2, data={"image_size": 64})
    out = run(dtrain_cmd + ["train", str(cfg), "--nproc", "2"])
    assert "skipping unreadable image" in out.stderr
    state = final_state(tmp_path / "out")
    assert (state["epoch"], state["step"]) == (2, 2 * 3)  # 6 images per rank: 3 steps per epoch
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    torch.manual_seed(0)
    from dtrain.models import ModelConfig, build_model

    fresh = build_model(ModelConfig(), 6).state_dict()
    assert max_diff(fresh, state["model"]) > 1e-4  # the one good image was trained on


@pytest.mark.slow
def test_ranks_die_with_a_sigkilled_launcher(synth_data, tmp_path, dtrain_cmd):
    """torch's elastic agent gives every rank its own session: without the ranks' own
    watch, SIGKILL of `dtrain train` alone would leave them training as orphans."""
    cfg = write_config(tmp_path / "cfg.yaml", synth_data, tmp_path / "out", epochs=1, batch_size=8)
    log = tmp_path / "log.txt"
    with open(log, "wb") as fh:  # the ranks wait after step 1 until killed (stall_hook)
        proc = subprocess.Popen(dtrain_cmd + ["train", str(cfg), "--nproc", "2"], cwd=REPO, stdout=fh,
                                stderr=subprocess.STDOUT, env=stall_env(tmp_path / "stall", 1))
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while log.read_text(errors="replace").count("stalled after step 1") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) >= 2
        proc.send_signal(signal.SIGKILL)  # the launcher only
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"orphaned ranks still running: {alive}"
    finally:
        for p in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow  # a `dtrain train` process (torch + torchvision imports): ~6 s CPU, ~15-22 s on the loaded 2-core machine
@pytest.mark.parametrize("entry", ["cli", "module"])
def test_misspelt_config_key_names_it_and_the_closest_valid_key(tmp_path, dtrain_cmd, entry):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("optim:\n  lrr: 0.1\nbatch_size: 4\n")
    argv = dtrain_cmd + ["train", str(cfg)] if entry == "cli" else [sys.executable, "-m", "dtrain.train", str(cfg)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 3
    assert "optim.lrr" in proc.stderr and "'optim.lr'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # a `dtrain train` process: ~6 s CPU, ~15-30 s on the loaded 2-core machine
def test_misspelt_override_via_set(dtrain_cmd):
    proc = subprocess.run(dtrain_cmd + ["train", "--set", "bach_size=4"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 3 and "'batch_size'" in proc.stderr and "Traceback" not in proc.stderr
