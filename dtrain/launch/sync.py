"""Code sync: the head's working directory reaches every node that does not already see it.

Whether a node sees it is found out, not assumed: the head writes ONE marker file named
after the job into its directory (`CodeSync.write`) and each node looks for it in its own
workdir with ONE check (`guarded`: a NAS mount or the same path on a shared filesystem
finds it). A node without setup commands looks in its launch command itself (one SSH
session per node, not two); a node with setup commands is checked before they run
(`sees_code`, the same check with nothing behind it). The marker goes in ONE clean-up
(`CodeSync.remove`), once every node has looked or the launch is over.

The files sent are those git knows (`git ls-files`, so .gitignore is respected) or,
outside a repository, everything but a default ignore list, listed only once some node
needs them; the node's runner copies them (`CommandRunner.copy_tree`).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

MARKER_PREFIX = ".dtrain-sync-"
SYNC_MISSING = {"sync": "missing"}
DEFAULT_IGNORE = {".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache",
                  ".ruff_cache", "node_modules", ".ipynb_checkpoints", "runs", "wandb"}
LARGE_TREE_BYTES = 200 * 1024 * 1024


def marker_name(job_id: str) -> str:
    return f"{MARKER_PREFIX}{job_id}"


def can_mark(head_cwd: str) -> bool:
    """Whether the head can write the marker into its directory (a read-only directory:
    nothing can be checked, so nothing is synced)."""
    return os.access(head_cwd, os.W_OK)


def needs_check(node, cwd: str | None, head_cwd: str) -> bool:
    """Whether the code must be looked for on this node: not a local node in the head's
    own directory (nothing to check)."""
    if not cwd:
        return False
    if node.is_local:
        return Path(cwd).expanduser().resolve() != Path(head_cwd).resolve()
    return True


class CodeSync:
    """The head's side of one job's code sync: the marker and the listing of the files."""

    def __init__(self, root: str | Path, marker: str, warn=print) -> None:
        self.root = Path(root)
        self.marker = marker
        self.warn = warn
        self._files: list[str] | None = None
        self._lock = threading.Lock()

    def write(self) -> None:
        (self.root / self.marker).write_text(self.marker)

    def remove(self) -> None:
        try:
            (self.root / self.marker).unlink(missing_ok=True)
        except OSError:
            pass

    def files(self) -> list[str]:
        """The files to send, listed once (thread-safe); warns about a tree too large to
        copy comfortably."""
        with self._lock:
            if self._files is None:
                self._files = files_to_sync(self.root)
                size = sum((self.root / f).stat().st_size for f in self._files if (self.root / f).exists())
                if size > LARGE_TREE_BYTES:
                    self.warn(f"[dtrain] warning: the working directory holds {size / 2**20:.0f} MiB to sync; "
                              "add large data to .gitignore or put it on shared storage")
            return self._files

    def copy_to(self, runner, workdir: str) -> None:
        runner.copy_tree(self.root, self.files(), workdir)


def files_to_sync(root: Path) -> list[str]:
    """Relative paths of the files to copy (git's view when `root` is in a repository)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True, timeout=60, check=True,
        ).stdout
        # git prints names as stored (-z: unquoted); one that is not UTF-8 (a file from a
        # Windows zip) is kept as Python keeps any such name, and sent back as its own bytes.
        return sorted(p for p in (os.fsdecode(b) for b in out.split(b"\0"))
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


# Run by the node's login shell: `~` is the node user's home; a missing directory or
# marker prints MARK {"sync": "missing"} and starts nothing.
_GUARD = ('d=$1; case $d in "~") d=$HOME;; "~/"*) d=$HOME/${d#"~/"};; esac; '
          'cd "$d" 2>/dev/null && test -f "$2" || { printf "%s\\n" "$3"; exit 0; }; shift 3; exec "$@"')


def guarded(argv: list[str], cwd: str | None, marker: str) -> list[str]:
    """`argv`, run in `cwd` only if the marker is there (the one check)."""
    from dtrain.launch.node import MARK

    missing = MARK + json.dumps(SYNC_MISSING)
    return ["sh", "-c", _GUARD, "sh", cwd or ".", marker, missing, *argv]


def sees_code(runner, cwd: str, marker: str) -> bool:
    """The check alone, for a node whose setup commands need the code before its launch."""
    try:
        res = runner.run(guarded(["true"], cwd, marker), timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return res.returncode == 0 and json.dumps(SYNC_MISSING) not in res.stdout


def for_plan(plan, warn=print) -> CodeSync | None:
    """The code sync a plan asks for, or None (no node is checked)."""
    marker = next((n.sync_marker for n in plan.nodes if n.sync_marker), "")
    return CodeSync(plan.sync_root, marker, warn) if marker else None
