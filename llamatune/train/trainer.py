"""The training loop shared by `finetune` and `train-from-scratch`.

A `Job` says what is trained (the graph's weight provider, the flat parameters,
the LoRA targets) and how outputs are written; `run` does the rest identically
for both: resume or initialize, memory estimate and checkpointing mode (memory.py),
disk-space estimate, micro-batches with gradient accumulation, the divergence guard
between gradient norm and update (guard.py: bad steps are skipped), optimizer steps,
progress, periodic and final checkpoints (written only from a state the guard has
seen healthy), the metrics log (metrics.py), and validation with --save-best and
--early-stop (validation.py).
"""
from __future__ import annotations

import gc
import math
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

from ..backend import cpu, set_tf32
from ..console import err, notice, out
from ..errors import Interrupted, LlamatuneError
from ..formats.gguf_io import KV, gguf_nbytes, kv_nbytes
from ..models.config import ModelConfig
from ..options import TrainOptions, schedule_steps
from ..outputs import check_free_space, metrics_path, prune_saves
from ..precision import ComputePolicy
from ..precision import policy as compute_policy
from . import checkpoint as ckpt
from . import distributed
from .data import Batcher, Samples, describe
from .graph import Graph
from .guard import Guard
from .lora import LoraTarget
from .memory import (
    FASTEST_FIRST,
    Estimate,
    Planner,
    compile_kernels,
    device_runtime_bytes,
    free_memory,
    gib,
    measure_runtime,
)
from .metrics import MetricsLog
from .optimizer import apply_update, gradient_norm, learning_rate
from .params import ParamBuffer
from .preference import PairBatcher, PairValidator, Preference
from .validation import Validator


@dataclass
class Job:
    kind: str                                   # ckpt.KIND_LORA or ckpt.KIND_FULL
    opts: TrainOptions
    cfg: ModelConfig
    base: object                                # graph.FrozenBase or graph.DenseWeights
    params: ParamBuffer
    targets: list[LoraTarget]
    samples: Samples
    tokenizer: object
    init_params: Callable[[np.random.Generator], None]
    write_outputs: Callable[[str], list[Path]]  # tag (iteration or LATEST) -> files written
    model_kvs: list[KV] = field(default_factory=list)   # extra metadata kept in checkpoints
    base_fingerprint: str = ""
    mapped_bytes: int = 0                       # memory-mapped base model size
    scratch_bytes: int = 0                      # dequantization scratch
    backend: object = None                      # backend.Backend (None: cpu)
    model_path: Path | None = None              # the memory-mapped base model file
    output_size: tuple[Path, int] | None = None  # (output template, bytes of one output file)
    val_samples: Samples | None = None          # validation samples (None: no validation)
    statistics: object = None                   # statistics.TrainingStats: imatrix sums of the forward (LoRA sft)
    side_outputs: list[tuple[Path, int]] = field(default_factory=list)   # (template, bytes) written with each output
    checkpoint_extra_bytes: int = 0             # what checkpoint_extra adds to a checkpoint once the run has counted

    def checkpoint_extra(self) -> tuple[list, list]:
        """KVs and tensors a checkpoint keeps besides the parameters (the imatrix sums)."""
        return self.statistics.checkpoint() if self.statistics is not None else ([], [])


@dataclass
class TrainResult:
    state: ckpt.TrainState
    losses: list[float]                         # mean loss per optimizer step, this run
    files: list[Path]
    seconds: float
    tokens_per_second: float
    steady_tokens_per_second: float = 0.0       # after the first step (compilation, first page-in)


