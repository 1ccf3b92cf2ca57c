"""P(defect) pooled from the classifier and its mask head (owner: train; dtrain/models/defect_score.py):
the arithmetic, what load_for_inference builds from which checkpoint, and that the
exported networks (ONNX, torch.export) reproduce the pooled score."""

from __future__ import annotations

import io

import pytest
import torch

from dtrain.models.build import build_model
from dtrain.models.config import ModelConfig
from dtrain.models.defect_score import PooledDefectScore
from dtrain.models.mask_head import with_mask_head


def _logit(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p) - torch.log1p(-p)


@pytest.mark.parametrize("negative", [0, 2, 3])
def test_pooled_p_defect_is_the_mean_log_odds_and_keeps_the_classifiers_defect_type(negative):
    torch.manual_seed(negative)
    scored = with_mask_head(build_model(ModelConfig(arch="small_resnet"), 4)).eval()
    pooled = PooledDefectScore(scored, negative, 4).eval()
    x = torch.rand(6, 3, 48, 48)
    with torch.no_grad():
        logits, mask = scored(x)
        out = pooled(x)
    p_cls = logits.double().softmax(1)
    p_defect_cls = 1 - p_cls[:, negative]
    peak = mask.double().flatten(1).amax(1)
    want = torch.sigmoid((_logit(p_defect_cls) + peak) / 2)
    probs = out.double().exp()
    torch.testing.assert_close(probs.sum(1), torch.ones(6, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(1 - probs[:, negative], want, atol=1e-5, rtol=0)
    defects = [i for i in range(4) if i != negative]
    # The defect classes keep the classifier's proportions, so the type shown is its own.
    torch.testing.assert_close(probs[:, defects] / probs[:, defects].sum(1, keepdim=True),
                               p_cls[:, defects] / p_cls[:, defects].sum(1, keepdim=True), atol=1e-5, rtol=0)
    assert not torch.allclose(1 - probs[:, negative], p_defect_cls, atol=1e-3)  # the head's peak moved it


def test_a_confident_peak_raises_p_defect_and_a_quiet_map_lowers_it():
    torch.manual_seed(0)
    scored = with_mask_head(build_model(ModelConfig(arch="small_resnet"), 2)).eval()
    pooled = PooledDefectScore(scored, 0, 2).eval()
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        p_cls = 1 - scored(x)[0].softmax(1)[:, 0]
        scored.head.out.bias.fill_(8.0)  # every cell sure of a defect
        high = 1 - pooled(x).exp()[:, 0]
        scored.head.out.bias.fill_(-8.0)  # every cell sure it is clean
        low = 1 - pooled(x).exp()[:, 0]
    assert (high > p_cls).all() and (low < p_cls).all()


@pytest.fixture(scope="module")
def masked_checkpoint(tmp_path_factory):
    """A 4-step small_resnet trained with mask_loss on a masked synthetic set (ok + defects),
    its config asking for the pooled score."""
    from dtrain.data.synth import synthesize
    from dtrain.train import checkpoint as ckpt
    from dtrain.train.config import TrainConfig
    from dtrain.train.trainer import run

    root = tmp_path_factory.mktemp("pooled")
    synthesize(root / "data", images=120, size=32, seed=3, workers=1, masks=True)
    cfg = TrainConfig.model_validate({
        "data": {"root": str(root / "data"), "image_size": 32, "num_workers": 0},
        "model": {"arch": "small_resnet", "pool": "avgmax", "score_with_mask": True}, "epochs": 1, "max_steps": 4,
        "batch_size": 8, "precision": "fp32", "device": "cpu", "threads": 1, "deterministic": True,
        "val_every_epoch": False, "mask_loss": 1.0, "output_dir": str(root / "run")})
    threads = torch.get_num_threads()  # run() sets the process's intra-op threads
    try:
        run(cfg, stream=io.StringIO())
    finally:
        torch.set_num_threads(threads)
    return ckpt.find_resume(root / "run"), root / "data"


def _variant(path, tmp_path, name, edit):
    blob = torch.load(path, map_location="cpu", weights_only=True)
    edit(blob)
    out = tmp_path / f"{name}.pt"
    torch.save(blob, out)
    return out


def test_inference_pools_where_asked_and_a_head_and_a_defect_free_class_exist(masked_checkpoint, tmp_path):
    from dtrain.models.config import SCORE_CLASSIFIER, SCORE_POOLED
    from dtrain.train.checkpoint import load_for_inference

    path, _data = masked_checkpoint
    x = torch.rand(4, 3, 32, 32)
    pooled, meta = load_for_inference(path)
    assert meta["score"] == SCORE_POOLED and isinstance(pooled, PooledDefectScore)

    def default(blob):  # the classifier alone unless the config asks
        del blob["config"]["model"]["score_with_mask"]

    def headless(blob):
        del blob["mask_head"]

    def types_only(blob):  # no defect-free class: no P(defect) to pool
        blob["negative_class"] = None

    for name, edit in (("default", default), ("headless", headless), ("types_only", types_only)):
        alone, meta = load_for_inference(_variant(path, tmp_path, name, edit))
        assert meta["score"] == SCORE_CLASSIFIER and not isinstance(alone, PooledDefectScore), name
    with torch.no_grad():
        assert not torch.allclose(pooled(x).exp(), alone(x).softmax(1), atol=1e-4)
        # The classifier inside the pooled network is the checkpoint's own, weight for weight.
        torch.testing.assert_close(pooled.scored.net(x), alone(x))


@pytest.mark.slow
def test_exported_networks_reproduce_the_pooled_score(masked_checkpoint, tmp_path):
    from dtrain.models.config import SCORE_POOLED
    from dtrain.serve.export import ExportOptions, export

    path, data = masked_checkpoint
    # Every backend this machine runs (int8 always; bf16 under autocast where the CPU has it).
    card = export(ExportOptions(checkpoint=str(path), out=str(tmp_path / "model"), data=str(data), measure_seconds=0.1))
    assert {"ort-fp32", "torch-eager"} <= set(card.backends) and card.score == SCORE_POOLED
    # A backend left out for scoring NaN would be missing from the checks below: none may be.
    rows = [r for c in card.machine_choices.values() for r in c.rows]
    assert rows and not any("NaN" in r.note for r in rows), [r.note for r in rows]
    for name, check in card.verification.items():
        # Against the checkpoint's pooled P(defect) on the validation split: fp32 gives the
        # same verdicts and scores; a quantised network close ones.
        exact = name in ("ort-fp32", "torch-eager", "torch-compile")
        assert check.max_abs_p_defect_diff < (1e-4 if exact else 0.1), name
        assert check.verdict_agreement == 1.0 or not exact, name


@pytest.mark.slow
def test_int8_keeps_the_probability_arithmetic_in_fp32_and_scores_finite(masked_checkpoint, tmp_path):
    import numpy as np
    import onnx
    import onnxruntime as ort

    from dtrain.serve.export import Deployable, _export_onnx
    from dtrain.serve.quantize import _probability_nodes, quantize_int8
    from dtrain.train.checkpoint import load_for_inference

    path, _data = masked_checkpoint
    model, meta = load_for_inference(path)
    fp32, int8 = tmp_path / "model.onnx", tmp_path / "model.int8.onnx"
    example = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
    _export_onnx(Deployable(model, meta["mean"], meta["std"]).eval(), example,
                 ({0: torch.export.Dim("batch", min=1, max=64)},), fp32)
    images = np.random.default_rng(0).integers(0, 256, (24, 3, 32, 32), dtype=np.uint8)
    quantize_int8(fp32, int8, images)
    named = tmp_path / "named.onnx"
    named.write_bytes(fp32.read_bytes())
    tail = set(_probability_nodes(named))
    ops = {n.name: n.op_type for n in onnx.load(str(named)).graph.node}
    assert {"LogSoftmax", "Exp", "Abs"} <= {ops[n] for n in tail} and "Conv" not in {ops[n] for n in tail}
    # The convolutions are int8, the log-sigmoid of the pooled score is not: P(defect) stays a number.
    quantised_ops = {n.op_type for n in onnx.load(str(int8)).graph.node}
    assert "DequantizeLinear" in quantised_ops
    out = ort.InferenceSession(str(int8), providers=["CPUExecutionProvider"]).run(None, {"images": images})[0]
    assert np.isfinite(out).all() and np.allclose(np.exp(out).sum(1), 1.0, atol=1e-3)


def test_a_part_sure_beyond_float_range_keeps_finite_log_probabilities():
    from dtrain.models.defect_score import _log_sigmoid

    z = torch.tensor([-1e4, -100.0, -1.0, 0.0, 1.0, 100.0, 1e4])
    out = _log_sigmoid(z)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.nn.functional.logsigmoid(z))


def test_asking_for_the_heads_vote_without_training_a_head_is_a_config_error(tmp_path):
    from pydantic import ValidationError

    from dtrain.train.config import TrainConfig

    with pytest.raises(ValidationError, match="score_with_mask .* only with mask_loss"):
        TrainConfig.model_validate({"data": {"root": str(tmp_path)}, "model": {"score_with_mask": True}})
    TrainConfig.model_validate({"data": {"root": str(tmp_path)}, "model": {"score_with_mask": True}, "mask_loss": 1.0})


def test_a_threshold_chosen_on_one_score_is_not_taken_for_the_other(tmp_path):
    import json

    from dtrain.errors import DtrainError
    from dtrain.models.config import SCORE_CLASSIFIER, SCORE_POOLED
    from dtrain.serve.given_threshold import from_report

    report = {"task": "inspection", "classes": ["dent", "ok"], "negative_class": "ok", "image_size": 64,
              "threshold": 0.09, "score": SCORE_POOLED, "config": {"model": {"arch": "small_resnet"}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    meta = {"classes": ["dent", "ok"], "negative_class": "ok", "image_size": 64, "config": {"model": {"arch": "small_resnet"}}}
    assert from_report(path, tmp_path / "best.pt", {**meta, "score": SCORE_POOLED}).threshold == 0.09
    with pytest.raises(DtrainError, match="P\\(defect\\) score"):
        from_report(path, tmp_path / "best.pt", {**meta, "score": SCORE_CLASSIFIER})
    del report["score"]  # a report from before the field: the classifier's score
    path.write_text(json.dumps(report))
    assert from_report(path, tmp_path / "best.pt", {**meta, "score": SCORE_CLASSIFIER}).threshold == 0.09
