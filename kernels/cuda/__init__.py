"""CUDA kernels (numba.cuda) for every op of the CPU path: dequantization,
rmsnorm, rope, swiglu, geglu, softcap, attention, cross-entropy and the optimizer
updates.

One module per op family, named as its CPU twin in ``llamatune.kernels``:
``dequant``, ``rmsnorm``, ``rope``, ``swiglu``, ``geglu``, ``softcap``,
``attention``, ``cross_entropy``, ``optim``, and ``fused`` (chains of them in one
launch), ``lora`` (the adapter's products through cuBLAS), ``blas`` (cublasGemmEx, float32
or bf16 operands) and ``bf16`` (the base's bf16 products on tensor cores). Each takes float32 device arrays (numba DeviceNDArray, CuPy arrays or
anything exporting ``__cuda_array_interface__``; numpy host arrays are refused),
never allocates, and is checked against the numpy references of its CPU twin.

Importing this package imports nothing from numba.cuda and compiles nothing;
the submodules are loaded on first attribute access (``llamatune.kernels.cuda.rmsnorm``),
and they import numba.cuda. Kernels compile on their first launch.

On a machine without a GPU the kernels run under numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, which must be set before numba.cuda is first
imported). That needs no CUDA toolkit or driver, only numba.cuda itself: the
``numba-cuda`` package (numba's own built-in numba.cuda is deprecated in its
favour, though numba 0.68's still runs these kernels in the simulator).
"""
from __future__ import annotations

import importlib
import os
import sys

_MODULES = ("dequant", "rmsnorm", "rope", "swiglu", "geglu", "softcap", "attention",
            "cross_entropy", "optim", "fused", "lora", "blas", "bf16")

__all__ = [*_MODULES, "is_available", "simulator_enabled", "numpy_compat", "launch_without_sync"]


def numpy_compat() -> None:
    """Let numba-cuda 0.30 compile kernels under NumPy 2.5.

    NumPy 2.5 removed ``numpy.row_stack`` (an alias of ``vstack`` deprecated since
    2.0); numba-cuda 0.30.4 still registers an overload for it when its CUDA
    lowering first loads (at the first kernel compile), and fails with
    ``AttributeError: module 'numpy' has no attribute 'row_stack'``. Restoring the
    alias is what NumPy itself shipped until 2.4; nothing else changes. Runs when
    the first kernel module loads (``_common.py``, before it imports numba.cuda),
    not when this package is imported."""
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def launch_without_sync() -> None:
    """Launch the kernels on CuPy arrays without first waiting for the GPU.

    A CuPy array's ``__cuda_array_interface__`` names the stream its data was
    written on, and numba-cuda by default synchronizes that stream before a launch
    that takes the array (``NUMBA_CUDA_ARRAY_INTERFACE_SYNC=1``): every kernel
    launch then waited for all queued GPU work, so the GPU idled while Python
    prepared the next launch. CuPy's products and these kernels all go to the
    default stream, which runs its work in order, so the wait guards nothing
    here. Sets the variable (for any later reload of numba's config) and the
    loaded config. Imports numba.cuda."""
    os.environ["NUMBA_CUDA_ARRAY_INTERFACE_SYNC"] = "0"
    try:
        from numba.cuda.core import config
    except ImportError:
        from numba.core import config
    config.CUDA_ARRAY_INTERFACE_SYNC = False


def is_available() -> bool:
    """True when numba.cuda imports and has a GPU (or the simulator) to run on.
    Imports numba.cuda (so decide NUMBA_ENABLE_CUDASIM before calling this)."""
    try:
        from numba import cuda
    except Exception:  # numba-cuda missing or broken CUDA bindings
        return False
    try:
        return bool(cuda.is_available())
    except Exception:
        return False


def simulator_enabled() -> bool:
    """True when numba.cuda runs (or, not imported yet, will run) as the CUDA simulator."""
    if "numba.cuda" not in sys.modules:
        return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    try:
        from numba.cuda.core import config
    except ImportError:
        from numba.core import config
    return bool(config.ENABLE_CUDASIM)