def memory_estimate(job: Job, backend, policy: ComputePolicy, quiet: bool) -> Estimate:
    """Choose the checkpointing mode (auto: the fastest that fits), say it in one line,
    and refuse a run that does not fit with what would."""
    o = job.opts
    compile_kernels(backend, o, {t.qtype for t in getattr(job.base, "tensors", {}).values()}, job.cfg)
    device = backend.gpu
    runtime = device_runtime_bytes(backend) if device else measure_runtime(job.params, job.model_path)
    planner = Planner(job.cfg, job.targets, job.base, runtime, job.mapped_bytes, job.scratch_bytes,
                      getattr(o, "lora_dropout", 0.0), device=device, policy=policy)
    have = free_memory(backend)
    mode = o.checkpointing_mode()
    est = planner.choose(o.batch, o.ctx, mode, have)
    if not quiet:
        err.print(f"data: {describe(job.samples)}")
        chosen = "; chosen by --checkpointing auto" if mode == "auto" else ""
        err.print(f"trainable parameters: {job.params.size:,} ({state_line(job.params)}); "
                  f"memory estimate: {est.describe()}"
                  + (f", available {gib(have)}" if have else "") + chosen)
    if o.dry_run:
        if not quiet:
            out.print(dry_run_report(planner, o.batch, o.ctx, mode, have, est, save_sizes(job, "ITERATION"),
                                     state_line(job.params)))
        return est
    if have is not None and est.added > have:
        where = " on the GPU" if device else ""
        raise LlamatuneError(f"training needs about {gib(est.total)}{where} but only {gib(have)} is available "
                             f"(besides {gib(est.runtime)} in use; --checkpointing {est.mode}): "
                             f"{planner.what_fits(o.batch, o.ctx, mode, have)}")
    return est


def state_line(params: ParamBuffer) -> str:
    """What the trained values hold (inside each estimate's measured runtime)."""
    n = 4 * params.size
    bf16 = params.has_moments and params.m.dtype == np.uint16
    moments = (f"AdamW moments {gib(n if bf16 else 2 * n)}{' (bf16)' if bf16 else ''}" if params.has_moments
               else "no optimizer moments (SGD)")
    return f"f32 weights {gib(n)}, gradients {gib(n)}, {moments}"


def dry_run_report(planner: Planner, B: int, T: int, mode: str, have: int | None, chosen: Estimate,
                   saves: list[tuple[Path, int]], state: str = "") -> str:
    """--dry-run: each mode's estimate, which one this run would take, what a save writes
    (and `state`: what the trained values hold, state_line)."""
    lines = ["dry run: nothing trained or written"]
    for m in reversed(FASTEST_FIRST):                  # the least memory first
        e = planner.estimate(B, T, m)
        fits = "" if have is None else ("  fits" if e.added <= have else "  does not fit")
        lines.append(f"  {e.describe()}{fits}")
    why = "--checkpointing auto picks" if mode == "auto" else "this run takes"
    if have is not None and chosen.added > have:
        lines.append(f"  available {gib(have)}: no mode fits; {planner.what_fits(B, T, mode, have)}")
    else:
        lines.append(f"  {'' if have is None else f'available {gib(have)}: '}{why} {chosen.mode}")
    total = sum(n for _, n in saves)
    lines.append(f"  each save writes {file_size(total)}: " + ", ".join(f"{p.name} {file_size(n)}" for p, n in saves))
    if state:
        lines.append(f"  trained values (in each runtime above): {state}")
    return "\n".join(lines)


def file_size(n: int) -> str:
    """Bytes as MiB, or KiB below 1 MiB."""
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def policy_of(job: Job, backend, requested: str) -> ComputePolicy:
    """The run's compute policy (precision.policy) for the --compute-dtype `requested`
    (--tf32 stands for tf32 where auto is asked; `resume_or_init` gives the dtype a
    resumed checkpoint recorded); where this device cannot run a checkpoint's dtype (a
    GPU's bf16 run resumed on a CPU without native bf16), what auto picks here."""
    o = job.opts
    if getattr(o, "tf32", False) and requested == "auto":
        requested = "tf32"
    args = (backend.name, job.base.trainable, getattr(o, "merge_aware", False), backend.capability)
    try:
        return compute_policy(requested, *args)
    except LlamatuneError as e:
        if o.compute_dtype != "auto" or requested == "auto":       # asked for, not a checkpoint's
            raise
        chosen = compute_policy("auto", *args)
        return replace(chosen, why=f"{chosen.why} (the checkpoint's {requested} cannot run here: {e})")


