"""Learning-rate schedule and the optimizer step over the flat ParamBuffer.

Schedule (llama.cpp common/train.cpp learning_schedule): linear warmup from 0 to 1
over `warmup` steps, then cosine decay from 1 to `cos_decay_min` over
`cos_decay_steps` (with restarts, each `cos_decay_restart` times longer). The
learning rate is `min_alpha + sched * (alpha - min_alpha)`.

Step: the global gradient norm (`gradient_norm`, computed once: the trainer's
divergence guard looks at it before anything changes), then `apply_update`:
optional global-norm clipping of the gradient, then AdamW (decoupled weight decay,
bias-corrected moments) or SGD, per tensor; weight decay applies only to tensors
with at least `decay_min_ndim` dimensions.

The options keep llama.cpp's names (--adam-iter, --adam-alpha, ...: the command line,
presets and the options a checkpoint records), though they drive SGD too;
`Settings.of` reads them once, under the names of what they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backend import cpu
from ..options import TrainOptions, schedule_steps
from .params import ParamBuffer


@dataclass(frozen=True)
class Settings:
    """The optimizer's settings, read from the options' llama.cpp names."""
    kind: str                   # "adamw" or "sgd" (--optimizer)
    steps: int                  # optimizer steps of the whole run (--adam-iter)
    learning_rate: float        # the peak (--adam-alpha)
    min_learning_rate: float    # the floor, warmup included (--adam-min-alpha)
    beta1: float                # AdamW's moment decays and epsilon (--adam-beta1, --adam-beta2, --adam-eps)
    beta2: float
    eps: float
    weight_decay: float         # decoupled, AdamW and SGD (--adam-decay)
    decay_min_ndim: int         # tensors with fewer dimensions get no decay (--adam-decay-min-ndim)
    grad_clip: float            # the global gradient norm's bound, 0: off (--adam-gclip)

    @classmethod
    def of(cls, o: TrainOptions) -> "Settings":
        return cls(o.optimizer, o.adam_iter, o.adam_alpha, o.adam_min_alpha, o.adam_beta1, o.adam_beta2, o.adam_eps,
                   o.adam_decay, o.adam_decay_min_ndim, o.adam_gclip)


def cosine_decay(step: int, decay_steps: int, minimum: float) -> float:
    step = min(step, decay_steps)
    return minimum + (1.0 - minimum) * 0.5 * (1.0 + math.cos(math.pi * step / decay_steps))


def cosine_decay_restart(step: int, decay_steps: int, minimum: float, mult: float) -> float:
    while step > decay_steps:
        step -= decay_steps
        decay_steps = int(math.ceil(decay_steps * mult))
    return cosine_decay(step, decay_steps, minimum)


def schedule(step: int, o: TrainOptions) -> float:
    """Multiplier in [0, 1] for optimizer step `step` (0-based); warmup and decay lengths
    as options.schedule_steps fits them to the run."""
    warmup, decay, _ = schedule_steps(o)
    if step < warmup:
        return (step + 1) / warmup
    if decay <= 0:
        return 1.0
    s = step - warmup
    if o.enable_restart:
        return cosine_decay_restart(s, decay, o.cos_decay_min, o.cos_decay_restart)
    return cosine_decay(s, decay, o.cos_decay_min)


def learning_rate(step: int, o: TrainOptions) -> float:
    s = Settings.of(o)
    return s.min_learning_rate + schedule(step, o) * (s.learning_rate - s.min_learning_rate)


def gradient_norm(params: ParamBuffer) -> float:
    """Global L2 norm of the whole gradient (computed once per step: the trainer checks
    it before the update, which then clips with it)."""
    backend = getattr(params, "backend", None) or cpu()
    return math.sqrt(backend.global_norm_sq(params.grad))


def clip_gradients(params: ParamBuffer, max_norm: float, norm: float) -> None:
    """Scale the whole gradient, whose global L2 norm is `norm`, so its norm is at most max_norm."""
    backend = getattr(params, "backend", None) or cpu()
    if max_norm > 0 and norm > max_norm:
        backend.ops.optim.scale_inplace(params.grad, np.float32(max_norm / (norm + 1e-6)))


def decay_segments(params: ParamBuffer, s: Settings) -> list[tuple[int, int, float]]:
    """(lo, hi, weight decay) runs of consecutive tensors that share a weight decay,
    so the update is one kernel call per run (one in all for LoRA: every A and B is 2-D)."""
    runs: list[tuple[int, int, float]] = []
    for spec, lo, hi in params.slices():
        wd = s.weight_decay if len(spec.shape) >= s.decay_min_ndim else 0.0
        if runs and runs[-1][2] == wd and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi, wd)
        else:
            runs.append((lo, hi, wd))
    return runs


def apply_update(params: ParamBuffer, step: int, o: TrainOptions, gnorm: float) -> float:
    """Clip (with the already computed gradient norm) and apply the update for optimizer
    step `step` (0-based). Returns the learning rate used."""
    lr, s = learning_rate(step, o), Settings.of(o)
    optim = (getattr(params, "backend", None) or cpu()).ops.optim
    clip_gradients(params, s.grad_clip, gnorm)
    for lo, hi, wd in decay_segments(params, s):
        p, g = params.data[lo:hi], params.grad[lo:hi]
        if s.kind == "sgd":
            optim.sgd_update(p, g, lr, wd)
        else:
            update = optim.adamw_update_bf16 if params.m.dtype == np.uint16 else optim.adamw_update
            update(p, g, params.m[lo:hi], params.v[lo:hi], lr, s.beta1, s.beta2, s.eps, wd, step + 1)
    return lr


def optimizer_step(params: ParamBuffer, step: int, o: TrainOptions) -> tuple[float, float]:
    """Norm, clip and update in one call (for callers without a divergence guard). Returns (lr, grad_norm)."""
    gnorm = gradient_norm(params)
    return apply_update(params, step, o, gnorm), gnorm
