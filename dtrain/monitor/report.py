"""Per-rank training metrics and heartbeat: the two-line API.

    from dtrain.monitor.report import report_step
    report_step(step=s, epoch=e, loss=l, lr=lr, step_time_s=t, data_wait_s=w, samples=n)

The trainer calls it on every rank after every step; any user script may do the same.
It must never slow a step down, so:
- the environment is read once; with nothing configured a call is one attribute check;
- metrics go to the node agent as one small UDP datagram on a non-blocking socket
  (`DTRAIN_AGENT_ADDR=host:port`). UDP because a dead or busy agent must not stall or
  crash training: a lost datagram costs one sample, a full buffer drops it silently;
- the heartbeat file `$DTRAIN_HEARTBEAT_DIR/rank{RANK}` (read by the launch watchdog)
  is touched at most once per second.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

AGENT_ADDR_ENV = "DTRAIN_AGENT_ADDR"
HEARTBEAT_DIR_ENV = "DTRAIN_HEARTBEAT_DIR"
HEARTBEAT_PERIOD_S = 1.0


class _Reporter:
    """Per-process state; built lazily on the first call so imports stay free."""

    def __init__(self, environ: dict[str, str] | os._Environ = os.environ) -> None:
        self.rank = int(environ.get("RANK", "0") or 0)
        self.local_rank = int(environ.get("LOCAL_RANK", str(self.rank)) or 0)
        self.job = environ.get("DTRAIN_JOB_ID", "")
        self.pid = os.getpid()
        self.sock: socket.socket | None = None
        self.dest: tuple[str, int] | None = None
        addr = environ.get(AGENT_ADDR_ENV, "").strip()
        if addr:
            host, _, port = addr.rpartition(":")
            try:
                family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
                self.dest = (host.strip("[]") or "127.0.0.1", int(port))
                self.sock = socket.socket(family, socket.SOCK_DGRAM)
                self.sock.setblocking(False)
            except (ValueError, OSError):
                # A malformed address must not take training down; metrics are best effort.
                self.sock, self.dest = None, None
        hb_dir = environ.get(HEARTBEAT_DIR_ENV, "").strip()
        self.heartbeat: Path | None = Path(hb_dir) / f"rank{self.rank}" if hb_dir else None
        self.next_beat = 0.0
        self.active = self.sock is not None or self.heartbeat is not None

    def send(self, payload: dict) -> None:
        if self.sock is None or self.dest is None:
            return
        try:
            self.sock.sendto(json.dumps(payload, separators=(",", ":")).encode(), self.dest)
        except OSError:
            # BlockingIOError (buffer full), ConnectionRefused (agent gone): drop the sample.
            pass

    def beat(self, now: float) -> None:
        if self.heartbeat is None or now < self.next_beat:
            return
        self.next_beat = now + HEARTBEAT_PERIOD_S
        try:
            self.heartbeat.touch()
        except FileNotFoundError:
            try:
                self.heartbeat.parent.mkdir(parents=True, exist_ok=True)
                self.heartbeat.touch()
            except OSError:
                pass
        except OSError:
            pass


_reporter: _Reporter | None = None


def _get() -> _Reporter:
    global _reporter
    if _reporter is None or _reporter.pid != os.getpid():
        # Rebuilt after fork: a child must not share its parent's identity.
        _reporter = _Reporter()
    return _reporter


def reset() -> None:
    """Forget the cached environment (tests, or a script that changes it)."""
    global _reporter
    if _reporter is not None and _reporter.sock is not None:
        _reporter.sock.close()
    _reporter = None


def report_step(
    *,
    step: int,
    epoch: int = 0,
    loss: float | None = None,
    lr: float | None = None,
    step_time_s: float,
    data_wait_s: float = 0.0,
    samples: int = 0,
) -> None:
    """Report one finished training step of this rank (see the module docstring)."""
    rep = _get()
    if not rep.active:
        return
    rep.beat(time.monotonic())
    if rep.sock is None:
        return
    rep.send(
        {
            "v": 1,
            "job": rep.job,
            "rank": rep.rank,
            "local_rank": rep.local_rank,
            "pid": rep.pid,
            "t": time.time(),
            "step": int(step),
            "epoch": int(epoch),
            "loss": None if loss is None else float(loss),
            "lr": None if lr is None else float(lr),
            "step_time_s": float(step_time_s),
            "data_wait_s": float(data_wait_s),
            "samples": int(samples),
        }
    )
