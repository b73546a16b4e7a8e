"""GRPO (online RL with verifiable rewards), HF TRL's GRPOTrainer for one policy update
per generation batch (num_iterations = 1), an objective of the training loop (objective.py).

A step: each micro-batch of --batch rows holds --batch / G prompts, each with its G
(--num-generations) completions sampled by the current policy (the batched decode of
models/sampling.generate_group, from a seeded Generator kept in the checkpoint) and
scored by the rewards (rewards.py). Per group (TRL `_generate_and_score_completions`):
    A_i = (r_i - mean(r)) / (std(r) + 1e-4)      std with Bessel's correction;
                                                 --scale-rewards batch: the batch's std, none: no division
Per completion token t (TRL `_compute_loss`, importance sampling per token):
    rho   = exp(logp - logp_old)                 logp_old: the same forward's value, detached (rho = 1)
    l     = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta kl
    kl    = exp(ref - logp) - (ref - logp) - 1   ref: the base with the adapter off (lora.disabled_adapters)
and the step's loss is sum_i c_i sum_t l_it with the normalisation --loss-type:
    dapo (TRL's default)  c = 1 / (completion tokens of the step)
    grpo                  c_i = 1 / (len_i * completions of the step)
    bnpo                  c_i = 1 / (completion tokens of its micro-batch * micro-batches)
    dr_grpo               c_i = 1 / (completions of the step * --max-completion-length)
logp_t = -CE_t of the training graph, so the gradient is StepExecutor.step's with per-token weights
w_t = -c_i dl/dlogp_t (the graph's gradient is linear in its weights, as for DPO):
    dl/dlogp = -A rho   where the unclipped term is the min (rho inside the clip range, or
                        rho A below the clipped term), else 0;  + beta (1 - exp(ref - logp)).
At rho = 1 this is the weighted cross-entropy w_t = c_i A_i (- beta c_i (1 - exp(ref - logp))).
One StepExecutor.step per micro-batch: its `reweight` hook turns the forward's per-token
cross-entropies into these weights before the backward (preference.py does the same).
Differences from TRL: logp is the model's (TRL divides the logits by --temperature
first; the same at the default temperature 1); no --num-iterations > 1, no entropy mask,
no two-sided delta clipping.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..data.samples import Batch, Batcher
from ..errors import LlamatuneError
from . import rewards as R
from .lora import disabled_adapters
from .objective import token_losses, vocab

STD_EPS = 1e-4                 # TRL: advantages / (std + 1e-4)
_SAMPLING_STREAM = 0x67727030  # the sampling Generator's stream beside --seed


# --------------------------------------------------------------------------- the maths
def group_advantages(rewards: np.ndarray, G: int, scale: str = "group") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(advantages (n,), each group's mean (n / G,), each group's std (n / G,)), float64;
    rewards (n,) in groups of G consecutive completions."""
    r = np.asarray(rewards, np.float64).reshape(-1, G)
    mean, std = r.mean(axis=1), r.std(axis=1, ddof=1)
    adv = r - mean[:, None]
    if scale == "group":
        adv = adv / (std[:, None] + STD_EPS)
    elif scale == "batch":
        adv = adv / (r.std(ddof=1) + STD_EPS)
    return adv.reshape(-1), mean, std


@dataclasses.dataclass
class TokenTerms:
    loss: np.ndarray          # (n, T) per-token loss l (0 off the mask)
    dlogp: np.ndarray         # (n, T) dl/dlogp (0 off the mask)
    kl: np.ndarray            # (n, T) per-token KL to the reference (0 without one)
    low: np.ndarray           # (n, T) bool: rho < 1 - eps_low with A < 0 (TRL's is_low_clipped)
    high: np.ndarray          # (n, T) bool: rho > 1 + eps_high with A > 0


