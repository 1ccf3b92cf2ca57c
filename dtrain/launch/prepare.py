"""Get every node ready before torchrun starts: the code in place, setup commands run.

Code sync: the working directory is copied to a node's workdir unless that node already
sees it, which is found out, not assumed: the head writes a marker file named after the
job into its working directory and each node looks for it in its own workdir (a NAS
mount or the same path on a shared filesystem finds it). A node without setup commands
looks in its launch command (`plan.node_command`: one SSH session per node, not two);
the others are checked here, before their setup commands run. The files sent are those
git knows (`git ls-files`, so .gitignore is respected) or, outside a repository,
everything but a default ignore list, listed only once some node needs them. rsync over
ssh when both ends have it, else a tar stream through the node's runner (which works for
every runner)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
from pathlib import Path
from typing import TextIO

from dtrain.errors import DtrainError
from dtrain.launch.plan import MARKER_PREFIX

DEFAULT_IGNORE = {".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache",
                  ".ruff_cache", "node_modules", ".ipynb_checkpoints", "runs", "wandb"}
LARGE_TREE_BYTES = 200 * 1024 * 1024
SETUP_TIMEOUT = 1800.0


def files_to_sync(root: Path) -> list[str]:
    """Relative paths of the files to copy (git's view when `root` is in a repository)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True, timeout=60, check=True,
        ).stdout
        return sorted(p for p in out.decode().split("\0")
                      if p and not _is_marker(p) and (root / p).is_file())
    except (OSError, subprocess.SubprocessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in DEFAULT_IGNORE]
        for name in filenames:
            if not name.endswith((".pyc", ".pyo")) and not _is_marker(name):
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(files)


def _is_marker(path: str) -> bool:
    return os.path.basename(path).startswith(MARKER_PREFIX)


class Listing:
    """The files to send, listed once (thread-safe) and only when some node needs them;
    `warn` hears about a tree too large to copy comfortably."""

    def __init__(self, root: Path, warn) -> None:
        self.root = root
        self.warn = warn
        self._files: list[str] | None = None
        self._lock = threading.Lock()

    def files(self) -> list[str]:
        with self._lock:
            if self._files is None:
                self._files = files_to_sync(self.root)
                size = sum((self.root / f).stat().st_size for f in self._files if (self.root / f).exists())
                if size > LARGE_TREE_BYTES:
                    self.warn(f"[dtrain] warning: the working directory holds {size / 2**20:.0f} MiB to sync; "
                              "add large data to .gitignore or put it on shared storage")
            return self._files


def sees_marker(runner, workdir: str, marker: str) -> bool:
    try:
        res = runner.run(["test", "-f", f"{workdir.rstrip('/')}/{marker}"], timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return res.returncode == 0


def copy_tree(runner, root: Path, files: list[str], workdir: str) -> None:
    listing = "".join(f + "\0" for f in files).encode()
    if getattr(runner, "name", "") == "ssh" and shutil.which("rsync"):
        ssh = runner.ssh_argv()[:-2]  # without "--" and the destination
        cmd = ["rsync", "-a", "--from0", "--files-from=-", "-e", shlex.join(ssh),
               "--rsync-path", f"mkdir -p {shlex.quote(workdir)} && rsync",
               f"{root}/", f"{runner.node.host}:{workdir}/"]
        res = subprocess.run(cmd, input=listing, capture_output=True, timeout=SETUP_TIMEOUT)
        if res.returncode == 0:
            return
        # rsync missing on the node (exit 127 through ssh) -> fall back to tar below
        if b"command not found" not in res.stderr and res.returncode != 127:
            raise DtrainError(f"copying the code to {runner.node.name} failed: "
                              f"{res.stderr.decode(errors='replace').strip()[-300:]}",
                              "check the node's disk and workdir, or set sync: never")
    tar = subprocess.Popen(["tar", "-C", str(root), "--null", "-T", "-", "-cf", "-"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    recv = runner.popen(["sh", "-c", 'mkdir -p "$1" && exec tar -C "$1" -xf -', "sh", workdir],
                        stdin=tar.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tar.stdout.close()
    tar.stdin.write(listing)
    tar.stdin.close()
    _, err = recv.communicate(timeout=SETUP_TIMEOUT)
    tar.wait(timeout=60)
    if recv.returncode != 0 or tar.returncode != 0:
        raise DtrainError(f"copying the code to {runner.node.name} failed: {err.decode(errors='replace').strip()[-300:]}",
                          "check the node's disk and workdir, or set sync: never")


def prepare_nodes(plan, cluster, runners: dict, job, *, out: TextIO) -> None:
    root = Path(os.getcwd())
    marker = f"{MARKER_PREFIX}{plan.job_id}"
    marker_path = root / marker
    if job.sync == "auto":
        try:
            marker_path.write_text(plan.job_id)
        except OSError:  # a read-only directory: nothing can be checked, nothing is synced
            marker_path = None
            for launch in plan.nodes:
                launch.sync_marker = ""
    # Nodes whose launch checks for the marker itself keep it until they have looked
    # (the job session removes it then); the others are checked here.
    deferred = any(launch.sync_marker for launch in plan.nodes)
    listing = Listing(root, lambda text: out.write(text + "\n"))

    def checked_here(launch) -> bool:
        if job.sync != "auto" or marker_path is None or not launch.cwd or launch.sync_marker:
            return False
        node = cluster.node(launch.name)
        return not (node.is_local and Path(launch.cwd).expanduser().resolve() == root.resolve())

    try:
        def one(launch) -> str | None:
            runner = runners[launch.name]
            node = cluster.node(launch.name)
            copied = None
            if checked_here(launch) and not sees_marker(runner, launch.cwd, marker):
                copy_tree(runner, root, listing.files(), launch.cwd)
                copied = launch.name
            for command in node.setup:
                res = runner.run(["sh", "-c", command], timeout=SETUP_TIMEOUT, env=launch.env, cwd=launch.cwd)
                if res.returncode != 0:
                    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
                    raise DtrainError(f"setup command {command!r} failed on {launch.name} (exit {res.returncode}): "
                                      + " | ".join(tail), "fix the node's setup commands in cluster.yaml")
            return copied

        busy = [launch for launch in plan.nodes if cluster.node(launch.name).setup or checked_here(launch)]
        copied = []
        if busy:  # (nothing to do here is the common launch: no thread pool to start)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=len(busy)) as pool:
                copied = [c for c in pool.map(one, busy) if c]
        if copied:
            out.write(f"[dtrain] code copied to {', '.join(copied)} ({len(listing.files())} files)\n")
    except BaseException:
        deferred = False
        raise
    finally:
        if marker_path is not None and not deferred:
            marker_path.unlink(missing_ok=True)
