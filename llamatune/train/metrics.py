"""The metrics log: one JSON object per line, one line per optimizer step and one per
evaluation, the format of HF Trainer's `trainer_state.json` log history and mlx-lm's
reports, written as JSON lines so a running or killed run's file stays readable.

    {"step": 12, "loss": 2.31, "lr": 0.001, "grad_norm": 0.84, "tokens_per_s": 812.5, "tokens": 18432}
    {"step": 12, "val_loss": 2.47}

Preference runs (--method dpo / orpo) add TRL's per-step metrics to step lines
("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
"logps/chosen", "logps/rejected"; ORPO also "nll_loss") and the same with an "eval_"
prefix to evaluation lines.

`step` is the number of optimizer steps done (0 before the first), `tokens` the loss
targets trained on so far, `tokens_per_s` the loss targets of this step per second of
it (padding does not count, so packed and padded batches compare fairly). A resumed run first keeps only the lines
up to its checkpoint's step (a half-written last line included in what is dropped) and
then appends, so a killed and resumed run leaves the same file as one uninterrupted run,
timings aside.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..formats.gguf_io import atomic_path


def _parse(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _number(x: float) -> float | None:
    """JSON has no NaN or infinity: they are written as null."""
    return float(x) if math.isfinite(x) else None


class MetricsLog:
    """Append-only JSON-lines log of a run; `resume_step` > 0 keeps the lines up to that step.
    With write=False (MPI ranks other than 0) nothing is read or written."""

    def __init__(self, path: Path, resume_step: int = 0, write: bool = True):
        self.path = Path(path)
        self._file = None
        self._t = time.perf_counter()
        if not write:
            return
        kept: list[str] = []
        if resume_step > 0 and self.path.exists():
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
            kept = [ln for ln in lines if (row := _parse(ln)) is not None and row["step"] <= resume_step]
        with atomic_path(self.path) as tmp:              # never leaves a half-cut file behind
            tmp.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        self._file = open(self.path, "a", encoding="utf-8")
        self._t = time.perf_counter()

    def _write(self, row: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def begin_step(self) -> None:
        """Start the clock of one optimizer step (evaluations and saves are not timed)."""
        self._t = time.perf_counter()

    def step(self, state, loss: float, lr: float, grad_norm: float, n_targets: int,
             extra: dict[str, float] | None = None) -> None:
        """One optimizer step that trained on n_targets loss targets; `extra`: more values
        (preference pairs: TRL's rewards/... and logps/...)."""
        seconds = max(time.perf_counter() - self._t, 1e-9)
        self._write({"step": state.iteration, "loss": _number(loss), "lr": float(lr),
                     "grad_norm": _number(grad_norm), "tokens_per_s": round(n_targets / seconds, 1),
                     "tokens": int(state.token_count), **{k: _number(v) for k, v in (extra or {}).items()}})

    def eval(self, step: int, val_loss: float, extra: dict[str, float] | None = None) -> None:
        self._write({"step": step, "val_loss": _number(val_loss), **{k: _number(v) for k, v in (extra or {}).items()}})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