def resume_or_init(job: Job, batcher: Batcher) -> tuple[ckpt.TrainState, str]:
    """The state to start from (a checkpoint's, or fresh with initialized parameters) and
    the --compute-dtype to resolve: a resume keeps the dtype its checkpoint was trained
    with where the run asks for auto."""
    o = job.opts
    path = o.checkpoint_in
    if path is not None and Path(path).exists():
        c = ckpt.load(Path(path))
        if c.kind != job.kind:
            raise LlamatuneError(f"{path}: is a {c.kind} checkpoint; this command trains {job.kind}")
        if job.base_fingerprint and c.base_fingerprint and c.base_fingerprint != job.base_fingerprint:
            raise LlamatuneError(f"{path}: was trained on a different base model than the one given")
        requested = ckpt.recorded_dtype(c) if o.compute_dtype == "auto" else o.compute_dtype
        ckpt.check_frozen_options(c, o, ranks=distributed.current().size, given={"compute_dtype": requested})
        c.load_into(job.params)
        if job.statistics is not None and not job.statistics.restore(c.file):
            notice(f"{path} holds no imatrix statistics: the imatrix files cover the steps from "
                   f"iteration {c.state.iteration} on")
        if c.state.data_state:
            batcher.load_state(c.state.data_state, job.samples, force_reshuffle=o.force_reshuffle)
        notice(f"resuming from {path} at iteration {c.state.iteration}")
        return c.state, requested
    if path is not None:
        notice(f"{path} does not exist: starting a fresh run")
    job.init_params(np.random.default_rng(o.seed))
    return ckpt.TrainState(), o.compute_dtype


def save_all(job: Job, state: ckpt.TrainState, batcher: Batcher, policy: ComputePolicy,
             data_state: dict | None = None) -> list[Path]:
    """Write the checkpoint and outputs of this iteration, then their LATEST copies, the
    LATEST checkpoint last: a write that fails (disk full) leaves every LATEST file as the
    previous save left it, and chk-LATEST never points past complete outputs.
    `data_state`: the batcher's state at this iteration when the batcher has moved on."""
    o = job.opts
    if not distributed.current().is_root:         # rank 0 alone writes files
        return []
    state.ranks = distributed.current().size
    state.data_state = data_state if data_state is not None else batcher.state()
    out = ckpt.iteration_path(o.checkpoint_out, state.iteration)
    ckpt.save(out, job.kind, job.cfg.arch, o, job.params, state, job.model_kvs, job.base_fingerprint,
              job.checkpoint_extra(), policy)
    files = [out] + job.write_outputs(str(state.iteration))
    template = job.output_size and job.output_size[0]
    if o.fn_latest and (template is None or ckpt.iteration_path(template, o.fn_latest) not in files):
        files += job.write_outputs(o.fn_latest)   # an output named without ITERATION is written once
    latest = ckpt.iteration_path(o.checkpoint_out, o.fn_latest)
    if latest != out:
        ckpt.copy_atomic(out, latest)
        files.append(latest)
    prune_saves(files, state.iteration, o.save_total_limit)     # --save-total-limit
    return files


CHECKPOINT_STATE_BYTES = 1024       # a checkpoint's state KVs (counters, data order, guard, validation)


