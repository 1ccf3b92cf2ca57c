"""Get the nodes with setup commands ready before torchrun starts: the code in place (the
check of sync.py, before the commands that may need it), then the commands, in parallel.

Nodes without setup commands have nothing to do here: their launch checks for the code
itself (plan.node_command), and the session copies it where it is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import TextIO

from dtrain.errors import DtrainError
from dtrain.launch.sync import CodeSync, sees_code

SETUP_TIMEOUT = 1800.0


def prepare_nodes(plan, cluster, runners: dict, sync: CodeSync | None, *, out: TextIO) -> None:
    """Raises DtrainError naming the node whose copy or setup command failed."""
    busy = [launch for launch in plan.nodes if cluster.node(launch.name).setup]
    if not busy:  # the common launch: no thread pool to start
        return

    running = _Running()

    def one(launch) -> str | None:
        runner = runners[launch.name]
        copied = None
        if sync is not None and launch.sync_marker and not sees_code(runner, launch.cwd, launch.sync_marker):
            sync.copy_to(runner, launch.cwd)
            copied = launch.name
        for command in cluster.node(launch.name).setup:
            code, output = running.run(runner, command, launch)
            if code != 0:
                tail = output.strip().splitlines()[-3:]
                raise DtrainError(f"setup command {command!r} failed on {launch.name} (exit {code}): "
                                  + " | ".join(tail), "fix the node's setup commands in cluster.yaml")
        return copied

    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=len(busy))
    try:
        copied = [c for c in pool.map(one, busy) if c]
    except BaseException:
        # A node's command failed, or the job is being stopped (Ctrl-C, `dtrain stop`): the
        # other nodes' commands are ended too, rather than waited for (up to SETUP_TIMEOUT).
        running.end_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if copied:
        out.write(f"[dtrain] code copied to {', '.join(copied)} ({len(sync.files())} files)\n")


class _Running:
    """The setup commands running now, each in a process group of its own, so that a stop
    ends them with everything they started (a local `sh -c` and its children, or the ssh
    client that carries a remote one)."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._ended = False

    def run(self, runner, command: str, launch) -> tuple[int, str]:
        """(exit code, stderr or else stdout) of `command` on the node."""
        with self._lock:
            if self._ended:  # the job is stopping: no new command starts
                return 130, "stopped"
            proc = runner.popen(["sh", "-c", command], env=launch.env, cwd=launch.cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
                                errors="replace", start_new_session=True)
            self._procs.add(proc)
        try:
            out, err = proc.communicate(timeout=SETUP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._end(proc)
            raise DtrainError(f"setup command {command!r} on {launch.name} still ran after {SETUP_TIMEOUT:.0f} s",
                              "make it faster, or run it once by hand on the node") from None
        finally:
            with self._lock:
                self._procs.discard(proc)
        return proc.returncode, err or out

    def end_all(self) -> None:
        with self._lock:
            self._ended = True
            procs = list(self._procs)
        for proc in procs:
            self._end(proc)

    @staticmethod
    def _end(proc: subprocess.Popen, grace: float = 5.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue
