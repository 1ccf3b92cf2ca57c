"""Signals turned into exceptions for a block, so its `finally`/`except` clean-up runs."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# What each stop signal means to a job: the registry's reason when it stops one.
STOP_REASONS = {
    signal.SIGTERM: "stopped (SIGTERM, e.g. dtrain stop)",
    signal.SIGHUP: "stopped (SIGHUP: the terminal went away)",
    signal.SIGINT: "interrupted (Ctrl-C)",
}


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP raised in a block that already cleans up after Ctrl-C: the same
    clean-up (and exit status 130), with the signal's own reason."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(STOP_REASONS[sig])
        self.reason = STOP_REASONS[sig]


@contextmanager
def raising(signals: tuple[signal.Signals, ...], exc: Callable[[signal.Signals], BaseException]) -> Iterator[None]:
    """While the block runs, each of `signals` raises `exc(signal)`; the previous handlers
    come back after it (installed even where a signal was ignored: the caller asked)."""

    def _raise(signum: int, frame: object) -> None:
        raise exc(signal.Signals(signum))

    old = {sig: signal.signal(sig, _raise) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