def checkpoint_bytes(job: Job) -> int:
    """A checkpoint's size (ckpt.save): the f32 parameters, both Adam moments (f32 or
    bf16; none for SGD), what checkpoint_extra adds, and the metadata."""
    p, o = job.params, job.opts
    tensors = [(s.name, len(s.shape), 4 * math.prod(s.shape)) for s in p.specs]
    if p.has_moments:
        width = 2 if p.m.dtype == np.uint16 else 4
        tensors += [(f"optimizer.adam.{which}_moments", 1, width * p.size) for which in ("first", "second")]
    meta = kv_nbytes(job.model_kvs) + len(ckpt.options_json(o)) + CHECKPOINT_STATE_BYTES
    return gguf_nbytes(meta, tensors) + job.checkpoint_extra_bytes


def save_sizes(job: Job, iteration: int | str = 0) -> list[tuple[Path, int]]:
    """(path, bytes) of each file a save at `iteration` writes: the checkpoint
    (checkpoint_bytes), the outputs and the files beside them, as the job says, each also
    under the LATEST name."""
    o = job.opts
    sizes = [(ckpt.iteration_path(o.checkpoint_out, tag), checkpoint_bytes(job)) for tag in (iteration, o.fn_latest)]
    for template, nbytes in ([job.output_size] if job.output_size is not None else []) + job.side_outputs:
        sizes += [(ckpt.iteration_path(template, tag), nbytes) for tag in (iteration, o.fn_latest)]
    return list(dict(sizes).items())              # a name without ITERATION is one file, written once


def packing(b) -> dict:
    """A packed batch's positions and segments for Graph.step (empty for unpacked rows)."""
    return {k: getattr(b, k) for k in ("positions", "segments") if getattr(b, k, None) is not None}


def recomputed_loss(graph: Graph, batches: list, seed: int, step: int, pref=None) -> float:
    """The loss of a step's batches with the current parameters (gradients are added to
    params.grad, which the next step zeroes): verifies the state after the last update.
    pref: (Preference, reference cache) of --method dpo / orpo."""
    n_targets = sum(b.n_targets for b in batches)
    world, mine = distributed.current(), []
    counts = pref and Preference.counts(batches)
    for micro, b in distributed.my_share(world, batches):     # each MPI rank its own micro-batches
        if pref:
            mine.append(pref[0].loss(graph, b, pref[1], *counts))
            continue
        w = (b.targets >= 0).astype(np.float32) / np.float32(n_targets)
        mine.append(graph.step(b.inputs, b.targets, w, (seed, step, micro), **packing(b)))
    return distributed.sum_losses(world, mine)


def saved_line(state: ckpt.TrainState, loss: float, files: list[Path]) -> str:
    """`loss`: the loss of step state.iteration, as metrics.jsonl logs it."""
    return f"saved iteration {state.iteration}: loss {loss:.4f} -> " + ", ".join(str(p) for p in files[:2])


class TrainClock:
    """Training time: wall time since the start, less evaluations and saves (they are
    not training), so that tokens/s says how fast the steps run."""

    def __init__(self):
        self.start, self.excluded = time.perf_counter(), 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self.start - self.excluded

    @contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t


