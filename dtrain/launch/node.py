"""The node wrapper: `python -m dtrain.launch.node [options] -- torchrun ...` on every node.

It makes a job's lifetime on a node follow the head's: torchrun runs in its own session
under this process (a child subreaper, so workers that torchrun leaves behind are
re-parented here and found), and the whole tree is stopped - SIGTERM to torchrun (which
passes it on to its workers) and to strays, then SIGKILL after a grace period - when stdin closes (the SSH connection or the head died), when the head's
keep-alive bytes on stdin stop for `--head-timeout` seconds (a network partition: the
TCP connection is silent, not closed), or on SIGTERM / SIGHUP / SIGINT. Nothing of the
job outlives it.

Output: torchrun's own lines pass through unchanged (worker lines already carry the
`[node:rN]` prefix from --log-line-prefix-template); at its start and once a second the
wrapper adds one status line starting with MARK (the ages of the ranks' heartbeat
files), and a last one with torchrun's exit code. The head strips those lines.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MARK = "@@dtrain@@ "
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def interface_towards(addr: str) -> str | None:
    """The network interface this host uses to reach `addr` (for GLOO/NCCL_SOCKET_IFNAME)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # UDP connect sends nothing; it only picks the route
            local_ip = s.getsockname()[0]
    except OSError:
        return None
    name = _primary_holder(local_ip)
    if name:
        return name
    import psutil  # secondary addresses (aliases): psutil lists them all

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == local_ip for a in addrs):
            return name
    return None


def _primary_holder(ip: str) -> str | None:
    """The interface whose (primary) IPv4 address is `ip`, asked with SIOCGIFADDR: no
    psutil import on the way to torchrun."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    req = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue  # no IPv4 address on it
                if socket.inet_ntoa(req[20:24]) == ip:
                    return name
    except OSError:
        pass
    return None


def heartbeat_ages(hb_dir: Path, now: float) -> dict[str, float]:
    ages = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(hb_dir):
            if entry.name.startswith("rank"):
                with contextlib.suppress(FileNotFoundError):
                    ages[entry.name[4:]] = round(now - entry.stat().st_mtime, 2)
    return ages


class NodeWrapper:
    def __init__(self, cmd: list[str], *, scratch: Path, grace: float, status_every: float,
                 env: dict[str, str], out=None, head_timeout: float = 0.0, watch_stdin: bool = True) -> None:
        self.cmd = cmd
        self.scratch = scratch
        self.grace = grace
        self.status_every = status_every
        self.env = env
        self.out = out or sys.stdout.buffer
        self.lock = threading.Lock()
        self.stop_reason: str | None = None
        self.stopping = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.head_timeout = head_timeout
        self.heard_from_head = time.monotonic()
        self.watch_stdin = watch_stdin

    def emit(self, data: bytes) -> None:
        with self.lock:
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, ValueError):
                self.request_stop("output closed")

    def mark(self, payload: dict) -> None:
        self.emit((MARK + json.dumps(payload) + "\n").encode())

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stopping.set()

    def run(self) -> int:
        hb_dir = Path(self.env.get("DTRAIN_HEARTBEAT_DIR", self.scratch / "heartbeat"))
        hb_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self.env, start_new_session=True, preexec_fn=_stopped_with(os.getpid()),
        )
        self.mark({"hb": {}})  # at once: the head learns this node is up (and starts its agent)
        pump = threading.Thread(target=self._pump, daemon=True)
        pump.start()
        if self.watch_stdin:
            threading.Thread(target=self._watch_stdin, daemon=True).start()
        while self.proc.poll() is None and not self.stopping.wait(self.status_every):
            self.mark({"hb": heartbeat_ages(hb_dir, time.time())})
            silent = time.monotonic() - self.heard_from_head
            if self.head_timeout and silent > self.head_timeout:
                self.request_stop(f"no word from the head for {silent:.0f} s")
        if self.stopping.is_set():
            self.stop_tree()
        rc = self.proc.wait()
        pump.join(timeout=5)
        self.stop_tree()  # workers torchrun may have left behind
        code = 128 - rc if rc < 0 else rc
        self.mark({"exit": code, "stopped": self.stop_reason})
        shutil.rmtree(self.scratch, ignore_errors=True)
        return code

    def _pump(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.emit(line if line.endswith(b"\n") else line + b"\n")

    def _watch_stdin(self) -> None:
        try:
            while sys.stdin.buffer.read1(4096):
                self.heard_from_head = time.monotonic()
        except (OSError, ValueError):
            pass
        self.request_stop("head connection closed")

    def _descendants(self) -> list:
        import psutil

        return psutil.Process().children(recursive=True)

    def stop_tree(self) -> None:
        """SIGTERM this process's own children, SIGKILL every descendant left after the grace period.

        The children are torchrun while it runs, and the processes re-parented here (this is
        their subreaper) once their parent is gone. Not torchrun's workers: torchrun sends
        them SIGTERM itself, to each worker's process group, and a second one from here
        landed in a worker's own SIGTERM handler while it was saving a checkpoint."""
        import psutil

        if not self._descendants():
            return
        for p in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            self._reap_orphans()
            if not [p for p in self._descendants() if p.status() != psutil.STATUS_ZOMBIE]:
                break
            time.sleep(0.05)
        for _ in range(50):  # new children may appear while we kill
            left = [p for p in self._descendants() if _not_zombie(p)]
            if not left:
                break
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            time.sleep(0.05)
            self._reap_orphans()

    def _reap_orphans(self) -> None:
        """Wait for re-parented children (not torchrun itself: Popen waits for that one)."""
        import psutil

        for p in psutil.Process().children():
            if self.proc is not None and p.pid == self.proc.pid:
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p.pid, os.WNOHANG)


def _stopped_with(parent: int):
    """A preexec_fn: the child (torchrun) gets SIGTERM when this wrapper dies, even by SIGKILL
    (the OOM killer, `kill -9`, the head's last resort on a local node), and then stops its
    workers as on any SIGTERM. Without it torchrun and the workers, each in a session of its
    own, ran on with nobody to stop them. The function is looked up before the fork."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the wrapper's own stop paths still apply
        return None

    def set_in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the wrapper died before the line above: too late for the signal
            os.kill(os.getpid(), signal.SIGTERM)

    return set_in_child


def _not_zombie(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.launch.node")
    parser.add_argument("--job", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--master", required=True, help="master address, to pick the interface")
    parser.add_argument("--scratch", required=True, type=Path)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--status-every", type=float, default=1.0)
    parser.add_argument("--head-timeout", type=float, default=0.0,
                        help="stop when the head's keep-alive stops this long (0: never)")
    # Under Slurm stdin is not a link to the head (srun gives tasks /dev/null): the
    # scheduler owns the node's lifetime and ends the step itself.
    parser.add_argument("--watch-stdin", choices=("yes", "no"), default="yes",
                        help="stop when stdin closes (the SSH head's connection)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command after --")
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # torchrun's tee'd lines must not wait in a buffer
    if "GLOO_SOCKET_IFNAME" not in env:
        ifname = interface_towards(args.master)
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
            env.setdefault("NCCL_SOCKET_IFNAME", ifname)
    wrapper = NodeWrapper(cmd, scratch=args.scratch, grace=args.grace, status_every=args.status_every, env=env,
                          head_timeout=args.head_timeout, watch_stdin=args.watch_stdin == "yes")
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: wrapper.request_stop(f"signal {signal.Signals(signum).name}"))
    return wrapper.run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # os._exit: the stdin watcher thread may sit in a blocking read, which would make a
    # normal interpreter shutdown abort.
    os._exit(code)
