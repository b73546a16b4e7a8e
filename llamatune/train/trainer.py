"""The training loop shared by `finetune` and `train-from-scratch`.

A `Job` says what is trained (the graph's weight provider, the flat parameters, the
LoRA targets), for what (its objective: objective.SFT, preference.Preference or grpo.GRPO) and
how outputs are written; `run` does the rest identically for all: `set_up` (resume or
initialize, compute policy, memory estimate and checkpointing mode (memory.py), graph,
validation, disk-space estimate), the loop (`step`: micro-batches with gradient
accumulation, the divergence guard between gradient norm and update (guard.py: bad
steps are skipped), the optimizer step, progress, the metrics log (metrics.py),
validation with --save-best and --early-stop (validation.py)), and `finish`. Every
file goes through `save`: periodic and final checkpoints and outputs (written only
from a state the guard has seen healthy) and BEST.
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
from ..data.samples import Batcher, Samples, describe
from ..errors import Interrupted, LlamatuneError
from ..formats.gguf_io import KV, gguf_nbytes, kv_nbytes
from ..models.config import ModelConfig
from ..options import TrainOptions, schedule_steps
from ..outputs import check_free_space, metrics_path, prune_saves
from ..precision import ComputePolicy
from ..precision import policy as compute_policy
from . import checkpoint as ckpt
from . import distributed
from .step import StepExecutor, compile_kernels
from .guard import Guard
from .lora import LoraTarget
from .memory import (
    FASTEST_FIRST,
    Estimate,
    Planner,
    device_runtime_bytes,
    free_memory,
    gib,
    measure_runtime,
)
from .metrics import MetricsLog
from .objective import SFT
from .optimizer import Settings, apply_update, gradient_norm, learning_rate
from .params import ParamBuffer
from .validation import Validator


@dataclass
class Job:
    kind: str                                   # ckpt.KIND_LORA or ckpt.KIND_FULL
    opts: TrainOptions
    cfg: ModelConfig
    weights: object                                # weights.FrozenBase, params.DenseWeights or full.FullWeights
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
    side_outputs: list[tuple[Path, int]] = field(default_factory=list)   # (template, bytes) written with each output
    checkpoint_extra_bytes: int = 0             # what checkpoint_extra adds to a checkpoint once the run has counted
    statistics: object = None                   # statistics.TrainingStats: imatrix sums of the forward (LoRA sft)
    objective: object = field(default_factory=SFT)   # what a step trains for (objective.py)

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
    compile_kernels(backend, o, {t.qtype for t in job.weights.tensors.values()}, job.cfg, policy)
    device = backend.gpu
    runtime = device_runtime_bytes(backend) if device else measure_runtime(job.params, job.model_path)
    planner = Planner(job.cfg, job.targets, job.weights, runtime, job.mapped_bytes, job.scratch_bytes,
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


def router_options(job: Job) -> float:
    """--router-aux-loss-coef, refused (as --train-router) for a model without experts."""
    o = job.opts
    coef, train = getattr(o, "router_aux_loss_coef", 0.0), getattr(o, "train_router", False)
    if (coef or train) and not job.cfg.n_expert:
        flag = "--router-aux-loss-coef" if coef else "--train-router"
        raise LlamatuneError(f"{job.model_path}: {flag} is for a mixture of experts; this {job.cfg.arch} model "
                             "has no router")
    return coef


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
    lines.append("  " + file_share(planner, chosen))
    total = sum(n for _, n in saves)
    lines.append(f"  each save writes {file_size(total)}: " + ", ".join(f"{p.name} {file_size(n)}" for p, n in saves))
    if state:
        lines.append(f"  trained values (in each runtime above): {state}")
    return "\n".join(lines)


def file_share(planner: Planner, chosen: Estimate) -> str:
    """The model file's share of an estimate: its pages are mapped and read in place (the
    page cache's, shared, dropped under pressure and read again), the rest is the run's
    own; a mixture of experts' 3-D expert tensors named within it."""
    experts = sum(t.nbytes for t in getattr(planner.weights, "experts", {}).values())
    of = f" (the experts {gib(experts)} of it)" if experts else ""
    return (f"of the {chosen.mode} estimate: the model file {gib(chosen.model)}{of}, mapped and read in place; "
            f"the run's own memory {gib(chosen.total - chosen.model)}")


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
    args = (backend.name, job.weights.trainable, getattr(o, "merge_aware", False), backend.capability)
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
    n = checkpoint_bytes(job)
    sizes = [(ckpt.iteration_path(o.checkpoint_out, tag), n) for tag in (iteration, o.fn_latest)]
    for template, nbytes in ([job.output_size] if job.output_size is not None else []) + job.side_outputs:
        sizes += [(ckpt.iteration_path(template, tag), nbytes) for tag in (iteration, o.fn_latest)]
    return list(dict(sizes).items())              # a name without ITERATION is one file, written once


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


