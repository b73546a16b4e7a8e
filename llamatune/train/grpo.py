"""GRPO (online RL with verifiable rewards), HF TRL's GRPOTrainer, an objective of the
training loop (objective.py); --num-iterations steps per generation batch (GroupBatcher).

A step: each micro-batch of --batch rows holds --batch / G prompts, each with its G
(--num-generations) completions sampled by the current policy (the batched decode of
models/sampling.generate_group, from a seeded Generator per micro-batch: GroupBatcher) and
scored by the rewards (data/rewards.py). Per group (TRL `_generate_and_score_completions`):
    A_i = (r_i - mean(r)) / (std(r) + 1e-4)      std with Bessel's correction;
                                                 --scale-rewards batch: the batch's std, none: no division
Per completion token t (TRL `_compute_loss`, importance sampling per token):
    rho   = exp(logp - logp_old)                 logp_old: the sampling policy's logp (a batch's first
                                                 step: this forward's, detached, rho = 1)
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
logp (and the reference's) are of the logits divided by --temperature, as TRL's
(LossHead.inv_temperature). Differences from TRL: no entropy mask, no two-sided delta
clipping. Validation (--val-data prompts) generates: GenerationValidator.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..data.samples import Batch, Batcher
from ..errors import LlamatuneError
from . import distributed
from ..data import rewards as R
from .lora import disabled_adapters
from .objective import reweighted_step, token_losses, vocab
from .validation import Validator

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
    micro-batch takes --batch / G prompts and has `rollout` complete and score them.
    A step's micro-batches are made together: the prompts of all of them taken in order,
    then each MPI rank completes its share (micro-batches m = rank, rank + K, ...) and the
    ranks exchange the results, so that every rank holds the step's batches, as one
    process would. Micro-batch i of the run samples from its own Generator
    ([stream, --seed, i]), which makes the completions independent of which rank draws
    them; the count of micro-batches drawn is the sampling state in the checkpoint.
    --num-iterations mu: the step's micro-batches are served again, in the same order, for
    the next mu - 1 steps (TRL's buffered generation batch with steps_per_generation =
    --grad-acc, without its row shuffle); `step_taken` counts the steps, and a state taken
    mid-cycle holds the buffered batches (with the sampling policy's and the reference's
    log-probabilities), so a resumed run replays them."""

    def __init__(self, samples, opts, n_vocab: int, bos_id: int, eos_id: int, rollout, world):
        super().__init__(samples, opts, n_vocab, bos_id, eos_id)
        self.rollout, self.world = rollout, world
        self.drawn = 0                          # micro-batches sampled in the run so far
        self.buffer: list[GroupBatch] = []      # this step's micro-batches (kept for a cycle's replays)
        self.served = 0                         # steps of this cycle taken (0: the next one samples)
        self._cursor = 0
        self.speed = (0.0, 0)                   # (wall seconds, completion tokens) of the last sampling

    def next_batch(self) -> GroupBatch:
        if not self.served and self._cursor == 0:
            self.buffer = self._sample_step()
        b = self.buffer[self._cursor]
        self._cursor += 1
        self.token_count += b.n_targets
        return b

    def _sample_step(self) -> list[GroupBatch]:
        """The step's micro-batches, each rank sampling its share (class doc)."""
        t = time.perf_counter()
        n, per = self.opts.grad_acc * self.world.size, self.opts.batch // self.opts.num_generations
        taken = []
        for _ in range(n):
            self._crossed = False
            taken.append(([self._take()[0] for _ in range(per)], self._crossed))
        mine = {}
        for m in range(self.world.rank, n, self.world.size):
            mine[m] = self.rollout(taken[m][0], np.random.default_rng([_SAMPLING_STREAM, self.opts.seed, self.drawn + m]))
        batches = {m: b for part in self.world.allgather(mine, "grpo sampling") for m, b in part.items()}
        self.drawn += n
        out = [batches[m] for m in range(n)]
        for b, (_, crossed) in zip(out, taken):
            b.epoch_done = crossed
        self.speed = (time.perf_counter() - t, int(sum(b.lengths.sum() for b in out)))
        return out

    def step_taken(self) -> None:
        """A step consumed its batches: the cycle moves on (and ends after mu steps)."""
        self.served, self._cursor = self.served + 1, 0
        if self.served >= self.opts.num_iterations:
            self.buffer, self.served = [], 0

    def take_speed(self) -> tuple[float, int]:
        speed, self.speed = self.speed, (0.0, 0)
        return speed

    def state(self) -> dict:
        out = {**super().state(), "sampled_batches": self.drawn}
        if self.served:
            out["replay"] = {"served": self.served, "batches": [batch_state(b) for b in self.buffer]}
        return out

    def load_state(self, state: dict, samples, force_reshuffle: bool = False) -> None:
        super().load_state(state, samples, force_reshuffle)
        if "sampled_batches" not in state:
            raise LlamatuneError("training state: no sampling state (not a --method grpo checkpoint, or one "
                                 "written by an earlier llamatune, whose sampling cannot be continued)")
        try:
            self.drawn = int(state["sampled_batches"])
            replay = state.get("replay") or {"served": 0, "batches": []}
            self.served, self.buffer = int(replay["served"]), [batch_from_state(d) for d in replay["batches"]]
        except (TypeError, ValueError, KeyError) as e:
            raise LlamatuneError(f"training state: invalid sampling state ({e})") from None
        if self.served >= self.opts.num_iterations:       # --num-iterations lowered since the save
            self.buffer, self.served = [], 0


