"""Rich progress bars behind a plain callback, so library code never imports rich."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

Advance = Callable[[int], None]


@contextmanager
def progress_bars(stream: TextIO) -> Iterator[Callable[[str, int], Advance]]:
    """Yields `start(description, total) -> advance(n)`; each start adds one bar on `stream`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=stream), transient=False) as bar:

        def start(description: str, total: int) -> Advance:
            task = bar.add_task(description, total=total)
            return lambda n=1: bar.update(task, advance=n)

        yield start
