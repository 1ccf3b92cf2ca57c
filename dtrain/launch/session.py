"""Run a LaunchPlan on its nodes at once, from the head: output, fail-fast, stop, hang.

One child process per node (the runner's argv: ssh, or a local process) runs the node
wrapper. Its output is read line by line: worker lines arrive prefixed `[node:rN] ` by
torchrun, the wrapper's status lines (MARK) are stripped and feed the watchdog, all
other lines get a `[node] ` prefix. Each line goes to the terminal, to
`logs/<node>.log` and to `output.log` (the interleaved view `dtrain logs` replays).

A node whose launch finds no code (its marker check, plan.node_command) starts nothing
and says so; the session copies the code there in the background and launches it again.

Stopping a node = closing its stdin: the wrapper then stops torchrun and every worker.
If the wrapper cannot be reached, the local ssh/child process is terminated after
`grace + 5` s and killed after `grace + 15` s, so every node is down within 30 s.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from dtrain.launch.monitoring import Monitoring
from dtrain.launch.node import MARK
from dtrain.launch.plan import KEEPALIVE, LaunchPlan, node_command
from dtrain.launch.summary import PREFIXED, NodeEnd, RootCause, root_cause
from dtrain.launch.sync import SYNC_MISSING, for_plan
from dtrain.launch.terminal import TerminalWriter
from dtrain.launch.watchdog import Hang, Watchdog
from dtrain.paths import open_private, private_dir

# Seconds after a node comes up when its monitor agent starts even if no rank has
# reported yet (scripts that neither print nor call report_step early).
AGENT_AFTER_S = 15.0
# The longest the loop handles queued lines before it sees to keep-alives, stops and
# failures again: a job that prints faster than the head writes its logs must not starve them.
DRAIN_SLICE_S = 0.5
# Lines read from the nodes and not yet handled (a few MB).
LINE_BACKLOG = 50_000
_RESTART = re.compile(r"Restarting worker group|\[default\] Rendezvous complete|rendezvous round", re.I)


@dataclass
class Outcome:
    state: str  # succeeded | failed | stopped
    exit_code: int
    reason: str
    cause: RootCause | None = None
    hang: Hang | None = None
    first_step_at: float | None = None  # monotonic time of the first worker line

    def summary(self, job_id: str) -> str:
        if self.state == "succeeded":
            return f"job {job_id} succeeded"
        lines = [f"job {job_id} {self.state}: {self.reason}"]
        if self.cause is not None:
            lines.append(self.cause.describe())
        return "\n".join(lines)


class _Node:
    def __init__(self, launch, proc: subprocess.Popen, log: TextIO) -> None:
        self.launch = launch
        self.proc = proc
        self.log = log
        self.end = NodeEnd(launch.name)
        self.eof = False
        self.exit_reported: int | None = None
        self.stop_sent_at: float | None = None
        self.sync_missing = False  # its launch found no code: copy, then launch again
        self.copy: threading.Thread | None = None
        self.copy_error: str | None = None
        self.up_at: float | None = None  # when its wrapper first reported


class JobSession:
    def __init__(
        self,
        plan: LaunchPlan,
        runners: dict,
        job_dir: Path,
        *,
        out: TextIO,
        clock: Callable[[], float] = time.monotonic,
        min_nodes: int | None = None,
        replacer: Callable | None = None,
    ) -> None:
        self.plan = plan
        self.runners = runners
        self.job_dir = Path(job_dir)
        self.out = out
        # The loop never writes to the terminal itself (terminal.py): one that stops reading
        # would stop the keep-alives, and the nodes would end a healthy job.
        self.terminal = TerminalWriter(out, missed_hint=f"`dtrain logs {self.job_dir.name}` has every line")
        self.clock = clock
        self.min_nodes = min_nodes if min_nodes is not None else plan.nnodes[0]
        # Bounded: a job that prints faster than the head writes its logs is held back by its
        # pipes (as a terminal holds back a plain torchrun) instead of filling the head's memory.
        self.lines: queue.Queue = queue.Queue(maxsize=LINE_BACKLOG)
        self.nodes: dict[str, _Node] = {}
        self.stop_reason: str | None = None  # set by stop() from a signal handler / CLI
        self._stop_state = "stopped"
        self.first_output_at: float | None = None
        self._next_keepalive = 0.0
        # Code sync checked by the launches themselves (plan.node_command): the nodes yet
        # to look for the marker, the nodes the code was copied to.
        self.sync = for_plan(plan, self._say)
        self._to_look = {n.name for n in plan.nodes if n.sync_at_launch}
        self._synced: set[str] = set()
        # Elastic recovery on a rented cluster (dtrain.cluster.providers.replace): a lost
        # node's replacement is made in a thread; the loop launches it when it is ready.
        self.replacer = replacer
        self._replacing: dict[str, dict] = {}

    # -- control from outside (signal handlers, `dtrain stop`) --------------------------

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    # -- the run -------------------------------------------------------------------------

    def run(self) -> Outcome:
        logs = self.job_dir / "logs"
        private_dir(logs)
        self.combined = open_private(self.job_dir / "output.log", "a", buffering=1)
        self.watchdog = Watchdog(self.plan.hang_timeout, self.clock(), [n.name for n in self.plan.nodes])
        self.monitoring = Monitoring(self.plan, self.runners, self.job_dir, self._say)
        try:
            for launch in self.plan.nodes:
                if self.stop_reason is None:  # stopped before it began: nothing to start
                    self._start(launch, logs)
            return self._loop()
        finally:
            self._kill_all()
            self.monitoring.stop()
            for node in self.nodes.values():
                node.log.close()
            self.combined.close()
            if self.sync is not None:
                self.sync.remove()
            self.terminal.close()

    def _start(self, launch, logs: Path) -> None:
        runner = self.runners[launch.name]
        argv, cwd = node_command(launch, check_sync=launch.name not in self._synced)
        proc = runner.popen(
            argv, env=launch.env, cwd=cwd,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            # Own session: a Ctrl-C on the terminal reaches only the head, which then stops
            # the nodes in order, instead of killing the ssh clients under it.
            start_new_session=True,
        )
        node = _Node(launch, proc, open_private(logs / f"{launch.name}.log", "a", buffering=1))
        self.nodes[launch.name] = node
        threading.Thread(target=self._read, args=(launch.name, proc.stdout), daemon=True).start()

    def _read(self, name: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.lines.put((name, raw.decode("utf-8", "replace").rstrip("\r\n")))
        self.lines.put((name, None))

    def _loop(self) -> Outcome:
        failure: str | None = None
        hang: Hang | None = None
        while True:
            self._drain(timeout=0.2)
            now = self.clock()
            for node in list(self.nodes.values()):
                if node.end.exit_code is None and node.eof and node.proc.poll() is not None:
                    if node.sync_missing and self.stop_reason is None:
                        self._copy_then_launch(node)
                        continue
                    self._ended(node, now)
                    if failure is None and node.end.exit_code != 0 and self.stop_reason is None:
                        failure = self._on_node_failure(node)
            if self.stop_reason is None and (h := self.watchdog.check(now)) is not None:
                hang = h
                self._stop_state = "failed"
                self.stop("hang: " + h.describe())
            if self.stop_reason is not None:
                self._stop_nodes(now)
            elif now >= self._next_keepalive:
                self._keepalive()
                self._next_keepalive = now + KEEPALIVE
            self._launch_replacements()
            if all(n.end.exit_code is not None for n in self.nodes.values()) and not self._replacing:
                break
        return self._outcome(failure, hang)

    # -- code sync for the nodes whose launch found no code ----------------------------

    def _looked(self, name: str) -> None:
        """The node's launch got past (or failed) its marker check: once every such node
        has, the marker goes."""
        if name in self._to_look:
            self._to_look.discard(name)
            if not self._to_look and self.sync is not None:
                self.sync.remove()

    def _copy_then_launch(self, node: _Node) -> None:
        """Copy the code in the background (the loop goes on), then launch again."""
        if node.copy is None:
            node.copy = threading.Thread(target=self._copy, args=(node,), daemon=True)
            node.copy.start()
            return
        if node.copy.is_alive():
            return
        name = node.launch.name
        node.sync_missing = False
        if node.copy_error is not None:
            node.exit_reported = 1
            node.end.add(None, node.copy_error)
            self._say(f"[dtrain] {node.copy_error}")
            return  # the loop ends the node as failed
        self._say(f"[dtrain] code copied to {name} ({len(self.sync.files())} files)")
        self._synced.add(name)
        node.log.close()
        self._start(node.launch, self.job_dir / "logs")

    def _copy(self, node: _Node) -> None:
        try:
            self.sync.copy_to(self.runners[node.launch.name], node.launch.cwd)
        except Exception as exc:  # reported as the node's failure
            node.copy_error = f"copying the code to {node.launch.name} failed: {exc}".splitlines()[0]

    def _keepalive(self) -> None:
        for node in self.nodes.values():
            if node.end.exit_code is None and node.stop_sent_at is None:
                try:
                    node.proc.stdin.write(b"\n")
                    node.proc.stdin.flush()
                except (OSError, ValueError):
                    pass  # the node is going away; its exit is handled by the loop

    def _on_node_failure(self, node: _Node) -> str | None:
        """Fail fast, unless an elastic job can go on with the nodes it still has, or
        with a replacement for the lost one."""
        alive = [n for n in self.nodes.values() if n.end.exit_code is None]
        if self._replace(node, alive):
            return None
        if self.plan.rdzv == "elastic" and len(alive) >= self.min_nodes and not node.end.connection_lost:
            self._say(f"[dtrain] node {node.launch.name} left the job (exit {node.end.exit_code}); "
                      f"{len(alive)} node(s) continue")
            return None
        self._stop_state = "failed"
        reason = f"node {node.launch.name} failed (exit {node.end.exit_code}); stopping the other nodes"
        self.stop(reason)
        if alive:
            self._say(f"[dtrain] {reason}")
        return reason

    def _replace(self, node: _Node, alive: list[_Node]) -> bool:
        """Start making a replacement for `node` if it is lost (its connection, not just
        its workers: torchrun restarts those) and this job may have one: elastic, a
        replacer with replacements left, not the master (it holds the rendezvous)."""
        name = node.launch.name
        if (self.plan.rdzv != "elastic" or self.replacer is None or self.replacer.left <= 0 or not alive
                or not node.end.connection_lost or name == self.plan.nodes[0].name
                or self.stop_reason is not None):
            return False
        self.replacer.left -= 1
        self._say(f"[dtrain] node {name} lost (exit {node.end.exit_code}); replacing it "
                  f"({self.replacer.left} more replacement(s) allowed), the other nodes wait in the rendezvous")
        job = {"lost": node, "at": time.time()}

        def make() -> None:
            try:
                job["made"] = self.replacer(node.launch, self.plan)
            except Exception as exc:  # the loop fails the job with it
                job["error"] = f"replacing {name} failed: {exc}".splitlines()[0]

        job["thread"] = threading.Thread(target=make, daemon=True)
        job["thread"].start()
        self._replacing[name] = job
        return True

    def _launch_replacements(self) -> None:
        for name, job in list(self._replacing.items()):
            if job["thread"].is_alive():
                continue
            del self._replacing[name]
            if self.stop_reason is not None:  # the job ends anyway; `--down` ends the instance
                if "made" in job:
                    job["made"][1].close_job()
                continue
            if "error" in job:
                self._stop_state = "failed"
                self.stop(job["error"])
                self._say(f"[dtrain] {job['error']}")
                continue
            launch, runner = job["made"]
            self._record_replacement(name, job["lost"], launch, job["at"])
            job["lost"].log.close()
            self.runners[name].close_job()  # the lost machine's shared connection
            self.runners[name] = runner  # (the launcher closes the runners it handed in, this one too)
            self.plan = dataclasses.replace(self.plan, nodes=[launch if n.name == name else n for n in self.plan.nodes])
            self.watchdog.restart(self.clock())
            self._start(launch, self.job_dir / "logs")

    def _record_replacement(self, name: str, lost: _Node, launch, at: float) -> None:
        """One line per replacement in `replacements.jsonl` (the report reads it)."""
        event = {"node": name, "lost_at": at, "replaced_at": time.time(), "old_address": lost.launch.address,
                 "new_address": launch.address, "exit": lost.end.exit_code}
        with open_private(self.job_dir / "replacements.jsonl", "a") as fh:
            fh.write(json.dumps(event) + "\n")

    def _drain(self, timeout: float) -> None:
        try:
            item = self.lines.get(timeout=timeout)
        except queue.Empty:
            return
        until = time.monotonic() + DRAIN_SLICE_S
        while True:
            self._handle(*item)
            if time.monotonic() >= until:
                return  # the rest waits for the next round
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                return

    def _handle(self, name: str, line: str | None) -> None:
        node = self.nodes[name]
        now = self.clock()
        self._looked(name)
        if line is None:
            node.eof = True
            return
        if line.startswith(MARK):
            payload = json.loads(line[len(MARK):])
            if payload == SYNC_MISSING:
                node.sync_missing = True
                return
            if "hb" in payload:
                if node.up_at is None:
                    node.up_at = now
                # The agent waits until the ranks run (a heartbeat), or AGENT_AFTER_S for
                # ranks that never beat: started with them, its ssh session (a login
                # shell) and imports took 1-2 s from the ranks' start on shared cores.
                if payload["hb"] or now - node.up_at >= AGENT_AFTER_S:
                    self.monitoring.start_agent(name)
            self._marker(node, payload, now)
            return
        m = PREFIXED.match(line)
        if m and m.group("node") == name:
            rank, text, shown = int(m.group("rank")), m.group("text"), line
            self.monitoring.start_agent(name)  # a rank speaks: past its start-up
            if self.first_output_at is None:
                self.first_output_at = now
        else:
            rank, text, shown = None, line, f"[{name}] {line}"
            if _RESTART.search(line) and self.plan.rdzv == "elastic":
                self.watchdog.restart(now)
        node.end.add(rank, text)
        self.watchdog.output(name, rank, now)
        node.log.write(shown + "\n")
        self.combined.write(shown + "\n")
        self._say(shown, log=False)

    def _marker(self, node: _Node, payload: dict, now: float) -> None:
        if "hb" in payload:
            self.watchdog.heartbeats(node.launch.name, payload["hb"], now)
        if "exit" in payload:
            node.exit_reported = int(payload["exit"])
            if payload.get("stopped") and node.stop_sent_at is None:
                # The node ended the job itself (a signal there, the head's keep-alives lost):
                # said, and kept with its last lines for the summary's first failure.
                said = f"[dtrain] node {node.launch.name} stopped its job: {payload['stopped']}"
                node.end.add(None, said)
                node.log.write(said + "\n")
                self._say(said)

    def _say(self, text: str, log: bool = True) -> None:
        if log:
            self.combined.write(text + "\n")
        self.terminal.say(text)

    def _ended(self, node: _Node, now: float) -> None:
        rc = node.proc.returncode
        node.end.ended_at = now
        node.end.stopped_by_us = node.stop_sent_at is not None
        if node.exit_reported is None and rc != 0:
            # The wrapper never said goodbye: the connection (or the wrapper) died.
            node.end.connection_lost = True
        node.end.exit_code = node.exit_reported if node.exit_reported is not None else (rc if rc >= 0 else 128 - rc)

    def _stop_nodes(self, now: float) -> None:
        for node in self.nodes.values():
            if node.end.exit_code is not None:
                continue
            if node.stop_sent_at is None:
                node.stop_sent_at = now
                try:
                    node.proc.stdin.close()
                except OSError:
                    pass
            elif now - node.stop_sent_at > self.plan.grace + 15:
                node.proc.kill()
            elif now - node.stop_sent_at > self.plan.grace + 5:
                node.proc.terminate()

    def _kill_all(self) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                try:
                    node.proc.stdin.close()
                except OSError:
                    pass
                try:
                    node.proc.wait(timeout=self.plan.grace + 5)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait()

    def _outcome(self, failure: str | None, hang: Hang | None) -> Outcome:
        ends = [n.end for n in self.nodes.values()]
        cause = root_cause(ends)
        if hang is not None:
            return Outcome("failed", 1, self.stop_reason or "hang", None, hang, self.first_output_at)
        if self.stop_reason is not None and self._stop_state == "stopped":
            return Outcome("stopped", 130, self.stop_reason, None, None, self.first_output_at)
        ok = sum(1 for e in ends if e.exit_code == 0)
        enough = ok >= self.min_nodes if self.plan.rdzv == "elastic" else ok == len(ends)
        if failure is None and enough:
            return Outcome("succeeded", 0, "", None, None, self.first_output_at)
        code = cause.exit_code if cause and cause.exit_code else 1
        reason = (failure or (f"node {cause.node} failed" if cause else "nodes failed")).split(";")[0]
        return Outcome("failed", code, reason, cause, None, self.first_output_at)