def token_terms(logp, old, ref, adv, mask, eps_low: float, eps_high: float, beta: float) -> TokenTerms:
    """TRL's per-token GRPO loss and its derivative with respect to logp (module doc).
    logp, old, ref (n, T) float64 (ref None: no KL term); adv (n,); mask (n, T) bool."""
    logp, old = np.asarray(logp, np.float64), np.asarray(old, np.float64)
    A = np.asarray(adv, np.float64)[:, None]
    rho = np.exp(np.where(mask, logp - old, 0.0))
    clipped = np.clip(rho, 1.0 - eps_low, 1.0 + eps_high)
    inside = (rho >= 1.0 - eps_low) & (rho <= 1.0 + eps_high)
    loss = -np.minimum(rho * A, clipped * A)
    dlogp = np.where(inside | (rho * A < clipped * A), -A * rho, 0.0)
    kl = np.zeros_like(loss)
    if ref is not None and beta != 0.0:
        delta = np.where(mask, np.asarray(ref, np.float64) - logp, 0.0)
        kl = np.expm1(delta) - delta
        loss = loss + beta * kl
        dlogp = dlogp + beta * -np.expm1(delta)
    return TokenTerms(np.where(mask, loss, 0.0), np.where(mask, dlogp, 0.0), np.where(mask, kl, 0.0),
                      mask & (rho < 1.0 - eps_low) & (A < 0), mask & (rho > 1.0 + eps_high) & (A > 0))


def coefficients(loss_type: str, lengths: np.ndarray, step_rows: int, step_tokens: int, micro_tokens: int,
                 micro_batches: int, max_length: int) -> np.ndarray:
    """c_i of each completion of a micro-batch (lengths (n,), 0: an empty row): the step's
    loss is sum_i c_i sum_t l_it (module doc)."""
    lengths = np.asarray(lengths, np.float64)
    if loss_type == "dapo":
        c = np.full(len(lengths), 1.0 / max(step_tokens, 1))
    elif loss_type == "grpo":
        c = 1.0 / (np.maximum(lengths, 1.0) * step_rows)
    elif loss_type == "bnpo":
        c = np.full(len(lengths), 1.0 / (max(micro_tokens, 1) * micro_batches))
    elif loss_type == "dr_grpo":
        c = np.full(len(lengths), 1.0 / (step_rows * max_length))
    else:
        raise ValueError(f"unknown GRPO loss type {loss_type!r}")
    return np.where(lengths > 0, c, 0.0)


# --------------------------------------------------------------------------- groups of completions
@dataclasses.dataclass
class GroupBatch(Batch):
    """A micro-batch of groups: row k = a prompt and one of its completions (targets: the
    completion's tokens). Arrays per row (B,) unless said."""
    advantages: np.ndarray | None = None     # (B,) float64
    rewards: np.ndarray | None = None        # (B, R) float64, each reward (NaN: None)
    lengths: np.ndarray | None = None        # (B,) completion tokens
    ended: np.ndarray | None = None          # (B,) bool: the completion drew a stop token
    old_logp: np.ndarray | None = None       # (B, T) the policy's logp when first trained (TRL's old_per_token_logps)
    ref_logp: np.ndarray | None = None       # (B, T) the reference's (beta > 0)


def layout(prompts: list[list[int]], completions: list[list[int]], B: int, T: int, eos: int):
    """(inputs, targets) (B, T) of rows prompt + completion: inputs the row but its last
    token, targets the completion's tokens where they are predicted; padding input EOS."""
    inputs = np.full((B, T), eos, np.int64)
    targets = np.full((B, T), -1, np.int64)
    for k, (p, c) in enumerate(zip(prompts, completions)):
        row = np.asarray(p + c, np.int64)
        if len(row) > T + 1:
            raise LlamatuneError(f"a prompt of {len(p)} tokens and its completion of {len(c)} do not fit --ctx {T}")
        inputs[k, :len(row) - 1] = row[:-1]
        targets[k, len(p) - 1:len(row) - 1] = c
    return inputs, targets


