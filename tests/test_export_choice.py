"""The export tries what the machine can do, and records its choice per machine kind.

Fast cases: the machine kind string, the bf16 test, the candidate list, the choice rule.
Slow cases: a real default export of the fixture checkpoint, then loads of its
directory under a faked machine kind (the `machine` parameter of Predictor): the first
re-checks and records, the next reuses, a read-only directory works unrecorded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.deploy_fixtures import TARGET_MISS_RATE

XEON_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8 hypervisor
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd asimddp sve i8mm bf16
CPU implementer\t: 0x41
"""
OLD_CPUINFO = "model name\t: Intel(R) Core(TM) i7-4770\nflags\t\t: sse2 avx avx2 fma\n"


def test_machine_kind_names_cpu_model_and_relevant_flags():
    from dtrain.serve.machine import cpu_kind

    kind = cpu_kind(XEON_CPUINFO)
    assert kind == "cpu: Intel(R) Xeon(R) Platinum 8480+ [avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16]"
    assert "hypervisor" not in kind and "sse2" not in kind  # no bearing on the choice: the same kind with or without
    assert cpu_kind(ARM_CPUINFO).endswith("[asimddp i8mm bf16 sve]")
    assert cpu_kind(OLD_CPUINFO) == "cpu: Intel(R) Core(TM) i7-4770 [avx2 fma]"


def test_gpu_kind_from_nvidia_smi():
    from dtrain.serve import machine

    def smi(argv, **_kw):
        assert argv[0] == "nvidia-smi"
        return subprocess.CompletedProcess(argv, 0, stdout="NVIDIA H200, 9.0\nNVIDIA H200, 9.0\n", stderr="")

    def absent(argv, **_kw):
        raise FileNotFoundError(argv[0])

    assert machine.gpu_kind(run=smi) == "gpu: NVIDIA H200 sm_90"
    assert machine.gpu_kind(run=absent) is None


def test_bf16_hardware_from_flags_or_gpu():
    from dtrain.serve.machine import bf16_hardware, cpu_kind

    assert bf16_hardware(cpu_kind(XEON_CPUINFO)) and bf16_hardware(cpu_kind(ARM_CPUINFO))
    old = cpu_kind(OLD_CPUINFO)
    assert not bf16_hardware(old)
    assert bf16_hardware(old + " | gpu: NVIDIA A100-SXM4-80GB sm_80")
    assert not bf16_hardware(old + " | gpu: Tesla T4 sm_75")


def test_auto_tries_bf16_only_where_the_machine_has_it():
    from dtrain.serve.export import ExportOptions, _candidates

    opts = ExportOptions(checkpoint="c.pt", out="m", format="all")
    assert opts.quantize == "auto"
    with_bf16, _ = _candidates(opts, bf16_here=True)
    without, skipped = _candidates(opts, bf16_here=False)
    assert "ort-int8" in with_bf16 and "ort-fp32" in with_bf16 and "torch-bf16" in with_bf16
    assert "torch-bf16" not in without and "ort-int8" in without
    assert any(r.backend == "torch-bf16" and "no native bf16" in r.note for r in skipped)
    # Asked for by name, it is tried anyway.
    named, _ = _candidates(ExportOptions(checkpoint="c.pt", out="m", backends=["torch-bf16"]), bf16_here=False)
    assert named == ["torch-bf16"]
    onnx_only, _ = _candidates(ExportOptions(checkpoint="c.pt", out="m", format="onnx"), bf16_here=True)
    assert onnx_only == ["ort-fp32", "ort-int8"]


def test_pick_prefers_the_fastest_faithful_backend():
    from dtrain.serve.choice import BackendRow, pick

    rows = [
        BackendRow(backend="ort-fp32", verdict_agreement=1.0, images_per_s=700.0, eligible=True),
        BackendRow(backend="ort-int8", verdict_agreement=0.98, images_per_s=1500.0, eligible=False),
        BackendRow(backend="torch-bf16", verdict_agreement=0.999, images_per_s=900.0, eligible=True),
        BackendRow(backend="torch-compile", note="not tried: no C compiler"),
    ]
    assert pick(rows) == "torch-bf16"
    # None faithful: the most faithful of those measured, never an unmeasured one.
    unfaithful = [r.model_copy(update={"eligible": False}) for r in rows]
    assert pick(unfaithful) == "ort-fp32"