_ARRAYS = {"inputs": np.int64, "targets": np.int64, "sample_ids": np.int64, "advantages": np.float64,
           "rewards": np.float64, "lengths": np.int64, "ended": bool, "old_logp": np.float64, "ref_logp": np.float64}


def batch_state(b: GroupBatch) -> dict:
    """A buffered batch as JSON (floats as Python writes them: read back bit for bit)."""
    out = {"n_targets": int(b.n_targets), "epoch_done": bool(b.epoch_done)}
    for k in _ARRAYS:
        v = getattr(b, k)
        out[k] = None if v is None else np.asarray(v).tolist()
    return out


def batch_from_state(d: dict) -> GroupBatch:
    arrays = {k: None if d[k] is None else np.asarray(d[k], dtype) for k, dtype in _ARRAYS.items()}
    return GroupBatch(n_targets=int(d["n_targets"]), epoch_done=bool(d["epoch_done"]), **arrays)


class Sampler:
    """GRPO's generation: the current policy (the base with the adapter's current values as
    run-time adapters) completing each prompt G times, then the rewards."""

    def __init__(self, model, opts, rewards: list[R.Reward], backend=None):
        from ..models.infer import Runner
        self.opts, self.rewards, self.model = opts, rewards, model
        self.runner = Runner(model, backend=backend)
        self.tok = model.tokenizer
        self.stop = set(self.tok.eog_ids)

    def use_adapter(self, params, targets) -> None:
        """The runner's adapters: the trained values now (norm adapters are refused by
        the options: the runner does not apply them)."""
        to = self.runner.backend.to_device
        values = params.host_views(params.data)
        self.runner.adapters = {t.weight: [(to(values[t.a].copy()), to(values[t.b].copy()), t.scale)] for t in targets}

    def complete(self, ids: list[int], rng: np.random.Generator) -> list[list[int]]:
        from ..models.sampling import generate_group
        o = self.opts
        return generate_group(self.runner, ids, o.num_generations, o.max_completion_length, rng, o.temperature,
                              o.top_p, self.stop)

    def text(self, completion: list[int]) -> str:
        ended = completion and completion[-1] in self.stop
        return self.tok.decode(completion[:-1] if ended else completion)

    def score(self, rows: list[dict], completions: list[list[int]], per_row: int | None = None) -> np.ndarray:
        """(n, R): the rewards of completions, G (or per_row) per row of `rows`."""
        G = per_row or self.opts.num_generations
        prompts = [row["prompt"] for row in rows for _ in range(G)]
        texts = [self.text(c) for c in completions]
        if rows and isinstance(rows[0]["prompt"], list):          # conversational: TRL's message lists
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        keys = sorted({k for row in rows for k in row if k != "prompt"})
        fields = {k: [row.get(k) for row in rows for _ in range(G)] for k in keys}
        return R.score(self.rewards, prompts, texts, fields)



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
        self._first: list[tuple] = []           # (micro, old_logp, ref_logp) first computed this step here
        self.last: dict[str, float] = {}

    # ---- generation (the batcher's rollout)
    def batcher(self, job) -> GroupBatcher:
        check_fields(self.rewards, job.samples.rows, self.opts.train_data)
        self.job = job
        self.sampler = Sampler(self.model, self.opts, self.rewards, job.backend)
        self._batcher = GroupBatcher(job.samples, self.opts, *vocab(job), self.rollout, distributed.current())
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

    def validator(self, job) -> "GenerationValidator | None":
        if job.val_samples is None:
            return None
        check_fields(self.rewards, job.val_samples.rows, self.opts.val_data)
        return GenerationValidator(job.val_samples, self.opts, self)

    # ---- training
    def begin_step(self, batches: list[GroupBatch]) -> None:
        self._batches = batches
        self._counts = (sum(len(b.lengths) for b in batches), sum(b.n_targets for b in batches), len(batches))

    def _coefficients(self, b: GroupBatch) -> np.ndarray:
        rows, tokens, micro = self._counts
        return coefficients(self.loss_type, b.lengths, rows, tokens, b.n_targets, micro,
                            self.opts.max_completion_length)

    def _tempered(self, executor) -> None:
        """The graph's log-probabilities of logits / --temperature, as TRL takes them."""
        T = float(self.opts.temperature)
        executor.head.inv_temperature = None if T == 1.0 else 1.0 / T

    def _reference(self, executor, b: GroupBatch) -> None:
        """b.ref_logp: the completions' log-probabilities under the base (adapter off)."""
        self._tempered(executor)
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

        def weigh(ce):                      # the batch's columns up to its last target
            logp = np.zeros(b.targets.shape)
            logp[:, :ce.shape[1]] = -ce
            t = self.terms(b, logp)
            return (-self._coefficients(b)[:, None] * t.dlogp)[:, :ce.shape[1]], (logp, t)
        logp, t = reweighted_step(executor, b, key, weigh)
        if b.old_logp is None:
            b.old_logp = logp                # detached: what later passes' ratios are taken against
            if self.opts.num_iterations > 1:     # replays on every rank need it (end_step)
                self._first.append((key[2], b.old_logp, b.ref_logp))
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
        self._batcher.step_taken()
        every = world.allgather((self._tokens, self._first), "grpo metrics")
        self._tokens, self._first = [], []
        for _, first in every:                  # each rank keeps every buffered batch's log-probabilities
            for micro, old, ref in first:
                self._batches[micro].old_logp, self._batches[micro].ref_logp = old, ref
        every = [tokens for tokens, _ in every]
        sums = np.sum([x for mine in every for x in mine], axis=0) if any(every) else np.zeros(5)
        seconds, tokens = self._batcher.take_speed()
        self.last = step_metrics(self._batches, self.rewards, self.opts.num_generations, sums, self.beta)
        if tokens:                              # not on the steps that replay a generation
            self.last["sampling/tokens_per_second"] = tokens / max(seconds, 1e-9)
            self.last["sampling/seconds"] = seconds
        return self.last

    def settle(self, world, bad: str | None) -> None:
        pass

    def progress_note(self) -> str:
        m = self.last
        if not m:
            return ""
        speed = m.get("sampling/tokens_per_second")
        return (f"reward {m['reward']:.3f} len {m['completions/mean_length']:.0f}"
                + ("" if speed is None else f" sampling {speed:.1f} tok/s"))


