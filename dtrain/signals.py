"""Signals turned into exceptions for a block, so its `finally`/`except` clean-up runs."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager


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
