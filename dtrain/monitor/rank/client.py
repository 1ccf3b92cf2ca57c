"""Per-rank training metrics and heartbeat: the two-line API.

    from dtrain.monitor.rank.client import report_step
    report_step(step=s, epoch=e, loss=l, lr=lr, step_time_s=t, data_wait_s=w, samples=n)

The trainer calls it on every rank after every step; any user script may do the same.
It must never slow a step down, so:
- the environment is read once; with nothing configured a call is one attribute check;
- steps are summed in the process and sent to the node agent at most every 0.5 s (and
  at exit) as one small UDP datagram on a non-blocking socket
  (`DTRAIN_AGENT_ADDR=host:port`) holding cumulative counters and the last values.
  UDP because a dead or busy agent must not stall or crash training; cumulative
  counters because then a lost datagram loses nothing. Batching because waking the
  agent for every step of a fast model cost it ~2 % of a core at 100 steps/s;
- the heartbeat file `$DTRAIN_HEARTBEAT_DIR/rank{RANK}` (read by the launch watchdog)
  is touched at most once per second.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path

AGENT_ADDR_ENV = "DTRAIN_AGENT_ADDR"
HEARTBEAT_DIR_ENV = "DTRAIN_HEARTBEAT_DIR"
HEARTBEAT_PERIOD_S = 1.0
SEND_PERIOD_S = 0.5


class _Reporter:
    """Per-process state; built lazily on the first call so imports stay free."""

    def __init__(self, environ: dict[str, str] | os._Environ = os.environ) -> None:
        self.rank = _int(environ.get("RANK"), 0)
        self.local_rank = _int(environ.get("LOCAL_RANK"), self.rank)
        self.job = environ.get("DTRAIN_JOB_ID", "")
        self.pid = os.getpid()
        self.sock: socket.socket | None = None
        self.dest: tuple[str, int] | None = None
        addr = environ.get(AGENT_ADDR_ENV, "").strip()
        if addr:
            host, _, port = addr.rpartition(":")
            try:
                family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
                if not 0 < int(port) < 65536:  # sendto would raise OverflowError at every step
                    raise ValueError(f"port {port} out of range")
                self.dest = (host.strip("[]") or "127.0.0.1", int(port))
                self.sock = socket.socket(family, socket.SOCK_DGRAM)
                self.sock.setblocking(False)
            except (ValueError, OSError):
                # A malformed address must not take training down; metrics are best effort.
                self.sock, self.dest = None, None
        self.next_send = 0.0
        self.totals = {"steps_total": 0, "step_time_total": 0.0, "data_wait_total": 0.0, "samples_total": 0}
        self.last: dict = {}
        self.last_step_time: float | None = None
        if self.sock is not None:
            atexit.register(self.flush)
        hb_dir = environ.get(HEARTBEAT_DIR_ENV, "").strip()
        self.heartbeat: Path | None = Path(hb_dir) / f"rank{self.rank}" if hb_dir else None
        self.next_beat = 0.0
        self.active = self.sock is not None or self.heartbeat is not None

    def add(self, now: float, step_time_s: float, data_wait_s: float, samples: int, last: dict) -> None:
        tot = self.totals
        tot["steps_total"] += 1
        tot["step_time_total"] += float(step_time_s)
        tot["data_wait_total"] += float(data_wait_s)
        tot["samples_total"] += int(samples)
        self.last = last
        self.last_step_time = float(step_time_s)
        if now >= self.next_send:
            self.next_send = now + SEND_PERIOD_S
            self.flush()

    def flush(self) -> None:
        if self.sock is None or self.dest is None or not self.last or self.pid != os.getpid():
            return
        loss = self.last.get("loss")
        payload = {
            "v": 2, "job": self.job, "rank": self.rank, "local_rank": self.local_rank, "pid": self.pid,
            "t": time.time(), **self.totals, **self.last,
            "loss": None if loss is None else float(loss), "last_step_time": self.last_step_time,
        }  # fmt: skip
        try:
            self.sock.sendto(json.dumps(payload, separators=(",", ":")).encode(), self.dest)
        except (OSError, ValueError, OverflowError):
            # BlockingIOError (buffer full), ConnectionRefused (agent gone): the next
            # datagram carries the same counters. ValueError: a last value json cannot write.
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
    if _reporter is None:
        _reporter = _Reporter()
    return _reporter


def _forget_after_fork() -> None:
    # A forked child (a data loader worker) must not report as its parent's rank.
    global _reporter
    _reporter = None


os.register_at_fork(after_in_child=_forget_after_fork)


def reset() -> None:
    """Forget the cached environment (tests, or a script that changes it)."""
    global _reporter
    if _reporter is not None and _reporter.sock is not None:
        _reporter.flush()
        atexit.unregister(_reporter.flush)
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
    now = time.monotonic()
    rep.beat(now)
    if rep.sock is not None:
        # `loss` may be a tensor: it is converted (a device sync) only when sent
        rep.add(now, step_time_s, data_wait_s, samples,
                {"step": int(step), "epoch": int(epoch), "loss": loss, "lr": None if lr is None else float(lr)})


def _int(text: str | None, default: int) -> int:
    """An environment number, or `default` for one that is absent or not a number (a user's
    own launcher may set RANK=""): metrics must not take a training step down."""
    try:
        return int(text) if text not in (None, "") else default
    except ValueError:
        return default