# --------------------------------------------------------------------------- validation
class GenerationValidator(Validator):
    """--val-data prompts, each completed greedily (argmax, up to --max-completion-length
    tokens, the sampler's stop tokens) by the policy of the moment, and scored by the
    rewards. Its "loss" is minus the mean total reward (so --save-best keeps the highest
    reward and --early-stop waits for one); `last_metrics` holds
      eval_reward                the mean total reward (the --reward-weights sum)
      eval_rewards/<name>/mean   each reward's mean (None values left out)
      eval_accuracy              the share of prompts whose every reward is at least 1,
                                 the built-in rewards' full mark (boxed-answer: right)
      eval_completions/mean_length
    Greedy decoding draws no random number: evaluating leaves the sampling state alone,
    and a resumed run evaluates as the straight one."""

    def __init__(self, samples, opts, objective: GRPO):
        self.opts, self.samples, self.objective = opts, samples, objective
        self.last_metrics: dict[str, float] = {}

    def describe(self) -> str:
        return (f"{len(self.samples)} prompts, completed greedily up to {self.opts.max_completion_length} "
                "tokens and scored (val loss: minus the mean reward)")

    def completions(self) -> list[list[int]]:
        """Each prompt's greedy completion by the current adapter (without its stop token)."""
        from ..models.sampling import generate_ids
        g, o = self.objective, self.opts
        g.sampler.use_adapter(g.job.params, g.job.targets)
        out = []
        for i in range(len(self.samples)):
            ids = self.samples.prompt_ids(i)
            out.append(list(generate_ids(g.sampler.runner, ids, o.max_completion_length, temp=0.0,
                                         n_ctx=len(ids) + o.max_completion_length, stop=g.sampler.stop)))
        return out

    def loss(self, executor) -> float:
        g = self.objective
        completions = self.completions()
        table = g.sampler.score(self.samples.rows, completions, per_row=1)
        total = R.total(table, g.rewards)
        full = np.where(np.isnan(table), np.inf, table) >= 1.0
        m = {"eval_reward": float(total.mean()), "eval_accuracy": float(full.all(axis=1).mean())}
        for j, r in enumerate(g.rewards):
            col = table[:, j][~np.isnan(table[:, j])]
            m[f"eval_rewards/{r.name}/mean"] = float(col.mean()) if len(col) else float("nan")
        m["eval_completions/mean_length"] = float(np.mean([len(c) for c in completions]))
        self.last_metrics = m
        return -m["eval_reward"]


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
