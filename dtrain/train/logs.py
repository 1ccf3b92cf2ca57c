"""Where rank 0's training metrics go: a JSONL log, TensorBoard events, the console.

Every other rank gets `NullLog`: only the main process writes files and prints.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from dtrain.paths import write_text_atomic

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"
# Without a terminal: one progress line per this many seconds (a few dozen in a long run).
PLAIN_EVERY_S = 30.0


def drop_rows_after(path: Path, step: int) -> None:
    """Keep the rows of `path` up to `step`; a torn last row (a kill mid-write) goes too."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _row_step(line) <= step]
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(line if line.endswith("\n") else line + "\n" for line in kept))


def _row_step(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return float("inf")


class NullLog:
    def start(self, total_steps: int, done_steps: int, description: str) -> None: ...
    def train(self, step: int, epoch: int, values: dict[str, float]) -> None: ...
    def eval(self, step: int, epoch: int, values: dict[str, float]) -> None: ...
    def advance(self, steps: int, description: str) -> None: ...
    def retotal(self, total_steps: int) -> None: ...
    def message(self, text: str) -> None: ...
    def close(self) -> None: ...


class RunLog(NullLog):
    """metrics.jsonl + TensorBoard + a rich progress bar on `stream`."""

    def __init__(
        self, output_dir: str | Path, stream: TextIO, *, resume_step: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`resume_step`: the step a resumed run continues after (0 when --resume found no
        checkpoint); None for a run that was not asked to resume. `clock`: seconds, for
        the plain progress lines' pace and time left."""
        from rich.console import Console
        from torch.utils.tensorboard import SummaryWriter

        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        # Appending keeps a resumed run's history in one file; the rows (and TensorBoard's
        # events, by purge_step) a killed run wrote after its last checkpoint are dropped,
        # since the resumed run logs those steps again.
        if resume_step is not None:
            drop_rows_after(out / METRICS_FILE, resume_step)
        self.jsonl = open(out / METRICS_FILE, "a", buffering=1)
        self.tb = SummaryWriter(str(out / TB_DIR), purge_step=resume_step or None)
        self.console = Console(file=stream, stderr=False, highlight=False)
        self.progress = None
        self.task = None
        self.plain: PlainProgress | None = None
        self.clock = clock

    def start(self, total_steps: int, done_steps: int, description: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if not self.console.is_terminal:
            # Under the launcher (and in any log file) stdout is a pipe: a rich bar draws
            # nothing there until it stops, so a long run would look hung. Plain lines instead.
            self.plain = PlainProgress(total_steps, done_steps, self.clock)
            return
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            console=self.console, transient=False,
        )
        self.task = self.progress.add_task(description, total=total_steps, completed=done_steps)
        self.progress.start()

    def _record(self, kind: str, step: int, epoch: int, values: dict[str, Any]) -> None:
        row = {"kind": kind, "step": step, "epoch": epoch, "time": round(time.time(), 3), **values}
        self.jsonl.write(json.dumps(row) + "\n")
        for key, value in values.items():
            self.tb.add_scalar(f"{kind}/{key}", value, step)

    def train(self, step: int, epoch: int, values: dict[str, float]) -> None:
        self._record("train", step, epoch, values)

    def eval(self, step: int, epoch: int, values: dict[str, float]) -> None:
        self._record("val", step, epoch, values)
        self.tb.flush()

    def advance(self, steps: int, description: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=steps, description=description)
        elif self.plain is not None:
            line = self.plain.advance(steps, description)
            if line:
                self._print(line)

    def retotal(self, total_steps: int) -> None:
        """The run's steps changed (a time budget cut its epochs)."""
        if self.progress is not None:
            self.progress.update(self.task, total=total_steps)
        elif self.plain is not None:
            self.plain.total = total_steps

    def message(self, text: str) -> None:
        self._print(text)

    def _print(self, text: str) -> None:
        # Plain text: a path or class name in brackets is not rich markup, and a long line
        # stays one line (off a terminal rich would break it at its 80-column default,
        # leaving the launcher's rank prefix on a fragment).
        self.console.print(text, markup=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.tb.close()
        self.jsonl.close()


class PlainProgress:
    """Progress as one line per PLAIN_EVERY_S seconds (and one at the last step), for a console
    that is not a terminal: `step 180/558 (32 %) epoch 2/6 loss 0.1880, ~14 min left`."""

    def __init__(self, total: int, done: int, clock: Callable[[], float]) -> None:
        self.total, self.done, self.clock = total, done, clock
        # The pace counts only this process's steps: a resumed run's earlier ones took no time here.
        self.t0, self.done0 = clock(), done
        self.last = self.t0

    def advance(self, steps: int, description: str) -> str | None:
        self.done += steps
        now = self.clock()
        if now - self.last < PLAIN_EVERY_S and self.done < self.total:
            return None
        self.last = now
        pct = 100 * self.done / max(self.total, 1)
        line = f"step {self.done}/{self.total} ({pct:.0f} %) {description}"
        if self.done < self.total and self.done > self.done0:
            left = (now - self.t0) / (self.done - self.done0) * (self.total - self.done)
            line += f", ~{left / 60:.0f} min left" if left >= 120 else f", ~{left:.0f} s left"
        return line
