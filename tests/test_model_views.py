"""Scoring on several views of an image (dtrain/models/views.py): the views are the
square's symmetries, the average is the softmax mean computed by hand, 8 views make the
score exactly invariant to them, every consumer of a checkpoint gets them, and the
recipe chooses how many from the budget."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dtrain.models import ModelConfig, build_model
from dtrain.models.views import ViewAverage, views, with_views
from dtrain.recipe.decide import inference_views
from dtrain.train.config import TrainConfig


def _d4(x: torch.Tensor) -> list[torch.Tensor]:
    """The 8 symmetries of the square, built another way: quarter turns, with and without a flip."""
    return [torch.rot90(x.flip(3) if f else x, k, (2, 3)) for k, f in itertools.product(range(4), (False, True))]


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(arch="small_resnet", input_norm="per_image", pool="avgmax"), 4).eval()


def test_views_are_the_eight_symmetries_of_the_square():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    got = views(x, 8)
    assert torch.equal(got[0], x)
    keys = {tuple(v.flatten().tolist()) for v in got}
    assert len(keys) == 8 and keys == {tuple(v.flatten().tolist()) for v in _d4(x)}
    assert [len(views(x, n)) for n in (1, 2, 4)] == [1, 2, 4]
    with pytest.raises(ValueError):
        views(x, 3)


def test_the_average_is_the_mean_of_the_views_softmax():
    net, x = _net(), torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        by_hand = torch.stack([torch.softmax(net(v.contiguous()), 1) for v in views(x, 4)]).mean(0)
        got = torch.softmax(ViewAverage(net, 4)(x), 1)
    assert torch.allclose(got, by_hand, atol=1e-5)
    assert with_views(net, 1) is net


def test_eight_views_score_every_symmetry_of_a_part_alike():
    net, x = _net(1), torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        one = [torch.softmax(net(v.contiguous()), 1) for v in _d4(x)]
        eight = [torch.softmax(ViewAverage(net, 8)(v.contiguous()), 1) for v in _d4(x)]
    assert max((a - one[0]).abs().max().item() for a in one) > 1e-3  # one view: a turned part scores differently
    assert max((a - eight[0]).abs().max().item() for a in eight) < 1e-5


def test_a_checkpoint_is_scored_on_its_views_by_every_consumer(trained_checkpoint, tmp_path):
    from dtrain.train.checkpoint import load_for_inference

    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=False)
    plain, _ = load_for_inference(trained_checkpoint)
    blob["config"]["model"]["views"] = 8
    torch.save(blob, tmp_path / "views.pt")
    model, meta = load_for_inference(tmp_path / "views.pt")
    assert isinstance(model, ViewAverage) and model.n == 8 and meta["config"]["model"]["views"] == 8
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        by_hand = torch.stack([torch.softmax(plain(v.contiguous()), 1) for v in views(x, 8)]).mean(0)
        assert torch.allclose(torch.softmax(model(x), 1), by_hand, atol=1e-5)


def test_views_need_the_augmentation_that_trains_for_them():
    assert TrainConfig.model_validate({"model": {"views": 8}}).model.views == 8
    with pytest.raises(ValueError, match="needs data.augment"):
        TrainConfig.model_validate({"model": {"views": 2}, "data": {"augment": False}})
    assert TrainConfig.model_validate({"data": {"augment": False}}).model.views == 1


def test_the_recipe_takes_as_many_views_as_a_tenth_of_the_budget_scores():
    # The plant profile: 1200 images at 12.4 ms per view (budget.probe_scoring, fp32 at 352 px, Xeon with AMX):
    # 8 views ~119 s, within 180 s of a 30 min budget.
    d = inference_views(1200, 0.0124, 1800)
    assert d.field == "model.views" and d.value == 8 and "~119 s" in d.reason and "8x per part" in d.reason
    # 5000 images at 15 ms: 8 views 600 s, 4 views 300 s, 2 views 150 s.
    assert inference_views(5000, 0.015, 1800).value == 2
    one = inference_views(20000, 0.015, 1800)
    assert one.value == 1 and "over 10%" in one.reason
    assert inference_views(10, 0.1, 1800, square=False).value == 4  # a rectangle has only 4 symmetries


@pytest.mark.slow  # two dynamo exports: ~30 s of CPU
def test_the_view_average_exports_like_the_network(tmp_path):
    import onnxruntime as ort

    from dtrain.serve.export import Deployable, _export_onnx

    wrapped = Deployable(ViewAverage(_net(), 8), [0.5] * 3, [0.25] * 3).eval()
    images = torch.randint(0, 255, (3, 3, 48, 48), dtype=torch.uint8)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=64)},)
    with torch.no_grad():
        want = wrapped(images).numpy()
    _export_onnx(wrapped, images[:2], dynamic, tmp_path / "m.onnx")
    got = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"images": images.numpy()})[0]
    assert np.allclose(got, want, atol=1e-4)
    # What inspect and serve run: the same network in passes of 2 parts (16 pictures) and 1.
    from dtrain.serve.backends import get_backend

    sliced = get_backend("ort-fp32").runner(tmp_path / "m.onnx", views=8)(images.numpy())
    assert np.allclose(sliced, want, atol=1e-4)
    # int8: ORT's quantiser once failed on the average's reshape (symbolic shape inference);
    # the quantised graph keeps a free batch size.
    from dtrain.serve.quantize import quantize_int8

    calib = torch.randint(0, 255, (16, 3, 48, 48), dtype=torch.uint8).numpy()
    quantize_int8(tmp_path / "m.onnx", tmp_path / "q.onnx", calib, views=8)  # calibrated 2 images (16 pictures) a pass
    # Calibration passes only bound memory: 16 images a pass give the same ranges, the same bytes.
    quantize_int8(tmp_path / "m.onnx", tmp_path / "q16.onnx", calib, views=1)
    assert (tmp_path / "q.onnx").read_bytes() == (tmp_path / "q16.onnx").read_bytes()
    int8 = ort.InferenceSession(str(tmp_path / "q.onnx"))
    for n in (1, 3):
        probs = torch.softmax(torch.from_numpy(int8.run(None, {"images": images[:n].numpy()})[0]), 1)
        assert probs.shape == (n, want.shape[1]) and np.allclose(probs.numpy(), torch.softmax(torch.from_numpy(want[:n]), 1).numpy(), atol=0.1)
    program = torch.export.export(wrapped, (images[:2],), dynamic_shapes=dynamic).module()
    with torch.no_grad():
        assert np.allclose(program(images).numpy(), want, atol=1e-4)
        # The torch-bf16 backend runs the program under autocast: a dtype cast in the graph
        # once failed there ("Tensor dtype mismatch").
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = program(images).float()
    assert np.allclose(torch.softmax(bf16, 1).numpy(), torch.softmax(torch.from_numpy(want), 1).numpy(), atol=0.02)
