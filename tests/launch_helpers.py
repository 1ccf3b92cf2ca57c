"""Helpers shared by the launch tests (plain functions, no fixtures)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from dtrain.ports import free_port  # noqa: F401  (the tests import it from here)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def dtrain(*args: str, timeout: float = 240, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", REPO), **kwargs)


def job_processes(job_id: str) -> list[tuple[int, str]]:
    """Every process on this machine (all namespaces share the pid space) of the job."""
    needle = f"DTRAIN_JOB_ID={job_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in environ.split(b"\0") or f"--job {job_id}" in cmd or f"--rdzv-id {job_id}" in cmd:
            found.append((int(entry.name), cmd.strip()))
    return found


def wait_gone(job_id: str, timeout: float = 30) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def job_id_of(output: str) -> str:
    m = re.search(r"job (\d{8}-\d{6}-[0-9a-f]{4})", output)
    assert m, output
    return m.group(1)
