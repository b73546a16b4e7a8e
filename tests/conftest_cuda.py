"""Helpers for the CUDA kernel tests: find out, without importing numba.cuda,
whether a usable NVIDIA GPU is present, and switch numba to its CUDA simulator
when it is not (NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first
imported)."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys


def gpu_present() -> bool:
    """True when the CUDA driver loads and reports at least one device.

    Uses the driver API through ctypes (cuInit + cuDeviceGetCount), so nothing of
    numba.cuda is imported; CUDA_VISIBLE_DEVICES is honoured by the driver."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return False
    try:
        if lib.cuInit(0) != 0:
            return False
        count = ctypes.c_int(0)
        return lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    except (AttributeError, OSError):
        return False


def enable_simulator_if_no_gpu() -> str:
    """Set NUMBA_ENABLE_CUDASIM=1 unless a GPU is present or the variable is set.

    Returns what happened ("set", "kept" or "gpu"); "too late" when numba.cuda
    was already imported in real-GPU mode (the simulator can then not be
    enabled in this process)."""
    if "NUMBA_ENABLE_CUDASIM" in os.environ:
        return "kept"
    if gpu_present():
        return "gpu"
    if "numba.cuda" in sys.modules:
        return "too late"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    cfg = sys.modules.get("numba.core.config")
    if cfg is not None and importlib.util.find_spec("numba_cuda") is None:
        # numba imported already and no numba-cuda: numba's deprecated built-in
        # numba.cuda reads numba's own (already loaded) config
        cfg.reload_config()
    return "set"


def cuda_or_skip():
    """numba.cuda, with the simulator enabled where no GPU is; a module-level skip of the
    calling test module where numba-cuda does not import or has nothing to run on."""
    import pytest
    state = enable_simulator_if_no_gpu()
    try:
        from numba import cuda
    except ImportError as e:  # numba-cuda missing, or its CUDA bindings
        pytest.skip(f"numba.cuda is not importable ({e}); install llamatune[cuda] or numba-cuda",
                    allow_module_level=True)
    if not cuda.is_available():
        pytest.skip(f"no CUDA GPU and the CUDA simulator is not enabled (setup: {state}); "
                    "run with NUMBA_ENABLE_CUDASIM=1", allow_module_level=True)
    return cuda


