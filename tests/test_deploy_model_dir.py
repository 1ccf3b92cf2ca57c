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


def test_a_card_with_accented_class_names_round_trips_under_an_ascii_locale(exported_model, tmp_path):
    """model.json is UTF-8 JSON: under LC_ALL=C without Python's UTF-8 mode, writing a class
    named 'rayure_légère' raised UnicodeEncodeError (and a card written in a Latin-1 locale
    could not be read on a UTF-8 inspection PC)."""
    import os
    import sys

    copy = tmp_path / "model"
    shutil.copytree(exported_model, copy)
    code = (
        "import sys; from pathlib import Path; from dtrain.serve.model_dir import load_card, write_card\n"
        "d = Path(sys.argv[1]); card = load_card(d)\n"
        "names = ['ok'] + ['rayure_l\\u00e9g\\u00e8re'] * (len(card.classes) - 1)\n"
        "write_card(d, card.model_copy(update={'classes': names}))\n"
        "print(ascii(load_card(d).classes))\n"
    )
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    out = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-800:]
    assert "rayure_l\\xe9g\\xe8re" in out.stdout
    raw = (copy / "model.json").read_bytes()
    assert "rayure_légère".encode() in raw  # UTF-8 on disk, as JSON readers expect
