"""Model builders: the small-crop ResNet the quickstart trains, next to torchvision's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models import build_model
from dtrain.models.config import ModelConfig


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("norm", ["batch", "group"])
def test_small_resnet_any_size_and_norm(size, norm):
    model = build_model(ModelConfig(arch="small_resnet", norm=norm), num_classes=6).eval()
    with torch.no_grad():
        assert model(torch.rand(2, 3, size, size)).shape == (2, 6)
    kinds = {type(m) for m in model.modules()} & {nn.BatchNorm2d, nn.GroupNorm}
    assert kinds == {nn.BatchNorm2d if norm == "batch" else nn.GroupNorm}


def test_small_resnet_keeps_resolution_at_a_quarter_of_the_parameters():
    small = build_model(ModelConfig(arch="small_resnet"), num_classes=6)
    big = build_model(ModelConfig(arch="resnet18"), num_classes=6)
    assert _params(small) < _params(big) / 3
    # After the stem a 64 px crop is still 32x32 (ResNet-18: 16x16).
    assert small.stem(torch.rand(1, 3, 64, 64)).shape[-2:] == (32, 32)
    # One pixel changed in the input changes the logits: nothing is lost to striding.
    small.eval()
    x = torch.rand(1, 3, 64, 64)
    y = x.clone()
    y[..., 31, 31] = 1.0 - y[..., 31, 31]
    with torch.no_grad():
        assert not torch.allclose(small(x), small(y))


def test_a_strided_stem_takes_twice_the_side_into_the_same_maps():
    flat = build_model(ModelConfig(arch="small_resnet"), num_classes=6)
    strided = build_model(ModelConfig(arch="small_resnet", stem_stride=2), num_classes=6)
    # The blocks get the maps a full-resolution stem makes of half the side: the same compute.
    assert strided.stem(torch.rand(1, 3, 128, 128)).shape == flat.stem(torch.rand(1, 3, 64, 64)).shape
    assert _params(strided) == _params(flat)  # the same weights, so a checkpoint is read by either
    # A line one pixel wide on a row the stride steps over (odd) still moves the logits: the
    # 3x3 kernel reaches between its samples, where plain subsampling would drop the line.
    strided.eval()
    x = torch.rand(1, 3, 128, 128)
    y = x.clone()
    y[..., 65, 20:100] = 1.0
    with torch.no_grad():
        assert not torch.allclose(strided(x), strided(y))


def test_the_stem_stride_is_refused_for_torchvisions_resnets():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="small_resnet only"):
        ModelConfig(arch="resnet18", stem_stride=2)


def test_small_resnet_weights_round_trip(tmp_path):
    first = build_model(ModelConfig(arch="small_resnet"), num_classes=6)
    torch.save({"model": first.state_dict()}, tmp_path / "w.pt")
    # Another class count: the head stays at its init, the rest is loaded (fine-tuning).
    second = build_model(ModelConfig(arch="small_resnet", pretrained=str(tmp_path / "w.pt")), num_classes=3)
    assert torch.equal(second.stem[0].weight, first.stem[0].weight) and second.fc.out_features == 3
    with pytest.raises(ConfigError, match="does not fit"):
        build_model(ModelConfig(arch="resnet18", pretrained=str(tmp_path / "w.pt")), num_classes=6)


def test_unknown_arch_names_the_valid_ones():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="small_resnet"):
        ModelConfig(arch="small_resnt")
