"""Stop a training run's ranks at a known step, from the test side.

A `sitecustomize.py` on PYTHONPATH wraps `report_step` (the trainer's public per-step
call) in every process of the run, so a test can SIGKILL the run at a known point
instead of racing a moving one; the product carries no test-only switch for it.
"""

from __future__ import annotations

import os
from pathlib import Path

_SITE = """
import os, sys, time
import dtrain.monitor.rank.client as _report

_report_step = _report.report_step


def report_step(**values):
    _report_step(**values)
    if values["step"] == {step}:
        print(f"dtrain: rank {os.environ.get('RANK', '0')} stalled after step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)


_report.report_step = report_step
"""


def stall_env(directory: Path, step: int, **extra: str) -> dict[str, str]:
    """os.environ (plus `extra`) under which every rank prints "dtrain: rank R stalled
    after step STEP" and sleeps until killed, right after it reports optimizer step STEP
    (so before that step's checkpoint, if one is due)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITE.replace("{step}", str(step)))
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **extra, "PYTHONPATH": path}
