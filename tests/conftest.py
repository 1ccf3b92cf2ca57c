"""Shared fixtures. Tests run real processes (gloo on CPU); nothing here mocks torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from shared_once import once

REPO = Path(__file__).resolve().parents[1]

# The multi-host harness: the session fixture `netns_cluster` (owner: cluster).
pytest_plugins = ["tests.netns", "tests.slurm", "tests.s3", "tests.ec2", "tests.deploy_fixtures"]

# End to end by what they need, so every such test is `slow` (left out of the fast loop
# `./dev test -m "not slow"`) without each file saying so: the `netns` hosts (three
# namespaces with sshd; every step is an ssh round trip, ~3-8 s a test on the loaded 2-core
# machine), a moto server process (the 22 EC2 tests took ~40 s on the loaded machine), and the
# model of a real training run and its ONNX export (~25 s CPU, ~90 s on the loaded machine).
SLOW_FIXTURES = frozenset({"netns_cluster", "slurm_cluster", "s3_server", "ec2_server",
                           "trained_checkpoint", "exported_model", "checkpoint_test_scores"})


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("netns") or SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def dtrain_home(tmp_path, monkeypatch) -> Path:
    """An isolated $DTRAIN_HOME so tests never touch ~/.dtrain."""
    home = tmp_path / "dtrain-home"
    home.mkdir()
    monkeypatch.setenv("DTRAIN_HOME", str(home))
    return home


@pytest.fixture
def dtrain_cmd() -> list[str]:
    """The dtrain CLI as a subprocess argv, using this interpreter."""
    return [sys.executable, "-m", "dtrain"]


@pytest.fixture(scope="session")
def synth_data(tmp_path_factory) -> Path:
    """A small synthetic defect data set (owner: data): 32 px, 360 images, seed 0,
    ImageFolder layout ROOT/{train,val,test}/<class>/*.png + manifest.json. Read-only:
    copy it before changing files in it."""
    from dtrain.data.synth import synthesize

    return once(tmp_path_factory, "synth_data", lambda root: synthesize(root, images=360, size=32, seed=0, workers=1))


@pytest.fixture(scope="session")
def class_folders_data(synth_data, tmp_path_factory) -> Path:
    """synth_data's train + val + test images as ROOT/<class>/* (links, no split folders):
    the classfolders layout. Read-only."""
    root = tmp_path_factory.mktemp("class_folders_data")
    for cls_dir in sorted((synth_data / "train").iterdir()):
        (root / cls_dir.name).mkdir()
        for split in ("train", "val", "test"):
            for p in sorted((synth_data / split / cls_dir.name).glob("*.png")):
                (root / cls_dir.name / f"{split}_{p.name}").symlink_to(p)
    return root


@pytest.fixture(scope="session")
def trained_checkpoint(synth_data, tmp_path_factory) -> Path:
    """OUTPUT/checkpoints/last.pt of a tiny real training run on `synth_data` (owner:
    train): ResNet-18, 32 px, one process, fp32, 2 epochs. Read-only: copy it before
    changing it. Not a good model; a real one with the full checkpoint contract."""
    import subprocess

    def train(out: Path) -> None:
        sets = {
            "data.root": synth_data, "data.image_size": 32, "data.num_workers": 0, "epochs": 2,
            "batch_size": 16, "precision": "fp32", "optim.warmup_steps": 4, "log_every": 5,
            "output_dir": out / "run", "device": "cpu", "threads": 1,
        }
        argv = [sys.executable, "-m", "dtrain.train"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert proc.returncode == 0, f"training for the trained_checkpoint fixture failed:\n{proc.stderr[-3000:]}"

    return once(tmp_path_factory, "trained", train) / "run" / "checkpoints" / "last.pt"


def pytest_report_header(config):
    return f"dtrain tests: uid={os.getuid()} cpus={os.cpu_count()}"
