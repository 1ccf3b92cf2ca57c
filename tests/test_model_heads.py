"""Per-image standardisation and avg+max pooling (dtrain/models/heads.py), and the
class-weighted sampler (DataConfig.sampling)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dtrain.models import ModelConfig, build_model
from dtrain.train.loaders import ClassWeightedSampler


@pytest.mark.parametrize("arch", ["small_resnet", "resnet18"])
def test_per_image_standardisation_ignores_level_and_contrast(arch):
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, input_norm="per_image", pool="avgmax"), 3).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        # Same picture brighter and with more contrast: the same logits (up to the scale's
        # floor, 1 % of a unit-spread image's scale).
        assert torch.allclose(model(x), model(x * 3.0 + 5.0), rtol=3e-2, atol=3e-2)
        plain = build_model(ModelConfig(arch=arch), 3).eval()
        assert not torch.allclose(plain(x), plain(x * 3.0 + 5.0), atol=1e-2)
    # Parameter names are the plain network's (checkpoints and pretrained files load as before),
    # with a head twice as wide for the [mean, max] features.
    names = {k: v.shape for k, v in model.state_dict().items()}
    plain_names = {k: v.shape for k, v in plain.state_dict().items()}
    assert names.keys() == plain_names.keys()
    assert names["fc.weight"][1] == 2 * plain_names["fc.weight"][1]


def test_max_pooling_sees_a_small_spot_that_the_mean_dilutes():
    from dtrain.models.heads import AvgMaxPool

    x = torch.zeros(1, 1, 32, 32)
    x[0, 0, 5, 7] = 10.0
    mean, peak = AvgMaxPool()(x).flatten().tolist()
    assert peak == 10.0 and mean == pytest.approx(10.0 / 1024)


def test_pretrained_plain_weights_load_into_the_avgmax_model(tmp_path):
    from dtrain.models.build import load_weights

    plain = build_model(ModelConfig(arch="small_resnet"), 4)
    torch.save(plain.state_dict(), tmp_path / "w.pt")
    model = build_model(ModelConfig(arch="small_resnet", pool="avgmax", input_norm="per_image"), 4)
    assert sorted(load_weights(model, tmp_path / "w.pt")) == ["fc.weight"]  # bias has the same shape: loaded
    assert torch.equal(model.stem[0].weight, plain.stem[0].weight)


def test_class_weighted_sampler_draws_rare_classes_by_sqrt_of_their_size():
    targets = [0] * 900 + [1] * 100 + [2] * 25
    draws = []
    for rank in range(2):
        s = ClassWeightedSampler(targets, num_replicas=2, rank=rank, seed=3)
        s.set_epoch(4)
        assert len(s) == 513  # ceil(1025 / 2): an epoch as long as a permutation's
        draws.append(list(s))
    s = ClassWeightedSampler(targets, num_replicas=2, rank=0, seed=3)
    s.set_epoch(4)
    assert list(s) == draws[0]  # a pure function of (seed, epoch): resumable, the same on every rank
    s.set_epoch(5)
    assert list(s) != draws[0]
    empty = ClassWeightedSampler([], num_replicas=2, rank=0, seed=3)
    assert len(empty) == 0 and list(empty) == []
    by_class = Counter(targets[i] for d in draws for i in d)
    total = sum(by_class.values())
    # Class shares ~ sqrt(n_c): 30 : 10 : 5 of 45.
    for c, share in ((0, 30 / 45), (1, 10 / 45), (2, 5 / 45)):
        assert by_class[c] / total == pytest.approx(share, abs=0.04)


@pytest.mark.slow  # a dynamo ONNX export and an int8 calibration: ~15 s of CPU
def test_the_recipe_network_exports_to_onnx_and_quantises_to_int8(tmp_path):
    """ONNX Runtime's quantiser runs a symbolic shape inference over the graph: Tensor.std's
    Shape/Concat/Expand and a Concat fed by ReduceMean/ReduceMax stopped it (TypeError), so
    `dtrain export` of every recipe model crashed."""
    import numpy as np
    import onnxruntime as ort

    from dtrain.serve.export import Deployable, _export_onnx
    from dtrain.serve.quantize import quantize_int8

    torch.manual_seed(0)
    net = build_model(ModelConfig(arch="small_resnet", input_norm="per_image", pool="avgmax"), 5).eval()
    wrapped = Deployable(net, [0.5] * 3, [0.25] * 3).eval()
    images = torch.randint(0, 255, (4, 3, 48, 48), dtype=torch.uint8)
    _export_onnx(wrapped, images[:2], ({0: torch.export.Dim("batch", min=1, max=64)},), tmp_path / "m.onnx")
    fp32 = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"images": images.numpy()})[0]
    with torch.no_grad():
        assert np.allclose(fp32, wrapped(images).numpy(), atol=1e-4)
    quantize_int8(tmp_path / "m.onnx", tmp_path / "q.onnx", np.random.default_rng(0).integers(0, 255, (16, 3, 48, 48), dtype=np.uint8))
    int8 = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, {"images": images.numpy()})[0]
    assert int8.shape == (4, 5) and np.isfinite(int8).all()