@dataclass
class Training:
    """One run's parts, made once by `set_up` and used by the loop, the evaluations and
    the saves. `pending`: a periodic save is due, made once the next step's loss shows
    the state healthy."""
    job: Job
    world: object                                   # distributed.World
    batcher: Batcher
    state: ckpt.TrainState
    executor: StepExecutor | None                             # None once the loop is over
    validator: Validator | None
    quiet: bool
    guard: Guard | None = None
    metrics: MetricsLog | None = None
    grads: object = None                            # distributed.GradientSum
    clock: TrainClock = field(default_factory=TrainClock)
    show: object = None                             # progress.train_progress
    saves: object = None                            # resume_hint's last save
    losses: list[float] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    first_seconds: float = 0.0                      # training time when the first step ended
    pending: bool = False
    logged: float = float("nan")                    # the loss metrics.jsonl logged for state.iteration

    @property
    def tokens_per_step(self) -> int:
        o = self.job.opts
        return o.batch * o.ctx * o.grad_acc * self.world.size


def run(job: Job, quiet: bool = False) -> TrainResult:
    """Set up (`set_up`), train (`train`), and report (`finish`)."""
    t = set_up(job, quiet)
    if isinstance(t, TrainResult):                 # --dry-run, or nothing left to do
        return t
    train(t)
    return finish(t)


def set_up(job: Job, quiet: bool) -> Training | TrainResult:
    """Resume or initialize, resolve the compute policy, plan memory, build the graph and
    the validation; a TrainResult where there is nothing to train."""
    o = job.opts
    world = distributed.setup(o)                   # MPI ranks when launched by mpiexec/srun
    quiet = quiet or not world.is_root
    if o.threads > 0:
        import numba
        numba.set_num_threads(min(o.threads, numba.config.NUMBA_NUM_THREADS))
    batcher = job.objective.batcher(job)
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
    router_aux = router_options(job)
    est = memory_estimate(job, backend, policy, quiet)
    if o.dry_run:
        return TrainResult(state, [], [], 0.0, 0.0)
    executor = StepExecutor(job.cfg, job.weights, job.params, job.targets, o.batch, o.ctx, est.mode,
                  getattr(o, "lora_dropout", 0.0), backend=backend, policy=policy)
    executor.router_aux_coef = router_aux
    validator = job.objective.validator(job)
    if validator is not None:
        state.validation = validator.restore(state.validation)
    if not quiet:
        if validator is not None:
            err.print(f"validation: {validator.describe()}")
        if world.size > 1:
            err.print(distributed.memory_line(world, est.total, job.params.size))
    check_free_space(save_sizes(job))
    if state.iteration >= Settings.of(o).steps:
        notice(f"already at iteration {state.iteration} of --adam-iter {o.adam_iter}: nothing to do")
        return TrainResult(state, [], [], 0.0, 0.0)
    if validator is not None and validator.should_stop(state.validation):
        notice(f"stopped early at iteration {state.iteration} (--early-stop {o.early_stop}): nothing to do")
        return TrainResult(state, [], [], 0.0, 0.0)
    return Training(job, world, batcher, state, executor, validator, quiet)


def train(t: Training) -> None:
    """The loop: steps until --adam-iter, --epochs or --early-stop ends it."""
    o, state = t.job.opts, t.state
    t.metrics = MetricsLog(metrics_path(o), state.iteration, write=t.world.is_root)   # rank 0 alone writes
    t.guard = Guard(o.spike_threshold if t.job.objective.spikes else math.inf, o.max_bad_steps, state.guard)
    t.grads = distributed.GradientSum(t.world, t.job.params)
    distributed.check_identical_parameters(t.world, t.job.params, state.iteration)
    t.clock = TrainClock()
    from ..progress import train_progress
    # numpy's overflow warnings are left out: the guard reports non-finite steps itself
    with train_progress(Settings.of(o).steps, state.iteration, t.quiet, ranks=t.world.size, every=o.progress_every) as t.show, \
            np.errstate(over="ignore", invalid="ignore"), t.metrics, resume_hint(o, state) as t.saves:
        if t.validator is not None and state.iteration == 0:
            with t.clock.paused():
                evaluate(t)
        while not step(t):
            pass


def step(t: Training) -> bool:
    """One optimizer step over the global batch (a save that was due first, once this
    step's loss shows the state it started from healthy); True when the run is done."""
    o, state, job, objective = t.job.opts, t.state, t.job, t.job.objective
    step = state.iteration
    t.metrics.begin_step()
    job.params.zero_grad(lazy=job.weights.lazy_grads)
    data_state = t.batcher.state() if t.pending else None
    batches = [t.batcher.next_batch() for _ in range(o.grad_acc * t.world.size)]   # the global batch
    n_targets = sum(b.n_targets for b in batches)
    if n_targets == 0:
        raise LlamatuneError("a training step has no loss targets (samples too short?)")
    objective.begin_step(batches)
    for micro, b in t.grads.mine(batches):         # this rank's micro-batches; micro: global index
        t.grads.add(objective.micro_step(t.executor, b, (o.seed, step, micro)))
    loss = t.grads.finish()                        # gradient and loss summed in global micro-batch order
    extra = objective.end_step(t.world)
    gnorm = gradient_norm(job.params)
    bad = t.guard.judge(loss, gnorm)               # None, or why this step's update is skipped
    if t.pending and not bad:                      # the state this step started from is healthy
        with t.clock.paused():
            t.files = save(t, state.iteration, data_state)
        t.saves.iteration = state.iteration
        t.show.line(saved_line(state, t.logged, t.files))   # the loss logged at state.iteration
        t.pending = False
    objective.settle(t.world, bad)                 # after the save of the state before this step
    lr = learning_rate(step, o) if bad else apply_update(job.params, step, o, gnorm)
    advance(t, loss, bad)
    t.show.note = objective.progress_note()
    t.show(state, loss, lr, gnorm, len(t.losses) * t.tokens_per_step / max(t.clock.seconds(), 1e-9))
    t.metrics.step(state, loss, lr, gnorm, n_targets, extra)
    t.logged = loss
    done = state.iteration >= Settings.of(o).steps or (o.epochs > 0 and state.epoch >= o.epochs)
    if t.validator is not None and t.validator.due(state.iteration, done):
        with t.clock.paused():
            done = evaluate(t) or done
    if distributed.checksum_due(o, state.iteration, done):
        distributed.check_identical_parameters(t.world, job.params, state.iteration)
    t.pending = t.pending or bool(o.save_every and state.iteration % o.save_every == 0)
    if done:
        with t.clock.paused():
            final_save(t, batches, bad)
    return done


def advance(t: Training, loss: float, bad: str | None) -> None:
    """The state after a step: the guard's record, counters, the loss average."""
    state, batcher = t.state, t.batcher
    t.guard.record(loss, bad, state.iteration + 1)
    state.guard = t.guard.state()
    state.iteration += 1
    state.sample_count, state.token_count, state.epoch = batcher.sample_count, batcher.token_count, batcher.epoch
    if bad:
        t.show.line(f"iteration {state.iteration}: update skipped, {bad}")
        return
    ema = loss if math.isnan(state.loss_ema) else 0.9 * state.loss_ema + 0.1 * loss
    state.loss_ema = float(np.float32(ema))  # as the checkpoint keeps it: a resumed run goes on from the same value
    t.losses.append(loss)
    if len(t.losses) == 1:
        t.first_seconds = t.clock.seconds()


def save(t: Training, tag: int | str, data_state: dict | None = None) -> list[Path]:
    """The one save path: the checkpoint and outputs under `tag` (an iteration, or BEST for
    --save-best); an iteration's are then copied to their LATEST names, the LATEST checkpoint
    last, so that a write that fails (disk full) leaves every LATEST file as the previous save
    left it and chk-LATEST never points past complete outputs. Rank 0 alone writes.
    `data_state`: the batcher's state at this iteration when the batcher has moved on."""
    job, state, o = t.job, t.state, t.job.opts
    if not t.world.is_root:
        return []
    state.ranks = t.world.size
    state.data_state = data_state if data_state is not None else t.batcher.state()
    out = ckpt.iteration_path(o.checkpoint_out, tag)
    ckpt.save(out, job.kind, job.cfg.arch, o, job.params, state, job.model_kvs, job.base_fingerprint,
              job.checkpoint_extra(), t.executor.policy)
    files = [out] + job.write_outputs(str(tag))
    if tag == "BEST":
        return files
    template = job.output_size and job.output_size[0]
    if o.fn_latest and (template is None or ckpt.iteration_path(template, o.fn_latest) not in files):
        files += job.write_outputs(o.fn_latest)   # an output named without ITERATION is written once
    latest = ckpt.iteration_path(o.checkpoint_out, o.fn_latest)
    if latest != out:
        ckpt.copy_atomic(out, latest)
        files.append(latest)
    prune_saves(files, state.iteration, o.save_total_limit)     # --save-total-limit
    return files


