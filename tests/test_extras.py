"""dtrain without its extras, as on a GPU node that installed only `pip install dtrain`:
every extra's modules are made unimportable in the child processes (a sitecustomize.py
on PYTHONPATH puts None in sys.modules for them, which is how Python spells "not
installed" to both `import` and `importlib.util.find_spec`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dtrain.extras import EXTRAS

HINTS = {
    "serve": "dtrain serve needs the 'serve' extra (fastapi, uvicorn, python_multipart not installed): "
             "pip install 'dtrain[serve]'",
    "dashboard": "dtrain dashboard needs the 'dashboard' extra (plotly not installed): pip install 'dtrain[dashboard]'",
    "export": "dtrain export --format all needs the 'serve' extra (onnx, onnxscript, onnxruntime not installed): "
              "pip install 'dtrain[serve]'",
}  # fmt: skip

# A rank of a plain user script that reports its steps, as the trainer does.
RANK = """
from dtrain.monitor.rank.client import report_step
report_step(step=1, step_time_s=0.01, samples=1)
print("rank ran", flush=True)
"""


class Bare:
    """`python -m dtrain ...` (or any python) with none of the extras importable."""

    def __init__(self, site, cwd) -> None:
        blocked = sorted({m for mods in EXTRAS.values() for m in mods} | {"multipart"})  # python-multipart's old name
        site.mkdir()
        (site / "sitecustomize.py").write_text(f"import sys\nfor _m in {blocked!r}:\n    sys.modules[_m] = None\n")
        path = [str(site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.cwd = cwd

    def python(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=self.env, cwd=self.cwd,
                              timeout=timeout)  # fmt: skip

    def dtrain(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.python("-m", "dtrain", *args, timeout=timeout)


@pytest.fixture
def bare(tmp_path, dtrain_home) -> Bare:
    return Bare(tmp_path / "site", tmp_path)


@pytest.mark.slow  # five `dtrain` processes and a real local job: ~6 s CPU, ~17 s on the loaded 2-core machine
def test_without_extras_run_and_train_work_and_the_rest_name_their_extra(bare, tmp_path):
    # the blocker works: fastapi is installed here (./dev installs every extra) but not importable under it
    assert subprocess.run([sys.executable, "-c", "import fastapi"]).returncode == 0
    assert "ModuleNotFoundError" in bare.python("-c", "import fastapi").stderr
    for argv, hint in ((["serve", str(tmp_path)], HINTS["serve"]), (["dashboard", "--port", "0"], HINTS["dashboard"]),
                       (["export", str(tmp_path / "last.pt"), "--out", str(tmp_path / "m")], HINTS["export"])):
        res = bare.dtrain(*argv)
        assert res.returncode == 1, (argv, res.stdout, res.stderr)
        assert hint in res.stderr and "Traceback" not in res.stderr, res.stderr
    for argv in (["--help"], ["train", "--help"]):  # `dtrain run` runs a job below
        res = bare.dtrain(*argv)
        assert res.returncode == 0, (argv, res.stderr)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    # a real job on this machine: launcher, torchrun, a reporting rank, the node agent and the collector
    res = bare.dtrain("run", "--hosts", "local", "--no-preflight", "--", "python", str(script), timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank ran" in res.stdout and "succeeded" in res.stdout, res.stdout


@pytest.mark.slow
def test_dtrain_train_without_extras(bare, tmp_path):
    from dtrain.data.synth import synthesize

    synthesize(tmp_path / "data", images=60, size=32, seed=0, workers=1)
    sets = {"data.root": tmp_path / "data", "data.image_size": 32, "data.num_workers": 0, "epochs": 1,
            "batch_size": 16, "model.arch": "small_resnet", "max_steps": 2, "output_dir": tmp_path / "run",
            "device": "cpu", "threads": 1, "precision": "fp32"}  # fmt: skip
    res = bare.dtrain("train", "--nproc", "1", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
                      timeout=400)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()
