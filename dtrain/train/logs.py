"""Where rank 0's training metrics go: a JSONL log, TensorBoard events, the console.

Every other rank gets `NullLog`: only the main process writes files and prints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

from dtrain.paths import write_text_atomic

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"


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
    def message(self, text: str) -> None: ...
    def close(self) -> None: ...


class RunLog(NullLog):
    """metrics.jsonl + TensorBoard + a rich progress bar on `stream`."""

    def __init__(self, output_dir: str | Path, stream: TextIO, *, resume_step: int | None = None) -> None:
        """`resume_step`: the step a resumed run continues after (0 when --resume found no
        checkpoint); None for a run that was not asked to resume."""
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

    def start(self, total_steps: int, done_steps: int, description: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

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

    def message(self, text: str) -> None:
        self.console.print(text)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.tb.close()
        self.jsonl.close()