def make_simulator_shared_arrays_thread_safe() -> None:
    """Make numba-cuda's simulated `cuda.shared.array` safe under thread switches.

    The simulator runs each thread of a block as a Python thread; the first one
    to reach a `cuda.shared.array(...)` line creates the block's array, the others
    look it up by (file, line). Its lookup and its store are two steps, so a thread
    switch between them (rare with the default 5 ms GIL switch interval, frequent
    with the 50 us the tests use) gives two threads two different arrays of
    uninitialized memory, and a kernel that is correct on a GPU reads garbage.
    dict.setdefault stores at most once; sys._getframe replaces the simulator's
    traceback.extract_stack, which read source lines on every call."""
    import numpy as np
    from numba.core import types
    from numba.np import numpy_support
    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's error
            return original(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        res = self._allocations.get(key)
        if res is None:
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            res = self._allocations.setdefault(key, np.empty(shape, dtype))
        return res

    kernelapi.FakeCUDAShared.array = array


def make_simulator_refuse_none_arguments() -> None:
    """Make a simulated kernel launch refuse a None argument, as a GPU's does.

    numba-cuda compiles a kernel for a None argument (type `none`), and the simulator
    runs it, but the real launcher cannot pass one (`NotImplementedError: (none, None)`
    in `_Kernel._prepare_args`, seen on an H200 with numba-cuda 0.30.4): without this,
    such a kernel passes every simulated test and fails on its first GPU launch.
    Device-function calls inside a kernel may still pass None."""
    from numba.cuda.simulator import kernel as simulated

    launch = simulated.FakeCUDAKernel.__call__

    def __call__(self, *args):
        if not (self._device or simulated._kernel_context):
            bad = [i for i, a in enumerate(args) if a is None]
            if bad:
                raise NotImplementedError(f"{self.__name__}: argument {bad[0]} is None; a GPU "
                                          "kernel launch cannot pass None")
        return launch(self, *args)

    simulated.FakeCUDAKernel.__call__ = __call__


def compile_all_ptx(cc=(8, 0)) -> dict:
    """Compile every CUDA kernel of llamatune.kernels.cuda to PTX for compute
    capability cc, through the real (not simulated) numba-cuda pipeline, without
    needing a GPU: only NVVM + libdevice and NVRTC (the CUDA toolkit, or the
    nvidia-cuda-nvcc-cu12 / nvidia-cuda-nvrtc-cu12 wheels behind CUDA_HOME).

    Returns {kernel name: PTX text}. Must run in a process where numba.cuda is
    imported with the simulator off (the tests call it in a subprocess)."""
    from gguf import GGMLQuantizationType as T
    import llamatune.kernels.cuda  # noqa: F401  (first: its NumPy 2.5 alias for numba-cuda)
    from numba import types as t
    from numba.cuda import compile_ptx
    import numba.cuda.dispatcher as dispatcher

    class _Dev:  # device functions ask the current device for its compute capability
        compute_capability = cc

    dispatcher.get_current_device = lambda: _Dev()

    from llamatune.kernels.cuda import (_common, attention, bf16, cross_entropy, dequant, fused, geglu, optim,
                                        rmsnorm, rope, softcap, swiglu)
    assert not _common.SIM, "compile_all_ptx needs numba.cuda without the simulator"
    f32, f64, i64, u8, u16, b1 = t.float32, t.float64, t.int64, t.uint8, t.uint16, t.boolean

    def A(dt, nd, layout="C"):
        return t.Array(dt, nd, layout)

    jobs = []
    for q in sorted(dequant.CUDA_TYPES):
        plain, gather = dequant._kernels(q)
        jobs.append((f"dequant {T(q).name}", plain, (A(u8, 2), A(f32, 2))))
        jobs.append((f"dequant gather {T(q).name}", gather, (A(u8, 2), A(i64, 1), A(f32, 2))))
        plain, gather = dequant._kernels(q, bf16=True)
        jobs.append((f"dequant bf16 {T(q).name}", plain, (A(u8, 2), A(u16, 2))))
        jobs.append((f"dequant bf16 gather {T(q).name}", gather, (A(u8, 2), A(i64, 1), A(u16, 2))))
    jobs += [
        ("rmsnorm forward", rmsnorm._rmsnorm_forward_kernel,
         (A(f32, 2), A(f32, 1), A(f32, 2), A(f32, 1), f32)),
        ("rmsnorm dx", rmsnorm._rmsnorm_dx_kernel,
         (A(f32, 2), A(f32, 2), A(f32, 2), A(f32, 1), A(f32, 1))),
        ("rmsnorm dw", rmsnorm._rmsnorm_dw_kernel, (A(f32, 1), A(f32, 2), A(f32, 2), A(f32, 1))),
        ("rope", rope._rope_kernel, (A(f32, 4), A(f32, 4), A(f32, 3), A(f32, 3), i64, b1, b1)),
        ("swiglu forward", swiglu._swiglu_forward_kernel, (A(f32, 2),) * 3),
        ("swiglu backward", swiglu._swiglu_backward_kernel, (A(f32, 2),) * 5),
        ("geglu forward", geglu._geglu_forward_kernel, (A(f32, 2),) * 3),
        ("geglu backward", geglu._geglu_backward_kernel, (A(f32, 2),) * 5),
        ("softcap forward", softcap._softcap_forward_kernel, (A(f32, 1),) * 2 + (f32, f32)),
        ("softcap backward", softcap._softcap_backward_kernel, (A(f32, 1),) * 3 + (f32,)),
        ("cross_entropy forward", cross_entropy._ce_forward_kernel,
         (A(f32, 1), A(f32, 2), A(i64, 1))),
        ("cross_entropy backward", cross_entropy._ce_backward_kernel,
         (A(f32, 2), A(f32, 2), A(i64, 1), A(f32, 1))),
        ("cross_entropy forward+backward", cross_entropy._ce_forward_backward_kernel,
         (A(f32, 1), A(f32, 2), A(f32, 2), A(i64, 1), A(f32, 1))),
        ("adamw", optim._adamw_kernel, (A(f32, 1),) * 4 + (f64,) * 7),
        ("sgd", optim._sgd_kernel, (A(f32, 1),) * 2 + (f64,) * 2),
        ("norm partial", optim._norm_partial_kernel, (A(f64, 1), A(f32, 1))),
        ("norm final", optim._norm_final_kernel, (A(f64, 1), i64, b1)),
        ("scale", optim._scale_kernel, (A(f32, 1), f32)),
        ("clip", optim._clip_kernel, (A(f32, 1), A(f64, 1), f64)),
    ]
    jobs += [
        ("fused rope q k", fused._rope_qk_kernel, (A(f32, 4), A(f32, 4), A(f32, 3), A(f32, 3), i64, b1, b1)),
        ("fused q k norm rope", fused._qk_norm_rope_kernel,
         (A(f32, 4), A(f32, 1), A(f32, 4), A(f32, 1)) * 2 + (A(f32, 3), A(f32, 3), f32, i64, b1)),
        ("fused q k norm rope dx", fused._qk_norm_rope_dx_kernel,
         (A(f32, 4), A(f32, 4), A(f32, 4), A(f32, 1), A(f32, 1)) * 2 + (A(f32, 3), A(f32, 3), i64, b1)),
        ("fused q k norm dw", fused._qk_norm_dw_kernel, (A(f32, 1),) * 2 + (A(f32, 2), A(f32, 2), A(f32, 1)) * 2),
        ("fused add rmsnorm", fused._add_rmsnorm_kernel, (A(f32, 2), A(f32, 1), A(f32, 2), A(f32, 2), A(f32, 1), f32)),
        ("fused rmsnorm dx add", fused._rmsnorm_dx_add_kernel,
         (A(f32, 2), A(f32, 2), A(f32, 2), A(f32, 1), A(f32, 1))),
    ]
    i32 = t.int32
    opts = (f32, f32, f32, i64)  # scale, softcap, scale / softcap, window
    for packed in (False, True):
        for capped in (False, True):
            tag = " segments" * packed + " capped" * capped
            jobs += [
                (f"attention softmax{tag}", attention._softmax_kernel(packed, capped),
                 (A(f32, 3), A(f32, 3), A(i32, 2), i64, i64, i64) + opts),
                (f"attention softmax backward{tag}", attention._softmax_backward_kernel(packed, capped),
                 (A(f32, 3), A(f32, 3), A(f32, 3), A(f32, 3), A(i32, 2), i64, i64) + opts),
            ]
    jobs.append(("attention starts", attention._starts_kernel, (A(i32, 2), A(i32, 2))))
    jobs.append(("bf16 rounding", bf16._to_bf16_kernel, (A(u16, 2), A(f32, 2, "A"))))
    return {name: compile_ptx(k.py_func, sig, cc=cc)[0] for name, k, sig in jobs}
