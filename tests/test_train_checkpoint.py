"""The checkpoint contract, inference loading and model building (real training run)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from dtrain.models import ModelConfig, build_model
from dtrain.train import checkpoint as ckpt
from dtrain.train.schedule import warmup_cosine
from tests.conftest import REPO


def test_checkpoint_holds_the_contract(trained_checkpoint):
    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=True)  # plain types only
    for key in ckpt.KEYS:
        assert key in blob, key
    assert blob["epoch"] == 2 and blob["step_in_epoch"] == 0 and blob["step"] > 0
    assert blob["classes"] == sorted(blob["classes"]) and blob["negative_class"] == "ok"
    assert blob["image_size"] == 32 and len(blob["mean"]) == len(blob["std"]) == 3
    assert blob["config"]["model"]["arch"] == "resnet18"
    assert all(v.dtype != torch.bfloat16 for v in blob["model"].values())
    assert not any(k.startswith("module.") for k in blob["model"])
    folder = trained_checkpoint.parent
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt-epoch0001.pt", "ckpt-epoch0002.pt", "last.pt"]
    run = folder.parent
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert any('"kind": "val"' in r for r in rows) and any('"kind": "train"' in r for r in rows)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_load_for_inference_rebuilds_the_trained_model(trained_checkpoint):
    model, meta = ckpt.load_for_inference(trained_checkpoint)
    assert not model.training
    assert set(meta) >= {"classes", "negative_class", "image_size", "mean", "std", "config"}
    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, blob["model"][key]), key
    with torch.no_grad():
        logits = model(torch.rand(2, 3, meta["image_size"], meta["image_size"]))
    assert logits.shape == (2, len(meta["classes"])) and torch.isfinite(logits).all()


def test_pretrained_checkpoint_with_other_class_count_keeps_backbone(trained_checkpoint):
    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=False)
    model = build_model(ModelConfig(pretrained=str(trained_checkpoint)), num_classes=3)
    state = model.state_dict()
    assert torch.equal(state["conv1.weight"], blob["model"]["conv1.weight"])
    assert state["fc.weight"].shape == (3, 512)


def test_pretrained_of_the_wrong_arch_is_a_config_error(trained_checkpoint):
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="does not fit"):
        build_model(ModelConfig(arch="resnet34", pretrained=str(trained_checkpoint)), num_classes=6)
    with pytest.raises(ConfigError, match="not found"):
        build_model(ModelConfig(pretrained="/nonexistent/weights.pt"), num_classes=6)


@pytest.mark.parametrize("arch,size", [("resnet18", 40), ("resnet50", 24)])
def test_build_model_any_size_and_class_count(arch, size):
    model = build_model(ModelConfig(arch=arch), num_classes=4).eval()
    with torch.no_grad():
        assert model(torch.rand(1, 3, size, size)).shape == (1, 4)


def test_warmup_then_cosine_to_the_floor():
    lrs = [warmup_cosine(s, total_steps=20, warmup_steps=4, min_ratio=0.1) for s in range(20)]
    assert lrs[:4] == [0.2, 0.4, 0.6, 0.8] and lrs[4] == 1.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert math.isclose(warmup_cosine(20, 20, 4, 0.1), 0.1)


def test_atomic_save_leaves_no_temporary_files(tmp_path):
    ckpt.atomic_save({"x": torch.ones(3)}, tmp_path / "a.pt")
    last = ckpt.publish_last(tmp_path / "a.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "last.pt"]
    assert torch.equal(torch.load(last)["x"], torch.ones(3))


def test_resume_after_a_kill_leaves_no_temporary_files_or_duplicate_rows(trained_checkpoint, synth_data, tmp_path):
    """What a SIGKILL leaves: a writer's .last.pt.tmp-PID, metrics rows of steps after
    last.pt (the resumed run logs them again) and a torn last row."""
    run = tmp_path / "run"
    shutil.copytree(trained_checkpoint.parent.parent, run)
    folder = run / "checkpoints"
    (folder / ".last.pt.tmp-99999").write_bytes(b"half a checkpoint")
    done = torch.load(folder / "last.pt", map_location="cpu", weights_only=True)["step"]
    with open(run / "metrics.jsonl", "a") as fh:
        # The killed run got as far as epoch 3's validation: the resumed one logs it again.
        fh.write(json.dumps({"kind": "val", "step": done + done // 2, "epoch": 3, "loss": 1.0}) + "\n")
        fh.write('{"kind": "train", "step": ')
    sets = {"data.root": synth_data, "data.image_size": 32, "data.num_workers": 0, "epochs": 3, "batch_size": 16,
            "precision": "fp32", "optim.warmup_steps": 4, "log_every": 5, "output_dir": run, "device": "cpu", "threads": 1}
    argv = [sys.executable, "-m", "dtrain.train", "--resume"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(folder.glob(".*tmp*"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["kind"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys)), "duplicate metrics rows"
    assert max(r["step"] for r in rows) > done and rows[-1]["epoch"] == 3
