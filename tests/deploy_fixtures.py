"""Deployment fixtures (owner: deploy), loaded from conftest via pytest_plugins.

`exported_model`: one real fp32 ONNX export of the `trained_checkpoint` fixture,
verified on the synthetic validation split. The export, inspect and service tests all
read it (never modify it). The int8 cases build their own (test_deploy_int8.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from shared_once import once

TARGET_MISS_RATE = 0.1


@pytest.fixture(scope="session")
def exported_model(tmp_path_factory, trained_checkpoint, synth_data) -> Path:
    from dtrain.serve.export import ExportOptions, export

    def build(root: Path) -> None:
        export(ExportOptions(
            checkpoint=str(trained_checkpoint), out=str(root / "model"), format="onnx", quantize="none",
            data=str(synth_data), target_miss_rate=TARGET_MISS_RATE, measure_seconds=0.2,
        ))

    return once(tmp_path_factory, "deploy", build) / "model"


@pytest.fixture(scope="session")
def checkpoint_test_scores(trained_checkpoint, synth_data) -> dict[str, float]:
    """The checkpoint's own P(defect) per test-split file, computed the way evaluation
    does (dtrain.evaluation.predict: normalisation outside the network, channels_last)."""
    from dtrain.data.datasets import open_split
    from dtrain.evaluation.metrics import p_defect
    from dtrain.evaluation.predict import predict_split
    from dtrain.serve.verify import data_config
    from dtrain.train.checkpoint import load_for_inference

    model, meta = load_for_inference(trained_checkpoint)
    cfg = data_config(str(synth_data), meta)
    preds = predict_split(model, open_split(cfg, cfg.test_split, train=False), mean=meta["mean"], std=meta["std"], num_workers=0)
    scores = p_defect(preds.probs, meta["classes"].index(meta["negative_class"]))
    return {str(Path(p).resolve()): float(s) for p, s in zip(preds.paths, scores, strict=True)}
