"""A .pt file is a pickle: every command that reads one loads it weights-only, so a file
carrying code is refused with one line and the code never runs (issue 10)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO


class _Payload:
    """Unpickling this calls open(marker, "w"): the marker file's existence is the proof
    that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _evil(tmp_path: Path, trained_checkpoint: Path) -> tuple[Path, Path]:
    """A complete-looking checkpoint (the real one's keys) with the payload in it."""
    marker = tmp_path / "payload-ran"
    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=True)
    blob["classes"] = [_Payload(marker)] + blob["classes"][1:]
    path = tmp_path / "evil.pt"
    torch.save(blob, path)
    return path, marker


def _dtrain(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True, timeout=300, cwd=REPO, **kw)


def _assert_refused(proc: subprocess.CompletedProcess, marker: Path) -> None:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert not marker.exists(), "loading the checkpoint ran its payload"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refused to load" in lines[0] and "could run code" in lines[0], proc.stderr[-2000:]


def test_export_refuses_a_pickle_payload(tmp_path, trained_checkpoint):
    evil, marker = _evil(tmp_path, trained_checkpoint)
    _assert_refused(_dtrain(["export", str(evil), "--out", str(tmp_path / "model")]), marker)
    assert not (tmp_path / "model").exists()


def test_eval_refuses_a_pickle_payload(tmp_path, trained_checkpoint, synth_data):
    evil, marker = _evil(tmp_path, trained_checkpoint)
    _assert_refused(_dtrain(["eval", str(evil), str(synth_data), "--out", str(tmp_path / "eval")]), marker)


def test_pretrained_weights_with_a_pickle_payload_are_refused(tmp_path, trained_checkpoint):
    from dtrain.errors import ConfigError
    from dtrain.models import ModelConfig, build_model

    evil, marker = _evil(tmp_path, trained_checkpoint)
    with pytest.raises(ConfigError, match="refused to load .* weights file"):
        build_model(ModelConfig(pretrained=str(evil)), num_classes=6)
    assert not marker.exists()


def test_inspect_refuses_a_pickle_payload_as_its_source(tmp_path, trained_checkpoint, synth_data):
    evil, marker = _evil(tmp_path, trained_checkpoint)
    image = next((synth_data / "test").rglob("*.png"))
    proc = _dtrain(["inspect", str(evil), str(image)])
    assert proc.returncode != 0 and not marker.exists()
    assert "not a model directory" in proc.stderr


def test_resume_refuses_a_pickle_payload(tmp_path, trained_checkpoint, synth_data):
    evil, marker = _evil(tmp_path, trained_checkpoint)
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy(evil, out / "checkpoints" / "last.pt")
    sets = {"data.root": synth_data, "data.image_size": 32, "data.num_workers": 0, "epochs": 1, "batch_size": 16,
            "precision": "fp32", "output_dir": out, "device": "cpu", "threads": 1}
    argv = [sys.executable, "-m", "dtrain.train", "--resume"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    _assert_refused(proc, marker)


def test_a_checkpoint_without_config_is_one_clear_line(tmp_path, trained_checkpoint):
    blob = torch.load(trained_checkpoint, map_location="cpu", weights_only=True)
    del blob["config"]
    torch.save(blob, tmp_path / "noconfig.pt")
    proc = _dtrain(["export", str(tmp_path / "noconfig.pt"), "--out", str(tmp_path / "model")])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "KeyError" not in proc.stderr
    assert "not a complete dtrain checkpoint: it has no config" in proc.stderr.splitlines()[0]


def test_a_torch_program_with_a_pickle_payload_is_refused(tmp_path):
    """model.pt2 is a zip of pickles, and torch.export.load falls back to weights_only=False
    for some of them: a model directory's program must not run code either."""
    import io
    import zipfile

    from dtrain.errors import DtrainError
    from dtrain.serve.backends import get_backend

    program = tmp_path / "real.pt2"
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten()).eval()
    torch.export.save(torch.export.export(module, (torch.rand(1, 3, 8, 8),)), program)
    assert get_backend("torch-eager").load(program)(torch.rand(1, 3, 8, 8).numpy()).shape == (1, 144)

    marker = tmp_path / "payload-ran"
    payload = io.BytesIO()
    torch.save(((_Payload(marker),), {}), payload)
    evil = tmp_path / "model.pt2"
    with zipfile.ZipFile(program) as src, zipfile.ZipFile(evil, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, payload.getvalue() if info.filename.endswith("sample_inputs/model.pt") else src.read(info))
    with pytest.raises(DtrainError, match="refused to load .* could run code"):
        get_backend("torch-eager").load(evil)
    assert not marker.exists()


def test_a_damaged_file_is_called_damaged_and_a_file_of_objects_refused(tmp_path):
    """Random bytes or a truncated download are no torch.save output: said so, not called
    code (the old message); a file naming a class to call is refused as code."""
    from dtrain.errors import DtrainError
    from dtrain.train.checkpoint import load_weights_only

    junk = tmp_path / "junk.pt"
    junk.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DtrainError, match="is not a file torch.save wrote, or it is damaged"):
        load_weights_only(junk)
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"x": _Payload(marker)}, evil)
    with pytest.raises(DtrainError, match="holds Python objects besides tensors"):
        load_weights_only(evil)
    assert not marker.exists()
