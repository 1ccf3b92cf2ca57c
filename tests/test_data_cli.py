"""`dtrain data synth` as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dtrain.data.synth import synthesize


def _run(cmd: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two `dtrain data synth` processes: ~4 s CPU, ~12 s on the loaded 2-core machine
def test_synth_writes_the_data_set_and_refuses_to_overwrite(dtrain_cmd, tmp_path):
    out = tmp_path / "set"
    grid = tmp_path / "grid.png"
    done = _run(dtrain_cmd, "data", "synth", str(out), "--images", "40", "--size", "24", "--seed", "3", "--grid", str(grid))
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["images"] == 40 and manifest["seed"] == 3 and manifest["size"] == 24
    assert grid.stat().st_size > 0
    assert "wrote 40 images" in done.stdout

    again = _run(dtrain_cmd, "data", "synth", str(out), "--images", "40", "--size", "24")
    assert again.returncode == 1
    assert "already holds a data set" in again.stderr and "--force" in again.stderr
    assert "Traceback" not in again.stderr

    # The CLI and the library write the same bytes for the same arguments.
    synthesize(tmp_path / "lib", images=40, size=24, seed=3)
    files = sorted(p.relative_to(out) for p in out.rglob("*.png"))
    assert len(files) == 40
    assert all((out / f).read_bytes() == (tmp_path / "lib" / f).read_bytes() for f in files)

    forced = _run(dtrain_cmd, "data", "synth", str(out), "--images", "36", "--size", "16", "--force")
    assert forced.returncode == 0, forced.stderr
    assert len(list(out.rglob("*.png"))) == 36


def test_bad_arguments_fail_without_a_traceback(dtrain_cmd, tmp_path):
    done = _run(dtrain_cmd, "data", "synth", str(tmp_path / "x"), "--images", "3")
    assert done.returncode != 0
    assert "too few" in done.stderr and "Traceback" not in done.stderr


def test_data_group_lists_synth(dtrain_cmd):
    done = _run(dtrain_cmd, "data", "--help")
    assert done.returncode == 0 and "synth" in done.stdout
