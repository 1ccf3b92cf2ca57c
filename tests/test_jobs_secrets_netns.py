"""Over real SSH (namespace hosts): secret values reach the ranks on every node and are
on no process's command line anywhere (the head's ssh clients, the nodes' shells)."""

from __future__ import annotations

import os
import secrets as stdlib_secrets
import threading
import time
from pathlib import Path

import pytest
from launch_helpers import SCRIPTS, dtrain, free_port

pytestmark = pytest.mark.netns


def _command_lines_holding(values: list[bytes], found: list[str], stop: threading.Event) -> None:
    # All namespaces share this pid space: /proc shows the nodes' processes too.
    while not stop.is_set():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if any(v in cmd for v in values):
                found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
        time.sleep(0.05)


@pytest.mark.slow
def test_secret_values_are_on_no_command_line_over_ssh(netns_cluster, dtrain_home):
    from test_jobs_secrets import _assert_private_and_clean, _digest

    token, marked = "xyz" + stdlib_secrets.token_hex(8), "mk" + stdlib_secrets.token_hex(8)
    env = {**os.environ, "API_TOKEN": token, "PLAIN_BUT_MARKED": marked}
    found: list[str] = []
    stop = threading.Event()
    scanner = threading.Thread(target=_command_lines_holding, args=([token.encode(), marked.encode()], found, stop))
    scanner.start()
    try:
        res = dtrain("run", str(netns_cluster.cluster_yaml(2)), "--no-preflight", "--port", str(free_port()),
                     "--secret-env", "API_TOKEN", "--secret-env", "PLAIN_BUT_MARKED",
                     "--", "python", str(SCRIPTS / "env_digest.py"), "API_TOKEN", "PLAIN_BUT_MARKED", env=env)
    finally:
        stop.set()
        scanner.join()
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(f"API_TOKEN sha256 {_digest(token)}") == 2, res.stdout  # a rank on each node
    assert res.stdout.count(f"PLAIN_BUT_MARKED sha256 {_digest(marked)}") == 2
    assert found == []
    _assert_private_and_clean(dtrain_home, [token, marked])
