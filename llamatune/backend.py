"""Device dispatch: the one place that decides where arrays live and which kernels run.

    cpu    numpy arrays; numba CPU kernels (llamatune.kernels); matmuls through numpy's BLAS.
    cuda   CuPy arrays (matmuls through cuBLAS); numba-cuda kernels (llamatune.kernels.cuda).
           Quantized base weights are uploaded once in their quantized form and
           dequantized per matmul into a device scratch buffer (weights.FrozenBase).
    cuda, simulated   with NUMBA_ENABLE_CUDASIM=1 and no GPU: numpy arrays serve as
           device memory and the numba-cuda kernels run in numba's simulator, each
           array handed over as a simulator device array sharing its memory (the
           simulator would otherwise copy numpy arguments in and back out, which
           loses in-place results). Slow; it exists so the CUDA path is tested end
           to end on machines without a GPU.

Nothing CUDA is imported unless a CUDA backend is asked for, and the package runs
without any CUDA library installed (`pip install llamatune[cuda]` adds them).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from .errors import LlamatuneError

OPS = ("dequant", "rmsnorm", "rope", "attention", "swiglu", "geglu", "softcap", "cross_entropy",
       "optim", "fused", "lora", "bf16")


@dataclass(frozen=True)
class Backend:
    name: str               # "cpu" or "cuda"
    xp: Any                 # numpy or cupy: array creation and math, matmuls
    ops: SimpleNamespace    # kernel modules with the same API on every backend
    simulated: bool = False

    @property
    def gpu(self) -> bool:
        """Arrays live in a real GPU's memory (cuda, not the simulator)."""
        return self.name == "cuda" and not self.simulated

    @property
    def capability(self) -> tuple[int, int] | None:
        """The GPU's compute capability (major, minor); None on the CPU and the simulator."""
        if not self.gpu:
            return None
        cc = str(self.xp.cuda.Device().compute_capability)          # CuPy: "90" for 9.0
        return int(cc[:-1]), int(cc[-1])

    @property
    def on_host(self) -> bool:
        """Arrays are numpy arrays (cpu, or the CUDA simulator)."""
        return self.xp is np

    def to_device(self, a: np.ndarray):
        return np.ascontiguousarray(a) if self.on_host else self.xp.asarray(np.ascontiguousarray(a))

    def to_host(self, a) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else self.xp.asnumpy(a)

    def scatter_add(self, dst, rows, src) -> None:
        """dst[rows[i]] += src[i] with repeated rows summed."""
        if self.on_host:
            np.add.at(dst, rows, src)
        else:
            import cupyx
            cupyx.scatter_add(dst, rows, src)

    def global_norm_sq(self, g) -> float:
        """Sum of squares of a flat gradient, in float64."""
        if self.name == "cpu":
            return float(self.ops.optim.global_norm_sq(g))
        buf = self.xp.zeros(self.ops.optim.NORM_BUF, np.float64)
        self.ops.optim.global_norm_sq(buf, g)
        return float(self.to_host(buf)[0])


def _cpu() -> Backend:
    import importlib

    from . import kernels  # noqa: F401
    ops = SimpleNamespace(**{n: importlib.import_module(f"llamatune.kernels.{n}") for n in OPS})
    return Backend("cpu", np, ops)


def set_tf32(xp, on: bool) -> None:
    """cuBLAS float32 matmuls of CuPy (`xp`) in TF32 on tensor cores, or exact float32
    (CuPy's COMPUTE_TYPE_DEFAULT), from now on in this process. What the CUPY_TF32=1
    variable does, except that CuPy reads that only at its first matmul. Nothing on
    numpy (the CPU and the simulator)."""
    if xp is np:
        return
    from cupy._core import _routines_linalg as linalg
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if on else linalg.COMPUTE_TYPE_DEFAULT)


def _cuda() -> Backend:
    from .kernels import cuda as kc
    simulated = kc.simulator_enabled()
    if not kc.is_available():
        raise LlamatuneError("--device cuda: no CUDA GPU is visible (or numba-cuda is not installed: "
                             "pip install 'llamatune[cuda]')")
    if simulated:
        ops = SimpleNamespace(**{n: _SharedMemoryOps(getattr(kc, n)) for n in OPS})
        return Backend("cuda", np, ops, simulated=True)
    ops = SimpleNamespace(**{n: getattr(kc, n) for n in OPS})
    try:
        import cupy
    except ImportError:
        raise LlamatuneError("--device cuda needs CuPy for cuBLAS matmuls: pip install 'llamatune[cuda]'") from None
    from numba import cuda
    select_gpu(cuda, cupy)
    kc.launch_without_sync()
    return Backend("cuda", cupy, ops)


def select_gpu(cuda, cupy, environ=os.environ) -> int | None:
    """Under an MPI launcher with several ranks on this machine, make this rank's GPU
    the one of index (local rank mod visible GPUs), for numba-cuda and CuPy alike
    (one GPU per local rank, as Horovod and PyTorch DDP place them); before any CUDA
    context exists. Returns the index chosen, or None (one rank: the default GPU)."""
    from .launcher import local_rank, local_ranks
    if local_ranks(environ) <= 1:
        return None
    i = local_rank(environ) % max(1, len(cuda.gpus))
    cuda.select_device(i)
    cupy.cuda.Device(i).use()
    return i


class _SharedMemoryOps:
    """A kernel module whose functions get numpy arguments as simulator device
    arrays over the same memory (simulator only)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str):
        attr = getattr(self._module, name)
        if not callable(attr):
            return attr
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        def share(a):
            return FakeCUDAArray(a) if isinstance(a, np.ndarray) and a.ndim > 0 else a

        def call(*args, **kwargs):
            return attr(*map(share, args), **{k: share(v) for k, v in kwargs.items()})
        return call


def cuda_visible() -> bool:
    """A real GPU is present (never true for the simulator). Imports numba.cuda."""
    from .kernels import cuda as kc
    return not kc.simulator_enabled() and kc.is_available()


def get_backend(device: str = "cpu", tf32: bool = False) -> Backend:
    """cpu, cuda, or auto (cuda when a real GPU is visible and CuPy is installed).
    tf32: the GPU's float32 matmuls on tensor cores (set_tf32; nothing on the CPU)."""
    if device == "cpu":
        return cpu()
    if device == "cuda":
        backend = _cuda()
    elif device == "auto":
        backend = cpu()
        try:
            import cupy  # noqa: F401
            if cuda_visible():
                backend = _cuda()
        except Exception:
            pass
    else:
        raise LlamatuneError(f"--device {device!r}: choose cpu, cuda or auto")
    set_tf32(backend.xp, tf32)
    return backend


@functools.cache
def cpu() -> Backend:
    """The CPU backend (the default everywhere)."""
    return _cpu()
