"""Read-only session fixtures built once per test run, not once per pytest-xdist worker.

Each worker is its own pytest session, so a session fixture such as the trained model
would be built by every worker that runs a test needing it: the same ~25 s of training
twice on a 2-core machine. `once` builds it in the run's shared temporary folder (the
parent of every worker's own) under a file lock: the first worker to ask builds it, the
others wait on the lock and read the same files.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(root)` fills an empty folder `root`, which is returned. Only for fixtures
    that tests never change: every worker gets the same folder."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: a session fixture is built once anyway
        root = tmp_path_factory.mktemp(name)
        build(root)
        return root
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, above popen-gw0/, popen-gw1/, ...
    root, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if build raises
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a build that failed half-way in another worker
            root.mkdir()
            build(root)
            done.touch()
    return root
