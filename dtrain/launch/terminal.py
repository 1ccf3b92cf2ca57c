"""The head's lines for the user's terminal, written by a thread of their own.

The head's loop also sends the keep-alives the nodes live by (a node that hears nothing
from the head for plan.HEAD_TIMEOUT seconds stops its job), acts on stop and fails fast.
A terminal that stops reading - a pager (`| less`), Ctrl-S, a slow pipe - blocked the
loop's writes, and 20 s later every node stopped a healthy job. Here a write only queues
the line. Lines past BACKLOG waiting are not shown: they are all in the job's logs
(output.log, `dtrain logs`), and the terminal is told how many it missed.
"""

from __future__ import annotations

import queue
import threading
from typing import TextIO

# Lines waiting for the terminal before new ones are left out (~1-2 MB of text).
BACKLOG = 10_000
_END = object()


class TerminalWriter:
    def __init__(self, out: TextIO, *, missed_hint: str = "`dtrain logs` has every line", backlog: int = BACKLOG) -> None:
        self.out = out
        self.missed_hint = missed_hint
        self._lines: queue.Queue = queue.Queue(maxsize=backlog)
        self._missed = 0
        self._lock = threading.Lock()
        self._broken = False  # the terminal went away (a closed pipe): lines are dropped silently
        self._thread = threading.Thread(target=self._write, name="dtrain-terminal", daemon=True)
        self._thread.start()

    def say(self, text: str) -> None:
        """Queue one line (without its newline); never blocks."""
        try:
            self._lines.put_nowait(text)
        except queue.Full:
            with self._lock:
                self._missed += 1

    def close(self) -> None:
        """Write what is queued, then stop: blocks until the terminal has taken it."""
        self._lines.put(_END)
        self._thread.join()

    def _write(self) -> None:
        while True:
            batch = [self._lines.get()]
            while True:  # one flush per burst, not per line: a flooding job is written in blocks
                try:
                    batch.append(self._lines.get_nowait())
                except queue.Empty:
                    break
            done = any(item is _END for item in batch)
            lines = [item for item in batch if item is not _END]
            self._flush(self._note_missed(lines))
            if done:
                return

    def _note_missed(self, lines: list[str]) -> list[str]:
        with self._lock:
            missed, self._missed = self._missed, 0
        if missed:
            lines = [f"[dtrain] {missed} line(s) not shown here: the terminal was not reading fast enough "
                     f"({self.missed_hint})", *lines]
        return lines

    def _flush(self, lines: list[str]) -> None:
        if not lines or self._broken:
            return
        try:
            self.out.write("".join(line + "\n" for line in lines))
            self.out.flush()
        except (OSError, ValueError):  # a closed pipe or stream: the logs still have every line
            self._broken = True
