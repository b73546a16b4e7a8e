"""Progress display on stderr (rich): a bar with a free-form status text, ETA and rate."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .console import err


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int, str], None]]:
    """Yield `update(done, total, status)`; the bar disappears when done is total."""
    columns = (TextColumn(f"[bold]{label}[/bold]"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(label, total=None, status="")

        def update(done: int, total: int, status: str = "") -> None:
            progress.update(task, completed=done, total=total, status=status)

        yield update
