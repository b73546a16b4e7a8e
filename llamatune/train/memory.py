"""How much memory a training run needs, and which --checkpointing mode fits.

The estimate adds up, for a (batch, ctx, mode):
  - runtime: what the process holds before the step buffers exist, measured rather
    than guessed: resident memory (/proc/self/smaps) after the kernels are compiled or
    loaded from numba's disk cache, with every parameter/gradient/moment page touched;
    it covers the interpreter, numpy/numba/OpenBLAS, the tokenizer, the data and the
    ParamBuffer. The base model's file pages are left out here and counted below.
  - model: the memory-mapped base model, counted in full (every page is read each step).
  - scratch: the dequantization scratch (model.Dequantizer.size floats).
  - graph: every buffer the training graph allocates, from `buffers.step_plan`, the
    same plan the graph allocates from (and the bf16 copies and kept head it plans).
  - temporaries: arrays numpy creates inside a step (dropout masks and the inputs
    they multiply; attention's working buffers, `attention_bytes`).
On a GPU (`Planner(device=True)`) the same sum is of GPU memory: runtime is what
CuPy's pool holds when training starts (the parameters, gradients and moments, the
norm vectors), model the base model's bytes (uploaded in their stored form), and
the temporaries add the attention's working buffers (kernels/cuda/attention.py
`scratch_floats`); what is free is the GPU's free memory plus what CuPy's pool holds
unused (`free_memory`). The CUDA context and cuBLAS's workspace are outside both.
`auto` picks the fastest mode whose estimate fits; a run that fits in no mode is
refused with what would fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..precision import F32, ComputePolicy
from .buffers import StepPlan, step_plan
from .parts import DeltaNetBackward

FASTEST_FIRST = ("none", "selective", "layer")   # --checkpointing auto tries these in order


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _proc_bytes(path: str, key: str) -> int | None:
    """A `key: N kB` line of a /proc file, in bytes; None where it cannot be read."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    return _proc_bytes("/proc/meminfo", "MemAvailable")


def free_memory(backend) -> int | None:
    """Memory a run can still take where its buffers live: the host's available memory
    for the CPU; on a GPU its free memory (cudaMemGetInfo) plus the bytes CuPy's pool
    holds unused; None for the CUDA simulator (its device arrays are host arrays of a
    test-sized model)."""
    if backend.name == "cpu":
        return available_memory()
    if not backend.gpu:
        return None
    free, _ = backend.xp.cuda.runtime.memGetInfo()
    return int(free) + int(backend.xp.get_default_memory_pool().free_bytes())


def device_runtime_bytes(backend) -> int:
    """GPU memory this process's arrays hold now (CuPy's pool, in use)."""
    return int(backend.xp.get_default_memory_pool().used_bytes())


def resident_bytes(exclude: Path | None = None) -> tuple[int, int]:
    """(resident bytes of this process, of which in mappings of file `exclude`), from
    /proc/self/smaps; (0, 0) where it cannot be read."""
    total = excluded = 0
    target = str(Path(exclude).resolve()) if exclude is not None else None
    mapping = ""
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line.startswith("Rss:"):
                    kb = int(line.split()[1]) * 1024
                    total += kb
                    if mapping == target:
                        excluded += kb
                elif not line[0].isupper():                       # a mapping's header line
                    parts = line.split(None, 5)
                    mapping = parts[5].strip() if len(parts) == 6 else ""
    except OSError:
        return 0, 0
    return total, excluded


def peak_resident_bytes() -> int:
    """Peak resident bytes of this process so far (VmHWM)."""
    return _proc_bytes("/proc/self/status", "VmHWM") or 0


