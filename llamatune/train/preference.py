"""Preference tuning on chosen/rejected pairs: DPO (sigmoid), IPO and cDPO against a
reference model, and ORPO without one.

The losses are HF TRL's (DPOTrainer.dpo_loss, ORPOTrainer.odds_ratio_loss), and so are
the metric names (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
logps/chosen, logps/rejected). They run on the training graph as it is:

  An answer's log-probability is minus the sum of its tokens' cross-entropies,
  logp = -sum_t CE_t (IPO and ORPO: the mean over the answer's tokens, as TRL). A pair's
  loss L(logp_c, logp_r) has the gradient
      dL/dtheta = sum_seq dL/dlogp_seq * dlogp_seq/dtheta
                = sum_seq sum_t (-dL/dlogp_seq) * dCE_t/dtheta,
  which is StepExecutor.step's gradient with the per-token weights w_t = -dL/dlogp_seq (divided
  by the answer's length for means) on that answer's tokens: the graph's gradient is
  linear in its weights. So one micro-batch is one StepExecutor.step whose `reweight` hook
  runs between the forward and the backward:
      (1) the forward and the output head's per-token CE -> logp of every answer;
      (2) the pair losses and dL/dlogp in float64 (`dpo_loss`, `orpo_loss`);
      (3) the head again with those weights, and the backward.
  Only the output head runs twice (on the answer tokens); evaluation is StepExecutor.loss.
  DPO's reference log-probabilities come from the same frozen base with its adapters
  switched off (`lora.disabled_adapters`: each linear runs its base alone), once
  per pair, the first time the pair is trained on; the cache is part of the batcher's
  state, so a checkpoint resumes with the very values.

Layout (`PairBatcher`): a micro-batch of --batch rows holds --batch / 2 pairs, row 2k a
pair's chosen answer and row 2k + 1 its rejected one, both with the prompt; the shuffled
order is over pairs. A step's loss is the mean over its pairs of the pair loss (ORPO:
plus the mean cross-entropy over every chosen-answer token of the step, its SFT term).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..data.samples import Batch, Batcher, Samples
from ..errors import LlamatuneError
from .lora import disabled_adapters
from .objective import packing, token_losses, vocab
from .validation import InOrder, Validator

STATE_KEY = "reference"        # the reference cache's key in the batcher's state
_SPLIT_STREAM = 0x76616C       # the seeded split draws from the same stream as validation.split_samples


# --------------------------------------------------------------------------- the losses
def log_sigmoid(z: np.ndarray) -> np.ndarray:
    """log(1 / (1 + exp(-z))), without overflow."""
    return -np.logaddexp(0.0, -z)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(log_sigmoid(z))


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-pair losses of TRL's dpo_loss and their derivatives with respect to the policy's
    log-probabilities: (losses, dL/dpi_c, dL/dpi_r), float64 (P,).
        logits  = (pi_c - pi_r) - (ref_c - ref_r)
        sigmoid: -(1 - eps) log s(beta logits) - eps log s(-beta logits)   (eps > 0: cDPO)
        ipo:     (logits - 1 / (2 beta))^2"""
    logits = (np.asarray(pi_c, np.float64) - pi_r) - (np.asarray(ref_c, np.float64) - ref_r)
    if loss_type == "ipo":
        u = logits - 1.0 / (2.0 * beta)
        losses, dlogits = u * u, 2.0 * u
    elif loss_type == "sigmoid":
        z, eps = beta * logits, label_smoothing
        losses = -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
        dlogits = beta * (-(1.0 - eps) * sigmoid(-z) + eps * sigmoid(z))
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}")
    return losses, dlogits, -dlogits


