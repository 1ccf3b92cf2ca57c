"""int8: an export within the target ships, one that would break it is refused.

Both cases are built from the real quantisation error of the fixture model: the int8
network is made exactly as the export makes it (same calibration sample), its
validation scores are compared with the checkpoint's, and from them we pick one target
that int8 keeps and one that it breaks (a strict target whose threshold sits closer to
some defective image's score than the quantisation error).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # end to end: ./dev test -m 'not slow' leaves it out


@pytest.fixture(scope="module")
def int8_case(trained_checkpoint, synth_data, exported_model, tmp_path_factory):
    from dtrain.evaluation.metrics import choose_threshold, miss_rate
    from dtrain.serve.export import Deployable
    from dtrain.serve.predictor import softmax64
    from dtrain.serve.quantize import quantize_int8
    from dtrain.serve.verify import calibration_sample, load_val, reference_logits
    from dtrain.train.checkpoint import load_for_inference

    model, meta = load_for_inference(trained_checkpoint)
    val = load_val(str(synth_data), meta)
    neg = meta["classes"].index(meta["negative_class"])
    q_path = tmp_path_factory.mktemp("int8") / "q.onnx"
    calib = calibration_sample(val.images, CALIBRATION_IMAGES)
    quantize_int8(exported_model / "model.onnx", q_path, calib)

    import onnxruntime as ort

    session = ort.InferenceSession(str(q_path), providers=["CPUExecutionProvider"])
    p_q = 1.0 - softmax64(session.run(None, {"images": val.images})[0])[:, neg]
    p_ref = 1.0 - softmax64(reference_logits(Deployable(model, meta["mean"], meta["std"]).eval(), val.images))[:, neg]
    is_defect = val.labels != neg
    n_def = int(is_defect.sum())
    kept, broken = None, None
    for k in range(n_def):
        target = (k + 0.5) / n_def  # allows exactly k validation misses
        threshold = choose_threshold(p_ref, is_defect, target).threshold
        if miss_rate(p_q, is_defect, threshold).rate > target:
            broken = broken or target
        else:
            kept = kept or target
    assert np.abs(p_q - p_ref).max() > 0, "int8 reproduced fp32 exactly: not a quantised network"
    return kept, broken


# The export's default sample (the fixture's validation split is smaller: all of it).
CALIBRATION_IMAGES = 256


def _export(checkpoint, data, out, target):
    from dtrain.serve.export import ExportOptions, export

    return export(ExportOptions(
        checkpoint=str(checkpoint), out=str(out), format="onnx", quantize="int8", data=str(data),
        target_miss_rate=target, measure_seconds=0.2,
        threshold_rule="rate",  # the rule the targets above were derived with
    ))


def test_int8_export_within_target_ships(int8_case, trained_checkpoint, synth_data, tmp_path):
    from dtrain.serve.model_dir import load_card
    from dtrain.serve.predictor import Predictor

    kept, _ = int8_case
    assert kept is not None, "int8 breaks every target on this model"
    card = _export(trained_checkpoint, synth_data, tmp_path / "m", kept)
    assert set(card.backends) == {"ort-fp32", "ort-int8"}
    check = card.verification["ort-int8"]
    assert check.miss_rate <= kept and check.max_abs_p_defect_diff > 0
    assert load_card(tmp_path / "m").files.keys() == {"model.onnx", "model.int8.onnx", "recheck_sample.npz"}
    # The int8 file is the quantised one: far smaller than fp32, and it runs.
    assert (tmp_path / "m" / "model.int8.onnx").stat().st_size < (tmp_path / "m" / "model.onnx").stat().st_size / 2
    images = np.zeros((3, 3, 32, 32), np.uint8)
    assert len(Predictor(tmp_path / "m", "ort-int8").predict(images)) == 3


def test_int8_export_that_breaks_target_is_refused(int8_case, trained_checkpoint, synth_data, tmp_path, dtrain_cmd):
    _, broken = int8_case
    assert broken is not None, "int8 kept every target: no refusal case on this model"
    out = tmp_path / "m"
    argv = dtrain_cmd + ["export", str(trained_checkpoint), "--out", str(out), "--format", "onnx", "--quantize", "int8",
                         "--data", str(synth_data), "--target-miss-rate", str(broken), "--threshold-rule", "rate"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "refusing to export" in proc.stderr and "ort-int8" in proc.stderr and "above the target" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Nothing half-written: no model directory and no staging leftovers.
    assert list(tmp_path.iterdir()) == []


def test_default_export_leaves_out_an_int8_that_breaks_target(int8_case, trained_checkpoint, synth_data, tmp_path):
    """--quantize auto (the default) tries int8 on its own: where int8 would miss more than
    the target it is not shipped, and the export goes on with fp32."""
    from dtrain.serve.export import ExportOptions, export

    _, broken = int8_case
    out = tmp_path / "m"
    card = export(ExportOptions(checkpoint=str(trained_checkpoint), out=str(out), format="onnx", data=str(synth_data),
                                target_miss_rate=broken, measure_seconds=0.2, threshold_rule="rate"))
    assert set(card.backends) == {"ort-fp32"} and card.preferred_backend == "ort-fp32"
    assert not (out / "model.int8.onnx").exists() and "model.int8.onnx" not in card.files
    (row,) = [r for c in card.machine_choices.values() for r in c.rows if r.backend == "ort-int8"]
    assert row.miss_rate > broken and "not shipped" in row.note and row.images_per_s is None