def test_a_quantised_backend_needs_enough_agreeing_images_to_be_chosen():
    from dtrain.serve.export import QUANTISED_MAX_DISAGREEMENT, _unfaithful
    from dtrain.serve.verify import Verification

    def seen(n: int, k: int) -> Verification:
        return Verification(split="val", n_images=n, n_defective=n, verdict_agreement=(n - k) / n, max_abs_p_defect_diff=0.01,
                            miss_rate=0.0, false_alarm_rate=0.0, threshold=0.5)

    # 90 of 90 agreeing (a small classifier's validation split) cannot show int8 changes < 1 in 100.
    why = _unfaithful(seen(90, 0), 0.0, quantised=True)
    assert "0 of 90 val verdicts differ" in why and f"{QUANTISED_MAX_DISAGREEMENT:.0%}" in why
    assert _unfaithful(seen(90, 0), 0.0) == ""  # an fp32 backend reproduces the scores: no such evidence needed
    assert _unfaithful(seen(299, 0), 0.0, quantised=True) == ""
    assert _unfaithful(seen(600, 1), 0.0, quantised=True) == ""
    assert "2 of 600" in _unfaithful(seen(600, 2), 0.0, quantised=True)
    assert "agreement <" in _unfaithful(seen(1000, 6), 0.0, quantised=True)


