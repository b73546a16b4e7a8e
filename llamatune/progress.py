"""Progress display on stderr (rich): a bar with a free-form status text, ETA and rate."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

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


class _TrainDisplay:
    """`show(state, loss, lr, gnorm, tokens_per_s)` updates the bar; `show.line(text)` prints above it;
    `show.refresh(state)` redraws the last status with the state's new validation loss."""

    def __init__(self, progress: Progress | None, task, ranks: int = 1, compact: bool = False):
        self.progress, self.task, self.ranks, self.compact = progress, task, ranks, compact
        self.last: tuple | None = None        # (loss, lr, gnorm, tps) of the last update
        self.note = ""                         # the objective's figures (GRPO: reward, sampling speed)

    def __call__(self, state, loss: float, lr: float, gnorm: float, tps: float) -> None:
        self.last = (loss, lr, gnorm, tps)
        if self.progress is None:
            return
        self.progress.update(self.task, completed=state.iteration, status=self.status(state, loss, lr, gnorm, tps))

    def status(self, state, loss: float, lr: float, gnorm: float, tps: float) -> str:
        skipped = (state.guard or {}).get("bad_total", 0)      # steps the divergence guard skipped
        fields = [] if self.compact else [f"epoch {state.epoch}"]
        fields += [f"skipped {skipped}"] if skipped else []
        fields += [f"loss {loss:.4f} (avg {state.loss_ema:.4f})"]
        fields += [] if self.compact else [f"lr {lr:.2e}", f"|g| {gnorm:.3f}"]
        fields += [f"{tps:,.0f} tok/s" + (f" ({tps / self.ranks:,.0f} per rank)" if self.ranks > 1 else "")]
        fields += [self.note] if self.note else []
        v = state.validation
        if v is not None and v.last_loss is not None:
            fields += [f"val {v.last_loss:.4f}"]
        return (" " if self.compact else "  ").join(fields)

    def refresh(self, state) -> None:
        if self.last is not None:
            self(state, *self.last)

    def line(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)


class _LogDisplay(_TrainDisplay):
    """The training display when stderr is not a terminal (a log file, a batch job): a
    plain line every `every` seconds (0: every step) and at the last step, as tqdm
    writes to logs; a live bar would show there only at the end."""

    def __init__(self, total: int, ranks: int, every: float):
        super().__init__(None, None, ranks, compact=False)
        self.total, self.every, self.started = total, every, time.monotonic()
        self.shown = float("-inf")

    def __call__(self, state, loss: float, lr: float, gnorm: float, tps: float) -> None:
        self.last = (loss, lr, gnorm, tps)
        now = time.monotonic()
        if now - self.shown < self.every and state.iteration < self.total:
            return
        self.shown = now
        elapsed = int(now - self.started)
        err.print(f"train {state.iteration}/{self.total} {self.status(state, loss, lr, gnorm, tps)}  "
                  f"elapsed {elapsed // 60}:{elapsed % 60:02d}", markup=False, highlight=False, soft_wrap=True)

    def line(self, text: str) -> None:
        err.print(text, markup=False, highlight=False, soft_wrap=True)


WIDE_CONSOLE = 140       # columns the full training line needs


@contextlib.contextmanager
def train_progress(total: int, start: int, quiet: bool = False, ranks: int = 1,
                   every: float = 30.0) -> Iterator[_TrainDisplay]:
    """Training display: iteration bar with epoch, loss, its moving average, lr, gradient norm,
    tokens/s (in total and per rank when data-parallel over `ranks` MPI ranks), validation
    loss, elapsed and ETA. On a console narrower than WIDE_CONSOLE (80 columns when output is
    not a terminal) the bar, epoch, lr, gradient norm and elapsed time are left out, so that
    the rest fits on the line uncut (metrics.jsonl has them all). When stderr is not a
    terminal: a whole line every `every` seconds instead (_LogDisplay)."""
    if quiet:
        yield _TrainDisplay(None, None)
        return
    if not err.is_terminal:
        yield _LogDisplay(total, ranks, every)
        return
    compact = err.width < WIDE_CONSOLE
    bar, elapsed = ((), ()) if compact else ((BarColumn(bar_width=24),), (TimeElapsedColumn(),))
    columns = (TextColumn("[bold]train[/bold]"), *bar, MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), *elapsed, TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("train", total=total, completed=start, status="")
        yield _TrainDisplay(progress, task, ranks, compact)
