"""bench/gpu_check.sh, the GPU readiness check, on a machine without a GPU: the dry run
runs every step's CPU plumbing for real (the DDP-equivalence check on gloo, the node
agent's /metrics) and reports "no GPU" where the GPU is needed; a step over its time
limit is killed with everything it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402

STEPS = ["env", "quickstart", "ddp", "throughput", "monitor", "export"]


@pytest.mark.slow  # the CPU DDP-equivalence runs take ~40 s on an idle 2-core machine
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without a GPU")
def test_dry_run_prints_the_plan_and_a_row_per_step(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(out), "--work", str(work)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=dict(os.environ, PYTHON=sys.executable),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = proc.stdout.split("plan:", 1)[1].split("==", 1)[0]
    assert [line.split()[0] for line in plan.strip().splitlines()] == STEPS
    table = proc.stdout.rsplit("step        result", 1)[1].splitlines()[2:2 + len(STEPS)]
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in table}
    assert list(rows) == STEPS
    assert rows["env"][0] == "pass" and "no GPU visible" in rows["env"][2]
    for step in ("quickstart", "throughput", "export"):
        assert rows[step][0:2] == ["no", "GPU"], rows[step]
    # The plumbing that needs no GPU ran for real and says so.
    assert rows["ddp"][0:2] == ["no", "GPU"] and "CPU plumbing ok: gloo: max |w2 - w1|" in " ".join(rows["ddp"])
    assert rows["monitor"][0:2] == ["no", "GPU"] and "GPU families absent" in " ".join(rows["monitor"])
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["steps"]) == STEPS
    assert summary["steps"]["ddp"]["max_diff"] <= 1e-5 < summary["steps"]["ddp"]["moved"]
    # What comes back from a lent machine: at most 8 files, none in a sub-folder.
    assert sorted(p.name for p in out.iterdir()) == sorted(["summary.json", "summary.txt"] + [f"{s}.log" for s in STEPS])


def test_a_step_over_its_limit_is_killed_with_its_children_and_reported(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    t0 = time.monotonic()
    result = gpu_check.run_step(gpu_check.BY_NAME["ddp"], 3.0, out, work, dry_run=True)
    assert time.monotonic() - t0 < 30
    assert result["result"] == "FAIL" and result["figure"].startswith("timed out after 3 s")
    time.sleep(0.5)
    left = [p for p in psutil.process_iter(["cmdline"]) if str(work) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes of the killed step still run: {left}"
