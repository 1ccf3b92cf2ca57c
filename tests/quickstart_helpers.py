"""Running `dtrain quickstart --data` from a test (owner: recipe)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def quickstart_data(dtrain_cmd: list[str], data: Path, work: Path, epochs: int) -> subprocess.CompletedProcess:
    """`dtrain quickstart --data DATA` on one rank for `epochs` epochs, with a budget no load
    can cut and no k-fold (the threshold from validation, best.pt by validation loss; k-fold:
    tests/test_quickstart_kfold.py). Fails the test with the output's tail unless it succeeds."""
    argv = [*dtrain_cmd, "quickstart", "--data", str(data), "--workdir", str(work), "--epochs", str(epochs),
            "--nproc", "1", "--folds", "0", "--budget-minutes", "6000"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc
