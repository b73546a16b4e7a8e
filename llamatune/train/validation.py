"""Validation: held-out samples, their mean loss computed forward-only, and the decisions
taken from it (the best step for --save-best, the patience of --early-stop).

The samples come from --val-data (loaded exactly like the training data) or from
--val-split (a seeded split of the training samples by sample index). They are cut into
non-overlapping pieces of at most --ctx tokens and laid out one piece per row (with
--pack, as many whole conversations per row as fit, each attending to itself only), in
order, by the training Batcher's own row builder, stopping after the last piece; so every
validation target is scored exactly once, in the same fixed batches at every evaluation.
The reported loss is the mean over all targets (sum of per-token losses / number of
targets), the token-weighted mean that HF Trainer's and mlx-lm's evaluation loops report;
`StepExecutor.loss` computes it without dropout and without touching gradients.

`ValidationState` (best loss, its step, evaluations since, the last loss) is stored in
the checkpoints, so a resumed run takes the same decisions as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..console import notice
from ..data.samples import Batch, Batcher, Samples
from ..errors import LlamatuneError

_SPLIT_STREAM = 0x76616C   # "val": the split draws from its own stream of the run's seed


@dataclass
class ValidationState:
    best_loss: float | None = None   # lowest validation loss so far
    best_step: int = -1              # optimizer steps done when it was measured
    since_best: int = 0              # evaluations since then without a lower loss
    last_loss: float | None = None   # the latest evaluation
    last_step: int = -1
    samples_hash: int = 0            # the validation set these numbers are about

    def record(self, step: int, loss: float) -> bool:
        """Take one evaluation into account; True when it is a new best."""
        improved = self.best_loss is None or loss < self.best_loss
        if improved:
            self.best_loss, self.best_step, self.since_best = loss, step, 0
        else:
            self.since_best += 1
        self.last_loss, self.last_step = loss, step
        return improved

    @classmethod
    def from_dict(cls, d: dict) -> "ValidationState":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"validation state needs the fields {sorted(names)}")
        return cls(**d)


def subset(samples: Samples, begins: np.ndarray, sizes: np.ndarray) -> Samples:
    """Samples over the same tokens (and loss mask) with other extents."""
    return Samples(samples.tokens, begins, sizes, samples.mask)


def split_samples(samples: Samples, fraction: float, seed: int) -> tuple[Samples, Samples]:
    """(training, validation): ceil(fraction * n) samples drawn by a seeded permutation of
    the sample indices are held out; both parts keep index order."""
    n = len(samples)
    n_val = math.ceil(fraction * n)
    if n_val >= n:
        raise LlamatuneError(f"--val-split {fraction}: {n} sample(s) leave none for training "
                             f"(lower it or give --val-data)")
    held = np.zeros(n, bool)
    held[np.random.default_rng([_SPLIT_STREAM, seed]).permutation(n)[:n_val]] = True
    b, s = samples.begins, samples.sizes
    ends = b + s
    order = np.argsort(b, kind="stable")
    if np.any(b[order][1:] < ends[order][:-1]):
        notice("--val-split: samples overlap (without --sample-start every token position starts one), so "
               "validation windows share text with training windows; give --val-data or --sample-start "
               "for a truly held-out set")
    return subset(samples, b[~held], s[~held]), subset(samples, b[held], s[held])


def eval_pieces(samples: Samples, ctx: int) -> Samples:
    """Non-overlapping pieces covering the samples in order of their start: a sample that
    begins inside one already taken is skipped (raw text without --sample-start has a
    window at every token; these keep every ctx-th one). A raw-text sample longer than ctx
    is cut into consecutive pieces of ctx tokens; samples with a loss mask are whole
    sequences (conversations, rows) and stay whole, scored as the Batcher feeds them."""
    begins, sizes, end = [], [], -1
    cut = ctx if samples.mask is None else None
    for i in np.argsort(samples.begins, kind="stable"):
        b, n = int(samples.begins[i]), int(samples.sizes[i])
        if b < end:
            continue
        end = b + n
        step = cut or n
        for off in range(0, n, step):
            begins.append(b + off)
            sizes.append(min(step, n - off))
    return subset(samples, np.asarray(begins, np.int64), np.asarray(sizes, np.int64))


class InOrder:
    """Mixed into a batcher (`class X(InOrder, Batcher)`): its rows with the samples in
    order and no random offsets, one pass only: rows after the last sample are padding."""

    def _shuffle(self) -> None:
        self._shuffle_state = None
        self.order = np.arange(len(self.samples))
        self.offsets = np.zeros(len(self.order), dtype=np.int64)

    def exhausted(self) -> bool:
        return self.epoch > 0


class _InOrder(InOrder, Batcher):
    pass


class Validator:
    """Fixed validation batches and the mean loss over all their targets."""
    batcher = _InOrder                             # one pass over the samples in order

    def __init__(self, samples: Samples, opts, n_vocab: int, bos_id: int, eos_id: int):
        self.opts = dataclasses.replace(opts, fill_with_next_samples=False, sample_random_offsets=False)
        self.samples = eval_pieces(samples, opts.ctx)
        self.vocab = (n_vocab, bos_id, eos_id)
        self.last_metrics: dict[str, float] = {}          # the last evaluation's metrics besides the loss
        self.n_targets = self.n_rows = 0                  # n_targets > 0: every sample has a target
        for b in self.batches():
            self.n_targets += b.n_targets
            self.n_rows += int((b.targets >= 0).any(axis=1).sum())

    def describe(self) -> str:
        rows = "" if self.n_rows == len(self.samples) else f" in {self.n_rows} rows"
        return f"{len(self.samples)} samples of up to {self.opts.ctx} tokens{rows}, {self.n_targets} targets"

    def batches(self) -> Iterator[Batch]:
        """(B, T) batches of the pieces in order, until the last one is taken; rows after it
        are all padding."""
        batcher = self.batcher(self.samples, self.opts, *self.vocab)
        while not batcher.exhausted():
            yield batcher.next_batch()

    def loss(self, executor) -> float:
        """Mean loss over every validation target (forward only, no dropout)."""
        total = 0.0
        for b in self.batches():
            total += executor.loss(b.inputs, b.targets, (b.targets >= 0).astype(np.float32), b.positions, b.segments)
        return total / self.n_targets

    def restore(self, saved: ValidationState | None) -> ValidationState:
        """The state to go on with: the checkpoint's when it is about this validation set."""
        h = self.samples.hash
        if saved is not None and saved.samples_hash != h:
            notice("validation data changed since the checkpoint: the best validation loss starts afresh")
            saved = None
        return saved if saved is not None else ValidationState(samples_hash=h)

    def due(self, step: int, done: bool) -> bool:
        """Evaluate after this step? At every --eval-every steps and at the end."""
        every = self.opts.eval_every
        return done or (every > 0 and step % every == 0)

    def should_stop(self, state: ValidationState) -> bool:
        return self.opts.early_stop > 0 and state.since_best >= self.opts.early_stop


def validation_samples(train: Samples, opts, load: Callable) -> tuple[Samples, Samples | None]:
    """(training samples, validation samples or None) from --val-data or --val-split;
    `load(path)` loads a data file the way the training data is loaded."""
    if opts.val_data is not None:
        return train, load(opts.val_data)
    if opts.val_split > 0:
        return split_samples(train, opts.val_split, opts.seed)
    return train, None
