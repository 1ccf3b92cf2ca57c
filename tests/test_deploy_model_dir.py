"""The model directory's guarantees: every network file is checksummed, the published
directory is readable by other accounts, and `export` refuses a wrong --out first."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess

import pytest

from dtrain.errors import DtrainError


def test_a_card_with_no_checksums_is_refused(exported_model, tmp_path):
    from dtrain.serve.model_dir import CARD, load_card

    copy = tmp_path / "model"
    shutil.copytree(exported_model, copy)
    card = json.loads((copy / CARD).read_text())
    card["files"] = {}
    (copy / CARD).write_text(json.dumps(card))
    (copy / "model.onnx").write_bytes(b"anything at all")  # would otherwise be loaded unchecked
    with pytest.raises(DtrainError, match="lists no checksum for model.onnx"):
        load_card(copy)


@pytest.mark.parametrize("absolute", [False, True])
def test_a_card_that_names_a_network_outside_its_directory_is_refused(exported_model, tmp_path, absolute):
    """Its checksum matches the file put there, and the service would have loaded that network."""
    import hashlib

    from dtrain.serve.model_dir import CARD, load_card

    copy = tmp_path / "model"
    shutil.copytree(exported_model, copy)
    outside = tmp_path / "elsewhere.onnx"
    outside.write_bytes((copy / "model.onnx").read_bytes())
    name = str(outside) if absolute else "../elsewhere.onnx"
    card = json.loads((copy / CARD).read_text())
    card["files"][name] = hashlib.sha256(outside.read_bytes()).hexdigest()
    card["backends"] = {backend: name for backend in card["backends"]}
    (copy / CARD).write_text(json.dumps(card))
    with pytest.raises(DtrainError, match="names its files by name alone"):
        load_card(copy)


def test_the_published_directory_is_readable_by_everyone(exported_model):
    assert stat.S_IMODE(exported_model.stat().st_mode) == 0o755
    for path in exported_model.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


@pytest.mark.slow  # a `dtrain export` process: ~5 s CPU, ~10-14 s on the loaded 2-core machine
def test_export_refuses_an_existing_non_model_out_before_any_work(tmp_path, dtrain_cmd):
    taken = tmp_path / "photos"
    taken.mkdir()
    (taken / "keep.jpg").write_bytes(b"precious")
    # The checkpoint does not even exist: the --out refusal comes before reading it.
    proc = subprocess.run(dtrain_cmd + ["export", str(tmp_path / "missing.pt"), "--out", str(taken)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "exists and is not a model directory" in proc.stderr and "checkpoint not found" not in proc.stderr
    assert (taken / "keep.jpg").read_bytes() == b"precious"
