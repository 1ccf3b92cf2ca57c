"""The inspection runtime is torch-free: `dtrain inspect` and `dtrain serve` on an ONNX
model directory work in a process where importing torch, torchvision or scipy raises,
and `python -X importtime` of `dtrain inspect` lists none of them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx

HEAVY = ("torch", "torchvision", "scipy")

# Run as `python -c BLOCKED ARGS...`: the dtrain CLI with the heavy packages unimportable.
BLOCKED = f"""
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ImportError(f"{{name}} is blocked: the inspection runtime must not import it")
        return None

sys.meta_path.insert(0, Blocker())
from dtrain.cli.app import main
sys.exit(main(sys.argv[1:]))
"""


def _images(synth_data, n: int):
    return sorted((synth_data / "test").rglob("*.png"))[:n]


def test_inspect_runs_with_torch_torchvision_and_scipy_unimportable(exported_model, synth_data, tmp_path):
    out = tmp_path / "r.jsonl"
    paths = [str(p) for p in _images(synth_data, 5)]
    proc = subprocess.run([sys.executable, "-c", BLOCKED, "inspect", str(exported_model), *paths, "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in rows] == paths
    assert all(r["verdict"] in ("ok", "defect") for r in rows)
    assert json.loads(proc.stdout)["images"] == 5


def test_serve_answers_with_torch_torchvision_and_scipy_unimportable(exported_model, synth_data):
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED, "serve", str(exported_model), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # "serving DIR on http://HOST:PORT (...)", printed once the socket listens
        match = re.search(r"on (http://\S+) ", line)
        assert match, line
        image = _images(synth_data, 1)[0]
        r = httpx.post(f"{match[1]}/inspect", files=[("files", (image.name, image.read_bytes(), "image/png"))], timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["verdict"] in ("ok", "defect")
    finally:
        proc.terminate()
        proc.wait(30)


def test_importtime_of_inspect_lists_no_torch(exported_model, synth_data, tmp_path):
    image = _images(synth_data, 1)[0]
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dtrain", "inspect", str(exported_model), str(image)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # Lines look like "import time:   self |  cumulative | <indent>module.name".
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "onnxruntime" in modules and "dtrain.serve.predictor" in modules  # the check sees the runtime's imports
    assert not {m for m in modules if m.split(".")[0] in HEAVY}
