"""`build_model`: a ResNet by name (torchvision's, or dtrain's small-crop one), any class count and input size.

Weights are never downloaded: torchvision's builders get `weights=None`, and
`pretrained: PATH` reads a local file (a plain state_dict or a dtrain checkpoint, loaded
weights-only: a file holding other Python objects is refused unread). When
the file's classifier head has another number of classes, the head is left at its random
init and everything else is loaded, the usual fine-tuning start.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from torch import nn
from torchvision import models as tvm

from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.models.heads import avg_max_head, standardize_inputs
from dtrain.models.small import small_resnet

ARCHS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": tvm.resnet18,
    "resnet34": tvm.resnet34,
    "resnet50": tvm.resnet50,
    "small_resnet": small_resnet,  # for small crops: see dtrain/models/small.py
}

# torchvision's ResNets take a norm_layer factory called with the channel count.
NORMS: dict[str, Callable[[int], nn.Module]] = {
    "batch": nn.BatchNorm2d,
    "group": partial(nn.GroupNorm, 32),
}

HEAD_PREFIX = "fc."


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """A randomly initialised network (ResNets pool adaptively, so any input size works)."""
    if num_classes < 2:
        raise ConfigError(f"a classifier needs at least 2 classes, got {num_classes}", "check the data set's class folders")
    builder = _lookup(ARCHS, cfg.arch, "model.arch")
    own = {"stem_stride": cfg.stem_stride} if cfg.arch == "small_resnet" else {}  # the config refuses it elsewhere
    model = builder(weights=None, num_classes=num_classes, norm_layer=_lookup(NORMS, cfg.norm, "model.norm"), **own)
    if cfg.input_norm == "per_image":
        standardize_inputs(model)
    if cfg.pool == "avgmax":
        avg_max_head(model)
    if cfg.pretrained:
        load_weights(model, cfg.pretrained)
    return model


def load_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Load a local state_dict / dtrain checkpoint into `model`; returns the keys skipped."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"pretrained weights not found: {path}", "model.pretrained must be a local file (nothing is downloaded)")
    from dtrain.train.checkpoint import load_weights_only

    blob = load_weights_only(path, "weights file", ConfigError)
    state = blob.get("model", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict):
        raise ConfigError(f"{path} holds no state_dict", "pass a torch.save'd state_dict or a dtrain checkpoint")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    own = model.state_dict()
    # A head shaped for another class count is skipped so fine-tuning can start from it.
    skipped = [k for k, v in state.items() if k.startswith(HEAD_PREFIX) and k in own and own[k].shape != v.shape]
    for key in skipped:
        del state[key]
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in skipped]
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"{path} does not fit this model: {len(missing)} missing and {len(result.unexpected_keys)} unexpected keys "
            f"(e.g. {(missing + result.unexpected_keys)[0]})",
            "check model.arch and model.norm match the weights file",
        )
    return skipped


def _lookup(table: dict, name: str, key: str):
    try:
        return table[name]
    except KeyError:
        raise ConfigError(f"unknown {key} {name!r}", f"valid: {', '.join(sorted(table))}") from None
