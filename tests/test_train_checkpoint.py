"""The checkpoint contract, inference loading and model building (real training run)."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.models import ModelConfig, build_model
from dtrain.train import checkpoint as ckpt
from dtrain.train.schedule import warmup_cosine


def test_checkpoint_holds_the_contract(trained_checkpoint):
    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=False)
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