def orpo_loss(lp_c, lp_r, beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """ORPO's odds-ratio term per pair, as it is added to the SFT loss (TRL's `losses`
    negated), with its derivatives: (losses, dL/dlp_c, dL/dlp_r, log_odds), float64 (P,).
    lp: mean per-token log-probabilities of the answers (< 0).
        log_odds = (lp_c - lp_r) - (log(1 - exp lp_c) - log(1 - exp lp_r))
        loss     = -beta log s(log_odds)
    d log_odds / d lp_c = 1 / (1 - exp lp_c), d log_odds / d lp_r = -1 / (1 - exp lp_r)."""
    lp_c, lp_r = np.asarray(lp_c, np.float64), np.asarray(lp_r, np.float64)
    em_c, em_r = np.expm1(lp_c), np.expm1(lp_r)              # exp(lp) - 1 = -(1 - p)
    log_odds = (lp_c - lp_r) - (np.log(-em_c) - np.log(-em_r))
    losses = -beta * log_sigmoid(log_odds)
    g = -beta * sigmoid(-log_odds)                            # dL/dlog_odds
    return losses, g / -em_c, g / em_r, log_odds


# --------------------------------------------------------------------------- batches of pairs
class PairBatcher(Batcher):
    """The training Batcher's rows over pairs: samples 2i (chosen) and 2i + 1 (rejected) of
    `datasets.load_pairs` stay adjacent in the shuffled order, so with an even --batch a
    micro-batch holds whole pairs. Each batch carries the sample in each row
    (`Batch.sample_ids`); `reference` (n_pairs, 2) caches DPO's reference
    log-probabilities (NaN: not yet computed) and is part of the state."""

    def __init__(self, samples: Samples, opts, n_vocab: int, bos_id: int, eos_id: int):
        self._taken: list[int] = []
        super().__init__(samples, opts, n_vocab, bos_id, eos_id)
        self.reference = np.full((len(samples) // 2, 2), np.nan)

    def _set_samples(self, samples: Samples) -> None:
        super()._set_samples(samples)
        if samples.mask is None or len(samples) % 2:
            raise LlamatuneError("preference data: the samples must be pairs of answers")

    def _shuffle(self) -> None:
        self._shuffle_state = self._rng.bit_generator.state
        chosen = 2 * self._rng.permutation(len(self.samples) // 2)
        self.order = np.stack([chosen, chosen + 1], axis=1).reshape(-1)
        self.offsets = np.zeros(len(self.order), dtype=np.int64)

    def _take(self) -> tuple[int, int]:
        idx, off = super()._take()
        self._taken.append(idx)
        return idx, off

    def next_batch(self) -> Batch:
        self._taken = []
        b = super().next_batch()              # one sample per row, in order: row k holds _taken[k]
        b.sample_ids = np.full(self.opts.batch, -1, np.int64)
        b.sample_ids[:len(self._taken)] = self._taken
        return b

    def state(self) -> dict[str, Any]:
        return {**super().state(), STATE_KEY: self.reference.tolist()}

    def load_state(self, state: dict[str, Any], samples: Samples, force_reshuffle: bool = False) -> None:
        super().load_state(state, samples, force_reshuffle)
        self.reference = np.full((len(samples) // 2, 2), np.nan)
        saved = state.get(STATE_KEY)
        if saved is None or int(state["samples_hash"]) != samples.hash:
            return                              # other data: its reference is computed afresh
        try:
            ref = np.asarray(saved, np.float64)
        except (TypeError, ValueError):
            ref = None
        if ref is None or ref.shape != self.reference.shape:
            raise LlamatuneError(f"training state: the reference log-probabilities are not {len(self.reference)} pairs")
        self.reference = ref


class _PairsInOrder(InOrder, PairBatcher):
    """Pairs in data order, one pass (validation)."""


def split_pairs(samples: Samples, fraction: float, seed: int) -> tuple[Samples, Samples]:
    """--val-split over pairs: (training, validation), ceil(fraction * n_pairs) pairs drawn by
    a seeded permutation held out, both parts in data order."""
    import math
    n = len(samples) // 2
    n_val = math.ceil(fraction * n)
    if n_val >= n:
        raise LlamatuneError(f"--val-split {fraction}: {n} pair(s) leave none for training "
                             "(lower it or give --val-data)")
    held = np.zeros(n, bool)
    held[np.random.default_rng([_SPLIT_STREAM, seed]).permutation(n)[:n_val]] = True
    held = np.repeat(held, 2)                   # both answers of a pair
    b, s = samples.begins, samples.sizes
    return (Samples(samples.tokens, b[~held], s[~held], samples.mask),
            Samples(samples.tokens, b[held], s[held], samples.mask))


# --------------------------------------------------------------------------- the objective
@dataclasses.dataclass
class Scores:
    """The P pairs of a micro-batch: their answers' log-probabilities and what the loss needs."""
    pairs: np.ndarray              # (P,) pair index in the data
    rows: np.ndarray               # (P,) row of the chosen answer (the rejected one is the next row)
    logp: np.ndarray               # (P, 2) chosen, rejected: policy (IPO, ORPO: per-token means)
    ref: np.ndarray | None         # (P, 2) reference, likewise (DPO)
    length: np.ndarray             # (P, 2) answer tokens
    nll: np.ndarray                # (P,) sum of the chosen answer's cross-entropies


class Preference:
    """--method dpo / orpo, an objective of the training loop (objective.py): the
    micro-batch step, the loss of batches and the metrics."""

    spikes = True               # the guard's loss-spike test applies

    def progress_note(self) -> str:
        return ""

    def __init__(self, opts):
        self.loss_type = opts.loss_type        # beta and loss type: the method's defaults (options)
        self.method, self.beta, self.smoothing = opts.method, float(opts.beta), float(opts.label_smoothing)
        self.mean = self.method == "orpo" or self.loss_type == "ipo"    # length-averaged log-probabilities
        self._rows: list[np.ndarray] = []       # per pair of this step: metrics columns (see `_record`)
        self._new: list[tuple[int, list]] = []   # (pair, reference values) computed in this step

    # ---- one micro-batch
    def _logp(self, ce: np.ndarray, rows: np.ndarray, length: np.ndarray) -> np.ndarray:
        total = ce.sum(axis=1)
        lp = -np.stack([total[rows], total[rows + 1]], axis=1)
        return lp / length if self.mean else lp

    @staticmethod
    def _layout(b: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows of the chosen answers (P,), their pairs (P,), answer tokens (P, 2))."""
        ids = b.sample_ids
        rows = np.flatnonzero((ids >= 0) & (np.arange(len(ids)) % 2 == 0))
        mask = b.targets >= 0
        return rows, ids[rows] // 2, np.stack([mask[rows].sum(axis=1), mask[rows + 1].sum(axis=1)], axis=1)

    def _reference(self, executor, b: Batch, cache: np.ndarray, new: list | None) -> np.ndarray | None:
        """DPO: the reference log-probabilities of the batch's pairs (P, 2), from `cache`
        (n_pairs, 2) or, where it holds NaN, computed now with the adapter off (and listed in
        `new` as (pair, [chosen, rejected])). None for ORPO."""
        if self.method != "dpo":
            return None
        rows, pairs, length = self._layout(b)
        missing = np.isnan(cache[pairs]).any(axis=1)
        if missing.any():
            with disabled_adapters(executor.lora.values()):
                base = self._logp(token_losses(executor, b), rows, length)
            for k in np.flatnonzero(missing):
                if np.isnan(cache[pairs[k]]).any():       # a pair twice in a batch: the first value
                    cache[pairs[k]] = base[k]
                    if new is not None:
                        new.append((int(pairs[k]), base[k].tolist()))
        return cache[pairs]

    def _scores(self, b: Batch, ce: np.ndarray, ref: np.ndarray | None) -> Scores:
        rows, pairs, length = self._layout(b)
        return Scores(pairs, rows, self._logp(ce, rows, length), ref, length, ce[rows].sum(axis=1))

    def score(self, executor, b: Batch, cache: np.ndarray, new: list | None = None) -> Scores:
        """The batch's pairs scored by a forward pass (and the reference, see `_reference`)."""
        ref = self._reference(executor, b, cache, new)
        return self._scores(b, token_losses(executor, b), ref)

    def terms(self, s: Scores) -> tuple[np.ndarray, np.ndarray]:
        """Per-pair losses (P,) and their derivatives with respect to s.logp, (P, 2)."""
        if self.method == "dpo":
            losses, d_c, d_r = dpo_loss(s.logp[:, 0], s.logp[:, 1], s.ref[:, 0], s.ref[:, 1], self.beta,
                                        self.loss_type, self.smoothing)
        else:
            losses, d_c, d_r, _ = orpo_loss(np.minimum(s.logp[:, 0], -1e-12), np.minimum(s.logp[:, 1], -1e-12),
                                            self.beta)
        return losses, np.stack([d_c, d_r], axis=1)

    def weights(self, s: Scores, d: np.ndarray, targets: np.ndarray, n_pairs: int, n_chosen: int) -> np.ndarray:
        """(B, T) per-token weights: -dL/dlogp of each answer on its tokens (divided by its
        length for means) over n_pairs; ORPO adds 1 / n_chosen on the chosen answers' tokens."""
        coef = np.zeros(len(targets))
        per = s.length if self.mean else np.ones_like(s.length)
        coef[s.rows] = -d[:, 0] / per[:, 0] / n_pairs
        coef[s.rows + 1] = -d[:, 1] / per[:, 1] / n_pairs
        if self.method == "orpo":
            coef[s.rows] += 1.0 / n_chosen
        return coef[:, None] * (targets >= 0)

    def step(self, executor, b: Batch, cache: np.ndarray, n_pairs: int, n_chosen: int, key: tuple) -> float:
        """One micro-batch: the gradient of sum(pair losses) / n_pairs (ORPO: + sum(chosen
        CE) / n_chosen) added to params.grad; n_pairs, n_chosen: the pairs and chosen-answer
        tokens of the whole step. Returns this micro-batch's share of the step's loss.
        One StepExecutor.step: after its forward and the head's losses, `executor.reweight` turns
        them into the pair losses and the weights its backward then uses."""
        ref = self._reference(executor, b, cache, self._new)
        got = []

        def reweight(g, w):                 # g: the graph of the batch's columns up to its last target
            ce = g.backend.to_host(g.losses).reshape(g.B, g.T).astype(np.float64)
            s = self._scores(b, ce, ref)
            losses, d = self.terms(s)
            got.append((s, losses))
            weights = self.weights(s, d, b.targets[:, :g.T], n_pairs, n_chosen)
            return g.backend.to_device(weights.reshape(-1).astype(g.tmp.dtype))
        executor.reweight = reweight
        try:
            executor.step(b.inputs, b.targets, (b.targets >= 0).astype(executor.tmp.dtype), key, **packing(b))
        finally:
            executor.reweight = None
        s, losses = got[0]
        self._record(s, losses)
        return float(losses.sum() / n_pairs + (s.nll.sum() / n_chosen if self.method == "orpo" else 0.0))

    # ---- the trainer's objective interface (objective.py)
    def batcher(self, job) -> PairBatcher:
        self._batcher = PairBatcher(job.samples, job.opts, *vocab(job))
        return self._batcher

    def validator(self, job) -> PairValidator | None:
        return None if job.val_samples is None else PairValidator(job.val_samples, job.opts, *vocab(job), self)

    def begin_step(self, batches: list[Batch]) -> None:
        self._counts = self.counts(batches)            # pairs and chosen tokens of the step

    def micro_step(self, executor, b: Batch, key: tuple) -> float:
        return self.step(executor, b, self._batcher.reference, *self._counts, key)

    def micro_loss(self, executor, b: Batch, key: tuple) -> float:
        return self.loss(executor, b, self._batcher.reference, *self._counts)

    def end_step(self, world) -> dict[str, float]:
        return self.finish_step(world, self._batcher.reference)

    def settle(self, world, bad: str | None) -> None:
        pass

    @staticmethod
    def counts(batches: list[Batch]) -> tuple[int, int]:
        """(pairs, chosen-answer tokens) of a step's batches: the loss's normalizers."""
        n_pairs = n_chosen = 0
        for b in batches:
            rows = np.flatnonzero((b.sample_ids >= 0) & (np.arange(len(b.sample_ids)) % 2 == 0))
            n_pairs += len(rows)
            n_chosen += int((b.targets[rows] >= 0).sum())
        return n_pairs, n_chosen

    def loss(self, executor, b: Batch, cache: np.ndarray, n_pairs: int, n_chosen: int) -> float:
        """This micro-batch's share of the loss with the current parameters, forward only."""
        s = self.score(executor, b, cache, self._new)
        losses, _ = self.terms(s)
        return float(losses.sum() / n_pairs + (s.nll.sum() / n_chosen if self.method == "orpo" else 0.0))

    # ---- metrics
    def columns(self, s: Scores, losses: np.ndarray) -> np.ndarray:
        """(P, 7) per pair: reward chosen, reward rejected (DPO: beta (logp - ref); ORPO:
        beta logp, as TRL), logp chosen, logp rejected, pair loss, chosen CE sum, chosen tokens."""
        rewards = self.beta * (s.logp - s.ref) if self.method == "dpo" else self.beta * s.logp
        return np.column_stack([rewards, s.logp, losses, s.nll, s.length[:, 0]])

    def _record(self, s: Scores, losses: np.ndarray) -> None:
        self._rows.append(self.columns(s, losses))

    def finish_step(self, world, cache: np.ndarray | None) -> dict[str, float]:
        """End of a step: every rank gets the reference values any rank computed (so that
        each holds the cache one process would), and the step's metrics over all its pairs."""
        every = world.allgather((self._new, self._rows), "preference metrics")
        self._new, self._rows = [], []
        rows = []
        for new, mine in every:
            if cache is not None:
                for pair, value in new:
                    cache[pair] = value
            rows += mine
        return self.summary(np.concatenate(rows) if rows else np.zeros((0, 7)))

    def summary(self, r: np.ndarray, prefix: str = "") -> dict[str, float]:
        """TRL's metrics (means over pairs) from `_record`'s columns."""
        if not len(r):
            return {}
        out = {"rewards/chosen": r[:, 0].mean(), "rewards/rejected": r[:, 1].mean(),
               "rewards/accuracies": (r[:, 0] > r[:, 1]).mean(), "rewards/margins": (r[:, 0] - r[:, 1]).mean(),
               "logps/chosen": r[:, 2].mean(), "logps/rejected": r[:, 3].mean()}
        if self.method == "orpo":
            out["nll_loss"] = r[:, 5].sum() / r[:, 6].sum()
        return {prefix + k: float(v) for k, v in out.items()}


# --------------------------------------------------------------------------- validation
class PairValidator(Validator):
    """Held-out pairs in fixed, in-order batches: the preference loss (mean over pairs;
    ORPO plus the mean NLL over all chosen-answer tokens) and TRL's metrics, prefixed
    `eval_`, in `last_metrics`. The reference values are computed at the first evaluation
    (same batches every time, so a resumed run gets the same bits). Best step and early
    stop as for SFT (Validator)."""
    batcher = _PairsInOrder

    def __init__(self, samples: Samples, opts, n_vocab: int, bos_id: int, eos_id: int, objective: Preference):
        self.opts, self.samples, self.objective = opts, samples, objective
        self.vocab = (n_vocab, bos_id, eos_id)
        self.reference = np.full((len(samples) // 2, 2), np.nan)
        self.last_metrics: dict[str, float] = {}
        self.n_targets = sum(b.n_targets for b in self.batches())

    def describe(self) -> str:
        return f"{len(self.samples) // 2} pairs, {self.n_targets} answer tokens"

    def loss(self, executor) -> float:
        p = self.objective
        batches = list(self.batches())
        n_pairs, n_chosen = p.counts(batches)
        rows = []
        for b in batches:
            s = p.score(executor, b, self.reference)
            rows.append(p.columns(s, p.terms(s)[0]))
        r = np.concatenate(rows)
        self.last_metrics = p.summary(r, "eval_")
        return float(r[:, 4].sum() / n_pairs + (r[:, 5].sum() / n_chosen if p.method == "orpo" else 0.0))