def touch(a: np.ndarray) -> None:
    """Make every page of a host array resident (zero pages are not until written)."""
    if isinstance(a, np.ndarray) and a.size:
        every_page = a.reshape(-1)[:: max(1, 4096 // a.itemsize)]
        every_page[...] = every_page.copy()                       # same bits, written


@dataclass
class Estimate:
    mode: str
    runtime: int            # measured: interpreter, libraries, kernels, tokenizer, data, parameters
    model: int              # memory-mapped base model, in full
    scratch: int            # dequantization scratch
    graph: int              # buffers.step_plan's buffers
    temporaries: int        # numpy temporaries inside a step
    device: bool = False    # GPU memory (Planner(device=True))

    @property
    def total(self) -> int:
        return self.runtime + self.model + self.scratch + self.graph + self.temporaries

    @property
    def added(self) -> int:
        """What training adds to the process as measured (runtime is already resident)."""
        return self.total - self.runtime

    def describe(self) -> str:
        if self.device:
            return (f"{gib(self.total)} of GPU memory with --checkpointing {self.mode} (activations and scratch "
                    f"{gib(self.graph)}, attention and temporaries {gib(self.temporaries)}, base model "
                    f"{gib(self.model)}, dequantization {gib(self.scratch)}, parameters and state "
                    f"{gib(self.runtime)})")
        return (f"{gib(self.total)} with --checkpointing {self.mode} (activations and scratch {gib(self.graph)}, "
                f"base model {gib(self.model)} mapped, dequantization {gib(self.scratch)}, "
                f"runtime {gib(self.runtime)} measured)")


def temporaries_bytes(cfg, B: int, T: int, dropout: float, device: bool = False) -> int:
    """Dropout's mask, its random draw and the masked input, alive together in a step;
    the numpy scratch of a delta-net layer's backward (train.parts.DeltaNetBackward),
    where the model has such layers; on a GPU also the attention's working buffers."""
    n = 3 * 4 * B * T * max(cfg.n_embd, cfg.n_ff, cfg.n_embd_q) if dropout > 0 else 0
    if any(cfg.is_recurrent(i) for i in range(cfg.n_layer)):
        n += 4 * DeltaNetBackward.scratch_floats(cfg, B, T)
    if device:
        from ..kernels.cuda.attention import scratch_floats
        n += 4 * scratch_floats(B, T, cfg.n_head, cfg.n_head_kv, cfg.head_dim)
    return n


class Planner:
    """Estimates for one job at any (batch, ctx, mode); `runtime` measured once."""

    def __init__(self, cfg, targets, weights, runtime: int, model_bytes: int, scratch_bytes: int, dropout: float,
                 device: bool = False, policy: ComputePolicy = F32):
        self.cfg, self.targets, self.weights, self.policy = cfg, targets, weights, policy
        self.runtime, self.model_bytes, self.scratch_bytes, self.dropout = runtime, model_bytes, scratch_bytes, dropout
        self.device = device

    def estimate(self, B: int, T: int, mode: str) -> Estimate:
        plan = step_plan(self.cfg, self.targets, B, T, mode, self.weights.head_rows, self.weights.trainable,
                         self.policy, self.device, self.dropout)
        temporaries = (temporaries_bytes(self.cfg, B, T, self.dropout, self.device) + plan.bf16_copies
                       + self.attention_bytes(B, T))
        return Estimate(mode, self.runtime, self.model_bytes, self.dequantization_bytes(plan), plan.buffer_bytes,
                        temporaries, self.device)

    def attention_bytes(self, B: int, T: int) -> int:
        """On the CPU, the working buffers attention's workers allocate in a step (each
        worker its own, for the largest tile; the kernels the policy picks:
        kernels/attention.py or attention_bf16.py `scratch_bytes`); on a GPU they are in
        `temporaries_bytes`. Freed after each call, they stay in the process (the workers'
        malloc arenas keep them), so they count at the peak. 0 without attention layers."""
        cfg = self.cfg
        if self.device or all(cfg.is_recurrent(i) for i in range(cfg.n_layer)):
            return 0
        from ..kernels import attention
        kernels = self.policy.attention(attention)
        return kernels.scratch_bytes(B, T, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.attn_softcap)

    def dequantization_bytes(self, plan: StepPlan) -> int:
        """The dequantization scratch: float32, or with bf16 products the weights dequantized
        straight to bf16 (with the adapters' extension on the CPU), and the head kept whole."""
        scratch = self.scratch_bytes
        if scratch and self.policy.dtype == "bf16" and self.device:
            scratch = self.weights.model.dequantizer.nbytes_bf16
        if self.policy.host_bf16:
            if scratch:
                scratch = self.weights.model.dequantizer.nbytes_bf16_extended(plan.extension)
            scratch += plan.kept_head
        return scratch

    def choose(self, B: int, T: int, mode: str, available: int | None) -> Estimate:
        """The estimate of `mode`, or for auto of the fastest mode that fits `available`
        (the least memory one when none does)."""
        if mode != "auto":
            return self.estimate(B, T, mode)
        options = [self.estimate(B, T, m) for m in FASTEST_FIRST]
        if available is None:
            return options[1]
        return next((e for e in options if e.added <= available), options[-1])

    def what_fits(self, B: int, T: int, mode: str, available: int) -> str:
        """Alternatives that fit, for the refusal message."""
        hints = []
        if mode != "layer" and self.estimate(B, T, "layer").added <= available:
            hints.append(f"--checkpointing layer ({gib(self.estimate(B, T, 'layer').total)})")
        m = "layer" if mode == "auto" else mode
        ctx = T // 2
        while ctx >= 2 and self.estimate(B, ctx, m).added > available:
            ctx //= 2
        if ctx >= 2:
            hints.append(f"--ctx {ctx}" + (" --checkpointing layer" if m != mode else ""))
        b = B - 1
        while b >= 1 and self.estimate(b, T, m).added > available:
            b -= 1
        if b >= 1:
            hints.append(f"--batch {b}" + (" --checkpointing layer" if m != mode else ""))
        return "would fit: " + ", or ".join(hints) if hints else "nothing smaller fits either"


def measure_runtime(params, model_path: Path | None) -> int:
    """Resident bytes now, with every page of the parameters, gradients and moments
    resident and without the base model's file pages."""
    for a in (params.data, params.grad, params.m, params.v):
        if a is not None:                                       # no moments: SGD
            touch(a)
    total, model = resident_bytes(model_path)
    return total - model
