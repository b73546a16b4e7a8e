"""Divergence guard: a training step whose loss or gradient is not sane is skipped.

Each step, before the update, `Guard.judge(loss, grad_norm)` says why the step is bad
or returns None:
  * a non-finite loss or gradient norm (NaN, inf);
  * a gradient norm of exactly 0 at a loss that is not ~0: the activations are
    saturated (what a too-large learning rate leaves: |params| ~1e6 and more,
    uniform predictions, loss = ln(vocab), and every later update NaN);
  * a loss spike: loss > spike_threshold * mean of the last `WINDOW` healthy losses,
    and at least `MIN_RISE` nats above that mean (so that very small losses late in a
    run, whose ratios are noisy, never count as spikes).
A bad step skips the update: the gradient is dropped, parameters and Adam moments stay
as they were. It still consumes its batch and advances the iteration count (and with
it the learning-rate schedule and Adam's bias-correction step), so a run with skipped
steps resumes bit-exactly. After `max_bad_steps` bad steps in a row, training stops
with an error.

Checkpoints are written only from a verified state: at a save point the loss of the
step's own batches is recomputed after the update (`Guard.healthy`); if it is not sane
the save is skipped and LATEST keeps the last healthy one. The guard's history is saved
in the checkpoint (`state`, `from_state`), so decisions after a resume are the same.
"""
from __future__ import annotations

import math

from ..errors import LlamatuneError

WINDOW = 16        # healthy losses the spike test averages over
MIN_RISE = 1.0     # nats: a spike must also exceed the mean by this much
FLAT_LOSS = 1e-2   # a loss above this with an exactly zero gradient means saturated activations


class Guard:
    def __init__(self, spike_threshold: float, max_bad_steps: int, state: dict | None = None):
        self.threshold, self.max_bad = float(spike_threshold), int(max_bad_steps)
        try:
            state = dict(state or {})
            self.recent: list[float] = [float(x) for x in state.get("recent", [])][-WINDOW:]
            self.bad_in_row = int(state.get("bad_in_row", 0))
            self.bad_total = int(state.get("bad_total", 0))
        except (TypeError, ValueError) as e:
            raise LlamatuneError(f"checkpoint: invalid llamatune.guard_state ({e})") from None

    def state(self) -> dict:
        """JSON-serializable history, stored in checkpoints."""
        return {"recent": list(self.recent), "bad_in_row": self.bad_in_row, "bad_total": self.bad_total}

    def _problem(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if self.recent and math.isfinite(self.threshold):     # inf: no spike test (a signed loss, GRPO's)
            mean = sum(self.recent) / len(self.recent)
            if loss > self.threshold * mean and loss > mean + MIN_RISE:
                return f"loss {loss:.4f} is over {self.threshold:g} times the recent mean {mean:.4f}"
        return None

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step must be skipped, or None when it is healthy."""
        problem = self._problem(loss)
        if problem is None and not math.isfinite(grad_norm):
            problem = f"gradient norm is {grad_norm}"
        if problem is None and grad_norm == 0 and loss > FLAT_LOSS:
            problem = f"gradient norm is 0 at loss {loss:.4f} (saturated activations)"
        return problem

    def healthy(self, loss: float) -> bool:
        """Is a recomputed loss sane (used before saving)? Changes no history."""
        return self._problem(loss) is None

    def record(self, loss: float, problem: str | None, iteration: int) -> None:
        """Count the step; raise after max_bad_steps bad steps in a row."""
        if problem is None:
            self.bad_in_row = 0
            self.recent = (self.recent + [float(loss)])[-WINDOW:]
            return
        self.bad_in_row += 1
        self.bad_total += 1
        if self.bad_in_row >= self.max_bad:
            raise LlamatuneError(f"training diverged: {self.bad_in_row} bad steps in a row (--max-bad-steps "
                                 f"{self.max_bad}), the last at iteration {iteration}: {problem}; checkpoints "
                                 "hold only healthy states: resume from the LATEST one (if any) with a lower "
                                 "--adam-alpha")
