"""Monitoring for a job on this machine only (`dtrain train --nproc N`, quickstart):
one agent on loopback and the collector, for the duration of a `with` block.

    with monitored(job_dir, job_id) as env:   # env: what the ranks need (DTRAIN_AGENT_ADDR)
        os.environ.update(env); launch_ranks()

Best effort, like on a cluster: if the agent cannot start the job runs unmonitored.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

from dtrain.monitor.api import agent_argv, agent_env, agent_url

_SERVING = re.compile(rb"serving http://127\.0\.0\.1:(\d+)/")


@contextlib.contextmanager
def monitored(job_dir: str | Path, job_id: str, *, node: str = "local", say: Callable[[str], None] = print,
              python: str = sys.executable) -> Iterator[dict[str, str]]:  # fmt: skip
    from dtrain.monitor.collector import Collector

    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    argv = agent_argv(job_id, node, "127.0.0.1", 0, python)  # port 0: any free port
    agent = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = agent.stdout.readline() if agent.stdout else b""
    match = _SERVING.search(line)
    if match is None:
        agent.kill()
        agent.wait()
        say("[dtrain] monitoring: the node agent did not start; training runs unmonitored")
        yield {}
        return
    port = int(match.group(1))
    collector = Collector(job_dir, {node: agent_url("127.0.0.1", port)}, job_id=job_id,
                          on_finding=lambda f: say(f"[dtrain] finding: {f.message}")).start()  # fmt: skip
    try:
        yield agent_env(port)
    finally:
        collector.stop()
        agent.stdin.close()  # the agent ends when its stdin closes
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