@contextmanager
def resume_hint(o, state: ckpt.TrainState):
    """Turn Ctrl-C in a run, and SIGTERM (a batch system's time limit, `kill`), into
    `Interrupted`, whose message says where the run stands and how to go on from its
    last save; a save under way deletes its temporary file on the way out, as on any
    error. `.iteration` of what it yields: the iteration the last save of this run
    holds (None: none yet)."""
    saves = SimpleNamespace(iteration=None)
    start, terminated = state.iteration, []

    def on_term(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt
    main = threading.current_thread() is threading.main_thread()     # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        yield saves
    except KeyboardInterrupt:
        here = f"at iteration {state.iteration}"
        if saves.iteration is not None:
            latest = ckpt.iteration_path(o.checkpoint_out, o.fn_latest or saves.iteration)
            line = f"{here}; {latest} holds iteration {saves.iteration}: go on with --checkpoint-in {latest}"
        elif start > 0:
            line = f"{here}; nothing saved since iteration {start}: go on with --checkpoint-in {o.checkpoint_in}"
        else:
            line = f"{here}; nothing saved yet (--save-every {o.save_every})"
        raise Interrupted(line, 143 if terminated else 130) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def final_save(job: Job, state: ckpt.TrainState, batcher: Batcher, graph: Graph, guard: Guard,
               batches: list, bad: str | None, show, pref=None, step_loss: float = float("nan")) -> list[Path]:
    """Save the end of the run if the last step's batches still give a sane loss after
    its update (no later step will verify it); else leave LATEST at the last healthy save.
    `step_loss`: the last step's loss, as logged, for the saved line."""
    loss = float("nan") if bad else recomputed_loss(graph, batches, job.opts.seed, state.iteration - 1, pref)
    if bad or not guard.healthy(loss):
        show.line(f"iteration {state.iteration} not saved: " + (bad or f"loss {loss:.4f} after the last update")
                  + "; LATEST keeps the last healthy save")
        return []
    files = save_all(job, state, batcher, graph.policy)
    show.line(saved_line(state, step_loss, files))
    return files


def make_validator(job: Job, state: ckpt.TrainState, pref: Preference | None = None) -> Validator | None:
    """The validation set's fixed batches; state.validation restored or started afresh."""
    if job.val_samples is None:
        return None
    vocab = (job.cfg.n_vocab, job.tokenizer.bos_id, job.tokenizer.eos_id)
    v = Validator(job.val_samples, job.opts, *vocab) if pref is None else PairValidator(job.val_samples, job.opts,
                                                                                         *vocab, pref)
    state.validation = v.restore(state.validation)
    return v


def save_best(job: Job, state: ckpt.TrainState, batcher: Batcher, policy: ComputePolicy) -> list[Path]:
    """The checkpoint and outputs under the BEST name (--save-best)."""
    o = job.opts
    if not distributed.current().is_root:         # rank 0 alone writes files
        return []
    state.data_state = batcher.state()
    out = ckpt.iteration_path(o.checkpoint_out, "BEST")
    ckpt.save(out, job.kind, job.cfg.arch, o, job.params, state, job.model_kvs, job.base_fingerprint,
              job.checkpoint_extra(), policy)
    return [out] + job.write_outputs("BEST")


def evaluate(job: Job, graph: Graph, validator: Validator, state: ckpt.TrainState, batcher: Batcher,
             metrics: MetricsLog, show) -> bool:
    """Validation loss now: logged, kept as the best (with --save-best, its outputs too).
    Returns True when --early-stop's patience has run out."""
    vs = state.validation
    loss = validator.loss(graph)
    improved = vs.record(state.iteration, loss)
    extra = getattr(validator, "last_metrics", {})                 # preference pairs: eval_rewards/... (TRL's)
    metrics.eval(state.iteration, loss, extra)
    show.refresh(state)
    text = f"step {state.iteration}: val loss {loss:.4f}"
    if "eval_rewards/accuracies" in extra:
        text += f", reward accuracy {extra['eval_rewards/accuracies']:.1%}"
    text += " (best)" if improved else f" (best {vs.best_loss:.4f} at step {vs.best_step})"
    if improved and job.opts.save_best:
        text += " -> " + ", ".join(str(p) for p in save_best(job, state, batcher, graph.policy))
    show.line(text)
    if validator.should_stop(vs):
        show.line(f"early stop: {vs.since_best} evaluations without a lower val loss than {vs.best_loss:.4f} "
                  f"(step {vs.best_step})")
        return True
    return False


def write_plot(path: Path, quiet: bool) -> None:
    """The loss plot beside the metrics, when matplotlib is installed (a notice otherwise)."""
    from .plot import plot_metrics
    try:
        out = plot_metrics(path, path.with_suffix(".png"))
    except LlamatuneError as e:
        notice(f"no loss plot: {e}")
        return
    if not quiet:
        err.print(f"loss plot: {out}")


def preference(job: Job) -> Preference | None:
    """The objective of --method dpo / orpo (preference.py); None for sft."""
    method = getattr(job.opts, "method", "sft")
    return None if method == "sft" else Preference(job.opts)


def run(job: Job, quiet: bool = False) -> TrainResult:
    o = job.opts
    world = distributed.setup(o)                   # MPI ranks when launched by mpiexec/srun
    quiet = quiet or not world.is_root
    if o.threads > 0:
        import numba
        numba.set_num_threads(min(o.threads, numba.config.NUMBA_NUM_THREADS))
    pref = preference(job)                         # --method dpo / orpo (None: sft)
    batcher = (Batcher if pref is None else PairBatcher)(job.samples, o, job.cfg.n_vocab, job.tokenizer.bos_id,
                                                         job.tokenizer.eos_id)
    distributed.check_same_job(world, o, job.samples.hash, job.base_fingerprint)
    state, requested = resume_or_init(job, batcher)   # parameters are initialized or loaded on the host,
    backend = job.backend or cpu()
    policy = policy_of(job, backend, requested)       # checkpoints record it
    set_tf32(backend.xp, policy.tensor_cores)         # a GPU's float32 products (nothing on numpy)
    if not quiet:
        err.print(f"compute: {policy.why}")
        note = schedule_steps(o)[2]
        if note:
            err.print(note)                        # warmup and decay fitted to a shorter run
    if backend.name != "cpu":
        job.params.to_device(backend)              # then live where the graph runs
    est = memory_estimate(job, backend, policy, quiet)
    if o.dry_run:
        return TrainResult(state, [], [], 0.0, 0.0)
    graph = Graph(job.cfg, job.base, job.params, job.targets, o.batch, o.ctx, est.mode,
                  getattr(o, "lora_dropout", 0.0), backend=backend, policy=policy)
    validator = make_validator(job, state, pref)
    if not quiet:
        if validator is not None:
            err.print(f"validation: {validator.describe()}")
        if world.size > 1:
            err.print(distributed.memory_line(world, est.total, job.params.size))
    check_free_space(save_sizes(job))
    if state.iteration >= o.adam_iter:
        notice(f"already at iteration {state.iteration} of --adam-iter {o.adam_iter}: nothing to do")
        return TrainResult(state, [], [], 0.0, 0.0)
    if validator is not None and validator.should_stop(state.validation):
        notice(f"stopped early at iteration {state.iteration} (--early-stop {o.early_stop}): nothing to do")
        return TrainResult(state, [], [], 0.0, 0.0)
    metrics = MetricsLog(metrics_path(o), state.iteration, write=world.is_root)   # rank 0 alone writes

    losses: list[float] = []
    files: list[Path] = []
    guard = Guard(o.spike_threshold, o.max_bad_steps, state.guard)
    pending = False     # a save is due: made once the next step's loss shows the state is healthy
    tokens_per_step = o.batch * o.ctx * o.grad_acc * world.size
    grads = distributed.GradientSum(world, job.params)
    distributed.check_identical_parameters(world, job.params, state.iteration)
    clock = TrainClock()
    first_seconds = 0.0                            # training time when the first step ended
    from ..progress import train_progress
    # numpy's overflow warnings are left out: the guard reports non-finite steps itself
    with train_progress(o.adam_iter, state.iteration, quiet, ranks=world.size, every=o.progress_every) as show, \
            np.errstate(over="ignore", invalid="ignore"), \
            metrics, resume_hint(o, state) as saves:
        if validator is not None and state.iteration == 0:
            with clock.paused():
                evaluate(job, graph, validator, state, batcher, metrics, show)
        while state.iteration < o.adam_iter:
            step = state.iteration
            metrics.begin_step()
            job.params.zero_grad(lazy=getattr(job.base, "lazy_grads", False))
            data_state = batcher.state() if pending else None
            batches = [batcher.next_batch() for _ in range(o.grad_acc * world.size)]   # the global batch
            n_targets = sum(b.n_targets for b in batches)
            if n_targets == 0:
                raise LlamatuneError("a training step has no loss targets (samples too short?)")
            counts = pref and Preference.counts(batches)   # pairs and chosen tokens of the step
            for micro, b in grads.mine(batches):        # this rank's micro-batches; micro: global index
                if pref is not None:
                    grads.add(pref.step(graph, b, batcher.reference, *counts, (o.seed, step, micro)))
                    continue
                w = (b.targets >= 0).astype(np.float32) / np.float32(n_targets)
                if job.statistics is not None:         # this forward's inputs are counted (statistics.py)
                    job.statistics.batch(b.targets)
                    graph.observer = job.statistics
                grads.add(graph.step(b.inputs, b.targets, w, (o.seed, step, micro), **packing(b)))
                graph.observer = None
            loss = grads.finish()                      # gradient and loss summed in global micro-batch order
            extra = pref.finish_step(world, batcher.reference) if pref is not None else {}
            gnorm = gradient_norm(job.params)
            bad = guard.judge(loss, gnorm)                 # None, or why this step's update is skipped
            if pending and not bad:                        # the state this step started from is healthy
                with clock.paused():
                    files = save_all(job, state, batcher, policy, data_state)
                saves.iteration = state.iteration
                show.line(saved_line(state, logged, files))       # the loss logged at state.iteration
                pending = False
            if job.statistics is not None and bad:         # a skipped step's inputs are not counted
                job.statistics.discard()
            elif job.statistics is not None:               # after the save of the state before this step
                job.statistics.commit(world)
            lr = learning_rate(step, o) if bad else apply_update(job.params, step, o, gnorm)
            guard.record(loss, bad, step + 1)
            state.guard = guard.state()
            state.iteration += 1
            state.sample_count = batcher.sample_count
            state.token_count = batcher.token_count
            state.epoch = batcher.epoch
            if bad:
                show.line(f"iteration {step + 1}: update skipped, {bad}")
            else:
                ema = loss if math.isnan(state.loss_ema) else 0.9 * state.loss_ema + 0.1 * loss
                state.loss_ema = float(np.float32(ema))  # as the checkpoint keeps it: a resumed run goes on from the same value
                losses.append(loss)
                if len(losses) == 1:
                    first_seconds = clock.seconds()
            show(state, loss, lr, gnorm, len(losses) * tokens_per_step / max(clock.seconds(), 1e-9))
            metrics.step(state, loss, lr, gnorm, n_targets, extra)
            logged = loss
            done = state.iteration >= o.adam_iter or (o.epochs > 0 and state.epoch >= o.epochs)
            if validator is not None and validator.due(state.iteration, done):
                with clock.paused():
                    done = evaluate(job, graph, validator, state, batcher, metrics, show) or done
            if distributed.checksum_due(o, state.iteration, done):
                distributed.check_identical_parameters(world, job.params, state.iteration)
            pending = pending or bool(o.save_every and state.iteration % o.save_every == 0)
            if done:
                with clock.paused():
                    last = final_save(job, state, batcher, graph, guard, batches, bad, show,
                                      pref and (pref, batcher.reference), step_loss=loss)
                if last:
                    files, saves.iteration = last, state.iteration
                break
    seconds = clock.seconds()
    del graph                                      # its buffers go before the plot brings in matplotlib
    gc.collect()                                   # (30-40 MB): the end of a run needs no more than its steps
    if o.plot and world.is_root:
        write_plot(metrics.path, quiet)
    tokens_per_second = len(losses) * tokens_per_step / max(seconds, 1e-9)
    if world.size > 1 and not quiet:
        notice(distributed.summary(world, tokens_per_second))
    # after the first step (compilation, first page-in)
    steady = (len(losses) - 1) * tokens_per_step / max(seconds - first_seconds, 1e-9) if len(losses) > 1 else 0.0
    return TrainResult(state, losses, files, seconds, tokens_per_second, steady)
