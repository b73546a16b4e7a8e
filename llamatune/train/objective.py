"""What a step trains for, beside the one loop (trainer.py).

An objective is a small object the loop calls at fixed points:
  batcher(job)                 the batches it needs (its Batcher, made once)
  validator(job)               its validation (None without validation samples)
  begin_step(batches)          a step's global batches, before its micro-batches
  micro_step(graph, b, key)    one micro-batch's loss; its gradient added to params.grad
  micro_loss(graph, b, key)    the same loss with the current parameters (the last
                               update's check, trainer.final_save)
  end_step(world)              the step's metrics (every rank's), for metrics.jsonl
  settle(world, bad)           after the save of the state before this step: keep or
                               drop what the step observed (`bad`: why it was skipped)
  progress_note()              a few words for the progress line ("" for none)
  spikes                       whether the guard's loss-spike test applies (a class attribute)
`SFT` (finetune's sft, full finetune, train-from-scratch: what differs there is the
weights the graph trains, not the objective) is here; DPO/ORPO is preference.Preference,
GRPO grpo.GRPO (whose batcher samples the completions it trains on).
A new objective is one more class with these methods, chosen by the job builder.
"""
from __future__ import annotations

import numpy as np

from ..data.samples import Batch, Batcher
from .validation import Validator


def vocab(job) -> tuple[int, int, int]:
    """(vocabulary size, BOS, EOS) that the batchers lay rows out with."""
    return job.cfg.n_vocab, job.tokenizer.bos_id, job.tokenizer.eos_id


def packing(b: Batch) -> dict:
    """A packed batch's positions and segments for StepExecutor.step (empty for unpacked rows)."""
    return {k: v for k, v in (("positions", b.positions), ("segments", b.segments)) if v is not None}


def token_losses(executor, b: Batch) -> np.ndarray:
    """(B, T) float64 cross-entropy of every target of batch b (0 elsewhere), forward only:
    the per-token log-probabilities (negated) the preference and GRPO objectives score."""
    mask = (b.targets >= 0).astype(executor.tmp.dtype)
    executor.loss(b.inputs, b.targets, mask, b.positions, b.segments)
    return executor.backend.to_host(executor.losses).reshape(b.targets.shape).astype(np.float64)


class SFT:
    """Supervised finetuning: the mean cross-entropy over every target of the step.
    `statistics` (statistics.TrainingStats, LoRA sft): the imatrix sums of the forward's
    inputs, counted for the steps whose update is taken."""

    spikes = True               # the guard's loss-spike test applies

    def __init__(self, statistics=None):
        self.statistics = statistics
        self.n_targets = 0

    def batcher(self, job) -> Batcher:
        return Batcher(job.samples, job.opts, *vocab(job))

    def progress_note(self) -> str:
        return ""

    def validator(self, job) -> Validator | None:
        return None if job.val_samples is None else Validator(job.val_samples, job.opts, *vocab(job))

    def begin_step(self, batches: list[Batch]) -> None:
        self.n_targets = sum(b.n_targets for b in batches)

    def micro_loss(self, executor, b: Batch, key: tuple) -> float:
        w = (b.targets >= 0).astype(np.float32) / np.float32(self.n_targets)
        return executor.step(b.inputs, b.targets, w, key, **packing(b))

    def micro_step(self, executor, b: Batch, key: tuple) -> float:
        if self.statistics is None:
            return self.micro_loss(executor, b, key)
        self.statistics.batch(b.targets)             # this forward's inputs are counted (statistics.py)
        executor.observer = self.statistics
        try:
            return self.micro_loss(executor, b, key)
        finally:
            executor.observer = None

    def end_step(self, world) -> dict[str, float]:
        return {}

    def settle(self, world, bad: str | None) -> None:
        if self.statistics is not None and bad:      # a skipped step's inputs are not counted
            self.statistics.discard()
        elif self.statistics is not None:
            self.statistics.commit(world)