@pytest.fixture(scope="module")
def auto_export(trained_checkpoint, synth_data, tmp_path_factory):
    """`dtrain export` as a user runs it (defaults but --format onnx, which keeps the
    torch compile out of the test's time), through the CLI, with its table."""
    out = tmp_path_factory.mktemp("auto") / "model"
    argv = [sys.executable, "-m", "dtrain", "export", str(trained_checkpoint), "--out", str(out), "--format", "onnx",
            "--data", str(synth_data), "--target-miss-rate", str(TARGET_MISS_RATE)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stderr


@pytest.mark.slow
def test_default_export_tries_int8_and_records_this_machine(auto_export):
    from dtrain.serve.choice import SAMPLE, read_sample
    from dtrain.serve.machine import machine_kind
    from dtrain.serve.model_dir import load_card

    out, printed = auto_export
    card = load_card(out)
    choice = card.machine_choices[machine_kind()]
    assert choice.source == "export" and choice.backend == card.preferred_backend
    rows = {r.backend: r for r in choice.rows}
    assert set(rows) == {"ort-fp32", "ort-int8"}
    int8 = rows["ort-int8"]
    assert int8.verdict_agreement is not None and int8.miss_rate is not None
    if "ort-int8" in card.backends:  # within target: shipped, timed, and its file checksummed
        assert int8.images_per_s and "model.int8.onnx" in card.files
    else:  # above target: the export goes on without it, and says why
        assert "not shipped" in int8.note and not (out / "model.int8.onnx").exists()
    assert rows["ort-fp32"].eligible and rows["ort-fp32"].sample_agreement == 1.0
    assert choice.backend in card.backends and rows[choice.backend].eligible
    images, logits = read_sample(out)
    assert images.dtype.name == "uint8" and images.shape[1:] == (3, 32, 32) and len(logits) == len(images) > 0
    assert SAMPLE in card.files
    for word in ("backend", "verdict agreement", "val miss rate", "images/s", "chosen", "ort-int8", "ort-fp32"):
        assert word in printed


@pytest.mark.slow
def test_new_machine_kind_rechecks_once_and_records(auto_export, tmp_path):
    from dtrain.serve.choice import backend_for
    from dtrain.serve.model_dir import load_card
    from dtrain.serve.predictor import Predictor

    model = tmp_path / "model"
    shutil.copytree(auto_export[0], model)
    exported = load_card(model)
    fake = "cpu: Imaginary 9000 [avx2]"
    said = []
    chosen = backend_for(model, exported, fake, say=said.append)
    assert len(said) == 1 and "re-checking" in said[0]
    card = load_card(model)  # still whole: checksums hold, the export's record is kept
    assert set(card.machine_choices) == set(exported.machine_choices) | {fake}
    rechecked = card.machine_choices[fake]
    assert rechecked.source == "first load" and rechecked.backend == chosen
    assert {r.backend for r in rechecked.rows} == {
        r.backend for r in next(iter(exported.machine_choices.values())).rows if r.eligible and r.backend in card.backends
    }
    assert all(r.images_per_s and r.sample_agreement is not None for r in rechecked.rows)
    # The next load on that kind reads the record: no re-check.
    again = []
    assert backend_for(model, card, fake, say=again.append) == chosen and again == []
    assert Predictor(model, machine=fake).backend == chosen
    assert oct((model / "model.json").stat().st_mode & 0o777) == "0o644"


@pytest.mark.slow
def test_recheck_needs_no_torch(auto_export, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(auto_export[0], model)
    code = (
        "import sys; from dtrain.serve.predictor import Predictor; "
        f"p = Predictor({str(model)!r}, machine='cpu: Imaginary 9000 [avx2]'); "
        "print(p.backend, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    backend, torch_loaded = proc.stdout.split()
    assert backend.startswith("ort-") and torch_loaded == "False"
    assert any("Imaginary 9000" in kind for kind in json.loads((model / "model.json").read_text())["machine_choices"])


@pytest.mark.slow
def test_read_only_model_dir_uses_the_recheck_unrecorded(auto_export, tmp_path):
    from dtrain.serve.choice import backend_for
    from dtrain.serve.model_dir import load_card

    src, ro = tmp_path / "model", tmp_path / "ro"
    shutil.copytree(auto_export[0], src)
    ro.mkdir()
    # A real read-only mount: file modes alone do not stop root, which the tests run as.
    if subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("needs root to bind-mount a read-only model directory")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True, capture_output=True)
        said = []
        backend = backend_for(ro, load_card(ro), "cpu: Imaginary 9000 [avx2]", say=said.append)
        assert backend in load_card(ro).backends
        assert len(said) == 2 and "not writable" in said[1] and backend in said[1]
        assert "Imaginary" not in (ro / "model.json").read_text()
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_torch_backends_say_they_cannot_run_without_torch():
    """A re-check on an inspection PC without torch skips the torch backends instead of failing on their import."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # as if not installed: find_spec('torch') is None
        "import json; from dtrain.serve.backends import BACKENDS\n"
        "print(json.dumps({n: b.unavailable_reason() for n, b in BACKENDS.items()}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    reasons = json.loads(proc.stdout)
    assert reasons["ort-fp32"] is None and reasons["ort-int8"] is None
    assert all(reasons[n] == "torch is not installed" for n in ("torch-eager", "torch-compile", "torch-bf16"))


def test_a_backend_left_out_for_disagreeing_says_which_way_and_why():
    import numpy as np

    from dtrain.serve.verify import describe_disagreement

    # 1000 validation images, threshold 0.1: 400 defects far above it, 600 OK parts of
    # which 50 score 0.08, within a factor 3 of it (in odds).
    p_ref = np.concatenate([np.full(400, 0.9), np.full(550, 0.001), np.full(50, 0.08)])
    is_defect = np.arange(1000) < 400
    p = p_ref.copy()
    p[950:958] = 0.12  # 8 close OK parts pushed over the threshold: rejected by the backend
    p[:2] = 0.05  # 2 defects pushed under it: passed by the backend
    note = describe_disagreement("ort-int8", p, p_ref, is_defect, threshold=0.1, own=0.1, needed=0.995)
    assert "differ from the checkpoint's on 10 of 1000 validation images (5 may for 99.5% agreement)" in note
    assert "it rejects 8 the checkpoint passes and passes 2 it rejects" in note
    assert "50 OK parts score within a factor 3 of the threshold" in note
    assert "--backends ort-int8" in note
    # A backend at its own threshold is compared with the checkpoint at its own.
    halved = p_ref / (2 - p_ref)  # every score's odds halved
    same = describe_disagreement("ort-int8", halved, p_ref, is_defect, threshold=0.1, own=0.1 / 1.9, needed=0.995)
    assert "on 0 of 1000" in same and "by a factor 2.00" in same