class GroupBatcher(Batcher):
    """The training Batcher's shuffled, resumable order over prompts (PromptSamples); a
    batch takes --batch / G prompts and has `rollout` complete and score them. The
    sampling Generator's state is part of the batcher's state."""

    def __init__(self, samples, opts, n_vocab: int, bos_id: int, eos_id: int, rollout):
        super().__init__(samples, opts, n_vocab, bos_id, eos_id)
        self.rollout = rollout
        self.sampling = np.random.default_rng([_SAMPLING_STREAM, opts.seed])

    def next_batch(self) -> GroupBatch:
        self._crossed = False
        taken = [self._take()[0] for _ in range(self.opts.batch // self.opts.num_generations)]
        b = self.rollout(taken, self.sampling)
        b.epoch_done = self._crossed
        self.token_count += b.n_targets
        return b

    def state(self) -> dict:
        return {**super().state(), "sampling_rng_state": self.sampling.bit_generator.state}

    def load_state(self, state: dict, samples, force_reshuffle: bool = False) -> None:
        super().load_state(state, samples, force_reshuffle)
        if "sampling_rng_state" not in state:
            raise LlamatuneError("training state: no sampling state (not a --method grpo checkpoint)")
        try:
            self.sampling.bit_generator.state = state["sampling_rng_state"]
        except (TypeError, ValueError, KeyError) as e:
            raise LlamatuneError(f"training state: invalid sampling state ({e})") from None


class Sampler:
    """GRPO's generation: the current policy (the base with the adapter's current values as
    run-time adapters) completing each prompt G times, then the rewards."""

    def __init__(self, model, opts, rewards: list[R.Reward], backend=None):
        from ..models.infer import Runner
        self.opts, self.rewards, self.model = opts, rewards, model
        self.runner = Runner(model, backend=backend)
        self.tok = model.tokenizer
        self.stop = set(self.tok.eog_ids)
        self.seconds, self.tokens = 0.0, 0                  # generation since the last `take_speed`

    def use_adapter(self, params, targets) -> None:
        """The runner's adapters: the trained values now (norm adapters are refused by
        the options: the runner does not apply them)."""
        to = self.runner.backend.to_device
        values = params.host_views(params.data)
        self.runner.adapters = {t.weight: [(to(values[t.a].copy()), to(values[t.b].copy()), t.scale)] for t in targets}

    def complete(self, ids: list[int], rng: np.random.Generator) -> list[list[int]]:
        from ..models.sampling import generate_group
        o = self.opts
        t = time.perf_counter()
        out = generate_group(self.runner, ids, o.num_generations, o.max_completion_length, rng, o.temperature,
                             o.top_p, self.stop)
        self.seconds += time.perf_counter() - t
        self.tokens += sum(len(c) for c in out)
        return out

    def text(self, completion: list[int]) -> str:
        ended = completion and completion[-1] in self.stop
        return self.tok.decode(completion[:-1] if ended else completion)

    def score(self, rows: list[dict], completions: list[list[int]]) -> np.ndarray:
        """(n, R): the rewards of completions, G per row of `rows`."""
        G = self.opts.num_generations
        prompts = [row["prompt"] for row in rows for _ in range(G)]
        texts = [self.text(c) for c in completions]
        if rows and isinstance(rows[0]["prompt"], list):          # conversational: TRL's message lists
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        keys = sorted({k for row in rows for k in row if k != "prompt"})
        fields = {k: [row.get(k) for row in rows for _ in range(G)] for k in keys}
        return R.score(self.rewards, prompts, texts, fields)

    def take_speed(self) -> tuple[float, int]:
        seconds, tokens, self.seconds, self.tokens = self.seconds, self.tokens, 0.0, 0
        return seconds, tokens


# --------------------------------------------------------------------------- the objective
def check_fields(rewards: list[R.Reward], rows: list[dict], source) -> None:
    """Every row has the fields the built-in rewards read (before any step is run)."""
    for r in rewards:
        for f in r.needs:
            k = next((k for k, row in enumerate(rows) if row.get(f) is None), None)
            if k is not None:
                raise LlamatuneError(f"{source}: prompt {k + 1} has no '{f}' field, which --reward {r.name} reads")


class GRPO:
    """--method grpo, an objective of the training loop (objective.py)."""

    spikes = False              # the loss is signed and near 0: the guard's spike test does not apply

    def __init__(self, opts, model):
        self.opts, self.model = opts, model
        self.rewards = R.parse_rewards(opts.reward, opts.reward_weights)
        self.eps_low = float(opts.epsilon)
        self.eps_high = float(opts.epsilon if opts.epsilon_high is None else opts.epsilon_high)
        self.beta, self.loss_type = float(opts.beta), opts.loss_type   # the method's defaults (options)
        self._adapter_stale = True              # the sampler's adapter is older than the parameters
        self._batches: list[GroupBatch] = []
        self._tokens: list[np.ndarray] = []     # per micro-batch of this rank: [kl sum, low, high, region, tokens]
        self.last: dict[str, float] = {}

    # ---- generation (the batcher's rollout)
    def batcher(self, job) -> GroupBatcher:
        check_fields(self.rewards, job.samples.rows, self.opts.train_data)
        self.job = job
        self.sampler = Sampler(self.model, self.opts, self.rewards, job.backend)
        self._batcher = GroupBatcher(job.samples, self.opts, *vocab(job), self.rollout)
        return self._batcher

    def rollout(self, prompts: list[int], rng: np.random.Generator) -> GroupBatch:
        """A micro-batch: each prompt completed G times by the current policy and scored."""
        o, s, G = self.opts, self.job.samples, self.opts.num_generations
        if self._adapter_stale:                 # once a step: its micro-batches sample one policy
            self.sampler.use_adapter(self.job.params, self.job.targets)
            self._adapter_stale = False
        ids = [s.prompt_ids(i) for i in prompts]
        completions = [c for p in ids for c in self.sampler.complete(p, rng)]
        table = self.sampler.score([s.rows[i] for i in prompts], completions)
        total = R.total(table, self.rewards)
        adv, _, _ = group_advantages(total, G, o.scale_rewards)
        inputs, targets = layout([p for p in ids for _ in range(G)], completions, o.batch, o.ctx, self.job.tokenizer.eos_id)
        lengths = np.array([len(c) for c in completions], np.int64)
        ended = np.array([bool(c) and c[-1] in self.sampler.stop for c in completions])
        return GroupBatch(inputs, targets, int((targets >= 0).sum()), False, sample_ids=np.repeat(prompts, G),
                          advantages=adv, rewards=table, lengths=lengths, ended=ended)

    def validator(self, job):
        return None

    # ---- training
    def begin_step(self, batches: list[GroupBatch]) -> None:
        self._batches = batches
        self._counts = (sum(len(b.lengths) for b in batches), sum(b.n_targets for b in batches), len(batches))

    def _coefficients(self, b: GroupBatch) -> np.ndarray:
        rows, tokens, micro = self._counts
        return coefficients(self.loss_type, b.lengths, rows, tokens, b.n_targets, micro,
                            self.opts.max_completion_length)

    def _reference(self, executor, b: GroupBatch) -> None:
        """b.ref_logp: the completions' log-probabilities under the base (adapter off)."""
        if self.beta == 0.0 or b.ref_logp is not None:
            return
        with disabled_adapters(executor.lora.values()):
            b.ref_logp = -token_losses(executor, b)

    def terms(self, b: GroupBatch, logp: np.ndarray) -> TokenTerms:
        mask = b.targets >= 0
        old = logp if b.old_logp is None else b.old_logp
        return token_terms(logp, old, b.ref_logp, b.advantages, mask, self.eps_low, self.eps_high, self.beta)

    def _loss(self, b: GroupBatch, t: TokenTerms) -> float:
        return float((self._coefficients(b) * t.loss.sum(axis=1)).sum())

    def micro_step(self, executor, b: GroupBatch, key: tuple) -> float:
        """One micro-batch: the gradient of its share of the step's loss added to params.grad."""
        self._reference(executor, b)
        got = []

        def reweight(g, w):                 # g: the graph of the batch's columns up to its last target
            logp = np.zeros(b.targets.shape)
            logp[:, :g.T] = -g.backend.to_host(g.losses).reshape(g.B, g.T).astype(np.float64)
            t = self.terms(b, logp)
            got.append((logp, t))
            weights = -self._coefficients(b)[:, None] * t.dlogp
            return g.backend.to_device(np.ascontiguousarray(weights[:, :g.T]).reshape(-1).astype(g.tmp.dtype))
        executor.reweight = reweight
        try:
            executor.step(b.inputs, b.targets, (b.targets >= 0).astype(executor.tmp.dtype), key)
        finally:
            executor.reweight = None
        logp, t = got[0]
        if b.old_logp is None:
            b.old_logp = logp                # detached: what later passes' ratios are taken against
        self._record(b, t)
        return self._loss(b, t)

    def micro_loss(self, executor, b: GroupBatch, key: tuple) -> float:
        """This micro-batch's share of the loss with the current parameters, forward only."""
        self._reference(executor, b)
        return self._loss(b, self.terms(b, -token_losses(executor, b)))

    def _record(self, b: GroupBatch, t: TokenTerms) -> None:
        mask = b.targets >= 0
        self._tokens.append(np.array([t.kl[mask].sum(), t.low.sum(), t.high.sum(), (t.low | t.high).sum(),
                                      mask.sum()], np.float64))

    def end_step(self, world) -> dict[str, float]:
        self._adapter_stale = True              # the update follows: the next step samples the new policy
        every = world.allgather(self._tokens, "grpo metrics")
        self._tokens = []
        sums = np.sum([x for mine in every for x in mine], axis=0) if any(every) else np.zeros(5)
        seconds, tokens = self.sampler.take_speed()
        self.last = step_metrics(self._batches, self.rewards, self.opts.num_generations, sums, self.beta)
        self.last["sampling/tokens_per_second"] = tokens / max(seconds, 1e-9)
        self.last["sampling/seconds"] = seconds
        return self.last

    def settle(self, world, bad: str | None) -> None:
        pass

    def progress_note(self) -> str:
        m = self.last
        if not m:
            return ""
        return (f"reward {m['reward']:.3f} len {m['completions/mean_length']:.0f} "
                f"sampling {m['sampling/tokens_per_second']:.1f} tok/s")


def step_metrics(batches: list[GroupBatch], rewards: list[R.Reward], G: int, sums: np.ndarray,
                 beta: float) -> dict[str, float]:
    """TRL's GRPO metrics of a step: its completions' rewards and lengths, and the token
    sums (kl, low, high and region clipped, tokens) of its micro-batches."""
    table = np.concatenate([b.rewards for b in batches])
    total = R.total(table, rewards)
    _, mean, std = group_advantages(total, G)
    lengths = np.concatenate([b.lengths for b in batches]).astype(np.float64)
    ended = np.concatenate([b.ended for b in batches])
    out = {"reward": float(mean.mean()), "reward_std": float(std.mean()),
           "frac_reward_zero_std": float(np.isclose(std, 0.0).mean())}
    for j, r in enumerate(rewards):
        col = table[:, j]
        ok = col[~np.isnan(col)]
        out[f"rewards/{r.name}/mean"] = float(ok.mean()) if len(ok) else float("nan")
        out[f"rewards/{r.name}/std"] = float(ok.std(ddof=1)) if len(ok) > 1 else float("nan")
    out["completions/mean_length"] = float(lengths.mean())
    out["completions/min_length"] = float(lengths.min())
    out["completions/max_length"] = float(lengths.max())
    out["completions/clipped_ratio"] = float(1.0 - ended.mean())
    n = max(sums[4], 1.0)
    if beta != 0.0:
        out["kl"] = float(sums[0] / n)
    out["clip_ratio/low_mean"], out["clip_ratio/high_mean"] = float(sums[1] / n), float(sums[2] / n)
    out["clip_ratio/region_mean"] = float(sums[3] / n)
    return out
