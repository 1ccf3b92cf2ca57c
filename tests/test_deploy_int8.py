"""int8: its own threshold where the export chooses it; at a given threshold, an int8
that would break the target is refused (asked for) or left out (tried on its own).

The cases are built from the real quantisation error of the fixture model: the int8
network is made exactly as the export makes it (same calibration sample), its
validation scores are compared with the checkpoint's, and from them we pick a target
that int8 breaks at the checkpoint's threshold (a strict target whose threshold sits
closer to some defective image's score than the quantisation error).
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
    p_ref = 1.0 - softmax64(reference_logits(Deployable(model, meta["mean"], meta["std"]).eval(), val.images, 1))[:, neg]
    is_defect = val.labels != neg
    n_def = int(is_defect.sum())
    assert np.abs(p_q - p_ref).max() > 0, "int8 reproduced fp32 exactly: not a quantised network"
    for k in range(n_def):
        target = (k + 0.5) / n_def  # allows exactly k validation misses
        threshold = choose_threshold(p_ref, is_defect, target).threshold
        if miss_rate(p_q, is_defect, threshold).rate > target:
            # int8 misses more at the checkpoint's threshold; the one chosen on its own scores keeps the target
            own = choose_threshold(p_q, is_defect, target).threshold
            return {"target": target, "threshold": threshold, "own": own, "p_q": p_q, "images": val.images}
    pytest.fail("int8 kept every target at the checkpoint's threshold: no case to test on this model")


# The export's default sample (the fixture's validation split is smaller: all of it).
CALIBRATION_IMAGES = 256


def _export(checkpoint, data, out, target, **given):
    from dtrain.serve.export import ExportOptions, export

    return export(ExportOptions(
        checkpoint=str(checkpoint), out=str(out), format="onnx", quantize="int8", data=str(data),
        target_miss_rate=target, measure_seconds=0.2,
        threshold_rule="rate",  # the rule the targets above were derived with
        **given,
    ))


def test_int8_decides_at_its_own_threshold(int8_case, trained_checkpoint, synth_data, tmp_path):
    """Where the checkpoint's threshold would break the target on int8's scores, the export
    chooses int8's own by the same rule, ships it, and inspection decides at it."""
    from dtrain.serve.model_dir import load_card
    from dtrain.serve.predictor import Predictor

    case = int8_case
    card = _export(trained_checkpoint, synth_data, tmp_path / "m", case["target"])
    assert set(card.backends) == {"ort-fp32", "ort-int8"}
    assert card.threshold == pytest.approx(case["threshold"], abs=1e-9)  # the checkpoint's, for fp32
    assert card.threshold_for("ort-int8") == pytest.approx(case["own"], abs=1e-6)
    assert card.threshold_for("ort-fp32") == card.threshold
    check = card.verification["ort-int8"]
    assert check.miss_rate <= case["target"] and check.max_abs_p_defect_diff > 0
    assert any("ort-int8 decides at its own threshold" in n for n in card.notes)
    assert load_card(tmp_path / "m").files.keys() == {"model.onnx", "model.int8.onnx", "recheck_sample.npz"}
    # The int8 file is the quantised one: far smaller than fp32.
    assert (tmp_path / "m" / "model.int8.onnx").stat().st_size < (tmp_path / "m" / "model.onnx").stat().st_size / 2
    # Inspection on int8 calls a part defective at int8's threshold, not the checkpoint's.
    predictor = Predictor(tmp_path / "m", "ort-int8")
    assert predictor.threshold == card.threshold_for("ort-int8")
    lo, hi = sorted((case["own"], case["threshold"]))
    between = np.flatnonzero((case["p_q"] >= lo) & (case["p_q"] < hi))
    assert between.size, "no validation image scores between the two thresholds"
    verdicts = predictor.predict(case["images"][between])
    expected = "defect" if case["own"] < case["threshold"] else "ok"
    assert [v.verdict for v in verdicts] == [expected] * between.size


def test_int8_export_that_breaks_a_given_threshold_is_refused(int8_case, trained_checkpoint, synth_data, tmp_path, dtrain_cmd):
    case = int8_case
    out = tmp_path / "m"
    argv = dtrain_cmd + ["export", str(trained_checkpoint), "--out", str(out), "--format", "onnx", "--quantize", "int8",
                         "--data", str(synth_data), "--target-miss-rate", str(case["target"]),
                         "--threshold", repr(float(case["threshold"]))]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "refusing to export" in proc.stderr and "ort-int8" in proc.stderr and "above the target" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Nothing half-written: no model directory and no staging leftovers.
    assert list(tmp_path.iterdir()) == []


def test_default_export_leaves_out_an_int8_that_breaks_a_given_threshold(int8_case, trained_checkpoint, synth_data, tmp_path):
    """--quantize auto (the default) tries int8 on its own: at a given threshold (no
    held-out choice of its own) where int8 would miss more than the target, it is not
    shipped, and the export goes on with fp32."""
    from dtrain.serve.export import ExportOptions, export

    case = int8_case
    out = tmp_path / "m"
    card = export(ExportOptions(checkpoint=str(trained_checkpoint), out=str(out), format="onnx", data=str(synth_data),
                                target_miss_rate=case["target"], threshold=float(case["threshold"]), measure_seconds=0.2))
    assert set(card.backends) == {"ort-fp32"} and card.preferred_backend == "ort-fp32"
    assert card.threshold_for("ort-fp32") == card.threshold and not any("its own threshold" in n for n in card.notes)
    assert not (out / "model.int8.onnx").exists() and "model.int8.onnx" not in card.files
    (row,) = [r for c in card.machine_choices.values() for r in c.rows if r.backend == "ort-int8"]
    assert row.miss_rate > case["target"] and "not shipped" in row.note and row.images_per_s is None


def test_a_reports_validation_threshold_lets_int8_choose_its_own(int8_case, trained_checkpoint, synth_data, tmp_path):
    """`dtrain export --threshold-from` the evaluation of this checkpoint (as the quickstart
    prints it): the report's threshold was chosen on the same validation split, so int8
    still gets its own by the report's rule and target."""
    from dtrain.evaluation.evaluate import evaluate
    from dtrain.serve.export import ExportOptions, export

    case = int8_case
    evaluate(trained_checkpoint, str(synth_data), case["target"], calibration="rate", out_dir=tmp_path / "eval")
    card = export(ExportOptions(checkpoint=str(trained_checkpoint), out=str(tmp_path / "m"), format="onnx", data=str(synth_data),
                                threshold_from=str(tmp_path / "eval" / "evaluation.json"), measure_seconds=0.2))
    assert card.threshold_rule == "rate" and card.target_miss_rate == case["target"]
    assert card.threshold == pytest.approx(case["threshold"], abs=1e-5)
    assert "ort-int8" in card.backends
    assert card.threshold_for("ort-int8") == pytest.approx(case["own"], abs=1e-6)
    assert card.verification["ort-int8"].miss_rate <= case["target"]
