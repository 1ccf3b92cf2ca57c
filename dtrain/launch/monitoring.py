"""Start the monitor's node agents and head collector for a job, best effort.

One start-up path for every job, local or not. Monitoring must never stop a job from running: an agent that cannot start (port taken,
old dtrain on the node) is reported in one line and the job goes on without it.
The API comes from dtrain.monitor.head.startup (owner: monitor).
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Callable

from dtrain.paths import open_private


class Monitoring:
    """Each node's agent starts when the session says that node's ranks run (see
    session.AGENT_AFTER_S): its connection is up, so the agent rides on it, and it no
    longer competes with the ranks' start-up; the collector once every agent started."""

    def __init__(self, plan, runners: dict, job_dir: Path, say: Callable[[str], None]) -> None:
        self.plan = plan
        self.runners = runners
        self.job_dir = Path(job_dir)
        self.say = say
        self.agents: list[tuple[str, subprocess.Popen]] = []
        self.collector = None
        self.endpoints: dict[str, str] = {}
        self._waiting = {node.name for node in plan.nodes if node.agent_argv}

    def start_agent(self, name: str) -> None:
        """Start `name`'s agent (once)."""
        if name not in self._waiting:
            return
        self._waiting.discard(name)
        node = self.plan.node(name)
        try:
            with open_private(self.job_dir / "logs" / f"{node.name}.agent.log", "ab") as log:
                proc = self.runners[node.name].popen(
                    node.agent_argv, env=None, cwd=node.cwd, stdin=subprocess.PIPE,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
        except OSError as exc:
            self.say(f"[dtrain] monitoring: no agent on {node.name}: {exc}")
        else:
            self.agents.append((node.name, proc))
            self.endpoints[node.name] = node.agent_url
        if not self._waiting and self.endpoints and self.collector is None:
            try:
                from dtrain.monitor.head.collector import Collector

                self.collector = Collector(self.job_dir, self.endpoints, job_id=self.plan.job_id,
                                           on_finding=lambda f: self.say(f"[dtrain] finding: {f.message}")).start()
            except Exception as exc:  # monitoring is optional; the job is not
                self.say(f"[dtrain] monitoring: collector not started: {exc}")

    def stop(self) -> None:
        for _, proc in self.agents:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the agent exits when its stdin closes
        if self.collector is not None:  # while the agents wind down
            with contextlib.suppress(Exception):
                self.collector.stop()
        for _, proc in self.agents:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
