"""Get the nodes with setup commands ready before torchrun starts: the code in place (the
check of sync.py, before the commands that may need it), then the commands, in parallel.

Nodes without setup commands have nothing to do here: their launch checks for the code
itself (plan.node_command), and the session copies it where it is missing.
"""

from __future__ import annotations

from typing import TextIO

from dtrain.errors import DtrainError
from dtrain.launch.sync import CodeSync, sees_code

SETUP_TIMEOUT = 1800.0


def prepare_nodes(plan, cluster, runners: dict, sync: CodeSync | None, *, out: TextIO) -> None:
    """Raises DtrainError naming the node whose copy or setup command failed."""
    busy = [launch for launch in plan.nodes if cluster.node(launch.name).setup]
    if not busy:  # the common launch: no thread pool to start
        return

    def one(launch) -> str | None:
        runner = runners[launch.name]
        copied = None
        if sync is not None and launch.sync_marker and not sees_code(runner, launch.cwd, launch.sync_marker):
            sync.copy_to(runner, launch.cwd)
            copied = launch.name
        for command in cluster.node(launch.name).setup:
            res = runner.run(["sh", "-c", command], timeout=SETUP_TIMEOUT, env=launch.env, cwd=launch.cwd)
            if res.returncode != 0:
                tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
                raise DtrainError(f"setup command {command!r} failed on {launch.name} (exit {res.returncode}): "
                                  + " | ".join(tail), "fix the node's setup commands in cluster.yaml")
        return copied

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(busy)) as pool:
        copied = [c for c in pool.map(one, busy) if c]
    if copied:
        out.write(f"[dtrain] code copied to {', '.join(copied)} ({len(sync.files())} files)\n")