def recomputed_loss(t: Training, batches: list) -> float:
    """The loss of the last step's batches with the current parameters (an SFT step adds
    gradients to params.grad, which no later step uses): verifies the state after the last update."""
    o, mine = t.job.opts, []
    t.job.objective.begin_step(batches)
    for micro, b in distributed.my_share(t.world, batches):     # each MPI rank its own micro-batches
        mine.append(t.job.objective.micro_loss(t.executor, b, (o.seed, t.state.iteration - 1, micro)))
    return distributed.sum_losses(t.world, mine)


def final_save(t: Training, batches: list, bad: str | None) -> None:
    """Save the end of the run if the last step's batches still give a sane loss after
    its update (no later step will verify it); else leave LATEST at the last healthy save."""
    state = t.state
    loss = float("nan") if bad else recomputed_loss(t, batches)
    if bad or not t.guard.healthy(loss):
        t.show.line(f"iteration {state.iteration} not saved: " + (bad or f"loss {loss:.4f} after the last update")
                    + "; LATEST keeps the last healthy save")
        return
    files = save(t, state.iteration)
    if files:
        t.files, t.saves.iteration = files, state.iteration
    t.show.line(saved_line(state, t.logged, files))   # the last step's loss, as logged


def evaluate(t: Training) -> bool:
    """Validation loss now: logged, kept as the best (with --save-best, its outputs too).
    Returns True when --early-stop's patience has run out."""
    state, vs = t.state, t.state.validation
    loss = t.validator.loss(t.executor)
    improved = vs.record(state.iteration, loss)
    extra = t.validator.last_metrics                   # preference pairs: eval_rewards/... (TRL's)
    t.metrics.eval(state.iteration, loss, extra)
    t.show.refresh(state)
    text = f"step {state.iteration}: val loss {loss:.4f}"
    if "eval_rewards/accuracies" in extra:
        text += f", reward accuracy {extra['eval_rewards/accuracies']:.1%}"
    if "eval_accuracy" in extra:                       # grpo: greedy completions scored
        text += f", reward {extra['eval_reward']:.3f}, accuracy {extra['eval_accuracy']:.1%}"
    text += " (best)" if improved else f" (best {vs.best_loss:.4f} at step {vs.best_step})"
    if improved and t.job.opts.save_best:
        text += " -> " + ", ".join(str(p) for p in save(t, "BEST"))
    t.show.line(text)
    if t.validator.should_stop(vs):
        t.show.line(f"early stop: {vs.since_best} evaluations without a lower val loss than {vs.best_loss:.4f} "
                    f"(step {vs.best_step})")
        return True
    return False


def write_plot(path: Path, quiet: bool) -> None:
    """The loss plot beside the metrics, when matplotlib is installed (a notice otherwise)."""
    from ..plot import plot_metrics
    try:
        out = plot_metrics(path, path.with_suffix(".png"))
    except LlamatuneError as e:
        notice(f"no loss plot: {e}")
        return
    if not quiet:
        err.print(f"loss plot: {out}")


def finish(t: Training) -> TrainResult:
    """The run's figures; the loss plot, once the graph's buffers are gone (matplotlib's
    30-40 MB: the end of a run needs no more than its steps)."""
    o, n = t.job.opts, len(t.losses)
    seconds = t.clock.seconds()
    t.executor = None
    gc.collect()
    if o.plot and t.world.is_root:
        write_plot(t.metrics.path, t.quiet)
    tokens_per_second = n * t.tokens_per_step / max(seconds, 1e-9)
    if t.world.size > 1 and not t.quiet:
        notice(distributed.summary(t.world, tokens_per_second))
    # after the first step (compilation, first page-in)
    steady = (n - 1) * t.tokens_per_step / max(seconds - t.first_seconds, 1e-9) if n > 1 else 0.0
    return TrainResult(t.state, t.losses, t.files, seconds, tokens_per_second, steady)
