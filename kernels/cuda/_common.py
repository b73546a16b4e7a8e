"""Shared pieces of the CUDA kernels: the numba.cuda import, the simulator switch,
bit-exact float helpers, block reductions and the device-array argument checks.

Imported only by the kernel modules of this package (never at import time of
``llamatune.kernels.cuda``), so numba.cuda is imported when the CUDA backend
first asks for a kernel module.

Simulator vs device. Under ``NUMBA_ENABLE_CUDASIM=1`` every CUDA thread runs the
kernel's Python code with numpy scalars, so a few helpers need two versions:

* ``fmul(a, b)``: a float32 product that the compiler may never fuse with a
  following add into an FMA. NVVM contracts ``a*b + c`` into ``fma`` by default
  (``-fmad=true``; numba-cuda passes no ``fma`` option unless ``fastmath``),
  which would break bit-exactness of e.g. ``d*q + m``. ``__nv_fmul_rn`` lowers to
  ``mul.rn.f32``, which ptxas never contracts. In the simulator it is the plain
  numpy float32 product (one rounding).
* ``bits_to_f32(bits)``: reinterpret the low 32 bits of an integer as float32
  (``__nv_int_as_float`` on the device, ``numpy.uint32.view`` in the simulator), and
  ``f32_to_bits(x)`` the other way (as a non-negative int64); ``bf16_bits(x)`` rounds
  through it.
"""
from __future__ import annotations

import sys

import numpy as np

from . import numpy_compat

numpy_compat()                             # NumPy 2.5's missing alias, before numba.cuda loads
from numba import cuda, float32, float64  # noqa: E402


def _simulated() -> bool:
    try:  # numba-cuda keeps its own config module
        from numba.cuda.core import config
    except ImportError:  # the built-in numba.cuda of older numba releases
        from numba.core import config
    return bool(config.ENABLE_CUDASIM)


SIM = _simulated()
"""True when numba.cuda is the simulator (kernels run as Python threads)."""

MAX_THREADS = 256
"""Largest thread block of the row kernels (the size of their shared reduction buffers)."""

if SIM:
    @cuda.jit(device=True)
    def fmul(a, b):
        return np.float32(a) * np.float32(b)

    @cuda.jit(device=True)
    def bits_to_f32(bits):
        return np.uint32(bits & 0xFFFFFFFF).view(np.float32)

    @cuda.jit(device=True)
    def f32_to_bits(x):
        return np.int64(np.float32(x).view(np.uint32))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def fmul(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def bits_to_f32(bits):
        return libdevice.int_as_float(np.int32(bits & 0xFFFFFFFF))

    @cuda.jit(device=True)
    def f32_to_bits(x):
        return np.int64(libdevice.float_as_int(x)) & 0xFFFFFFFF


@cuda.jit(device=True)
def bf16_bits(x):
    """float32 x as bf16 bits (uint16): round to nearest, ties to even; a NaN stays a
    quiet NaN with its sign (kernels/bf16.py to_bf16_ref, the CPU's conversion)."""
    u = f32_to_bits(x)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((u >> 16) | 0x40)
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@cuda.jit(device=True)
def block_sum(buf, tid, val):
    """Sum of val over the thread block (blockDim.x a power of two, <= buf size).
    Deterministic tree order; every thread gets the result. buf: shared scratch."""
    buf[tid] = val
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            buf[tid] += buf[tid + s]
        cuda.syncthreads()
        s //= 2
    res = buf[0]
    cuda.syncthreads()  # buf may be reused right after
    return res


@cuda.jit(device=True)
def block_max(buf, tid, val):
    """Max of val over the thread block (as block_sum)."""
    buf[tid] = val
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            buf[tid] = max(buf[tid], buf[tid + s])
        cuda.syncthreads()
        s //= 2
    res = buf[0]
    cuda.syncthreads()
    return res


@cuda.jit(device=True)
def thread_element(a):
    """(n, f) of the element of the 2-D array a that this thread of a 1-D grid owns
    (flat index over a's N*F values); n >= N for a thread past the end."""
    idx = cuda.grid(1)
    return idx // a.shape[1], idx % a.shape[1]


def row_threads(n: int) -> int:
    """Threads per block for a kernel that reduces rows of n values: the next power
    of two >= n, clamped to [32, MAX_THREADS] (a whole warp at least)."""
    t = 32
    while t < n and t < MAX_THREADS:
        t *= 2
    return t


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------- argument checks
def _contiguous(a) -> bool:
    """C-contiguous by numpy's rule, from the shape and strides alone (an axis of length 1
    may have any stride: numpy gives a new axis stride 0), the same for every kind of
    device array. numba's own flag (DeviceNDArray.is_c_contiguous) calls an array with a
    stride-0 axis of length 1 not contiguous where the simulator's numpy flag says it is,
    so a check through it passed in the simulator and refused the view on a GPU. CuPy's
    and numpy's own flag (the simulator's arrays) follow numpy's rule: read as is (a
    launch checks several arrays, and the rule in Python costs 1-2 us each)."""
    flags = getattr(a, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous"):         # CuPy, numpy (not numba's dict)
        return bool(flags.c_contiguous)
    strides = getattr(a, "strides", None)
    if strides is None:
        strides = a.__cuda_array_interface__.get("strides")
        if strides is None:
            return True
    expect = np.dtype(a.dtype).itemsize
    for n, s in zip(reversed(tuple(a.shape)), reversed(tuple(strides))):
        if n == 0:
            return True
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def is_device_array(a) -> bool:
    """A CUDA device array (numba DeviceNDArray, CuPy, anything exporting
    __cuda_array_interface__, or the simulator's fake device array); numpy
    host arrays are refused (numba would copy them to the device and back at
    every launch)."""
    if isinstance(a, np.ndarray):
        return False
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(a, cupy.ndarray):     # before the interface: CuPy builds it per access
        return True
    if hasattr(a, "__cuda_array_interface__"):
        return True
    return SIM and type(a).__name__ == "FakeCUDAArray"


def describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"a numpy host array {a.dtype} {a.shape}"
    if is_device_array(a):
        return f"{np.dtype(a.dtype)} {tuple(a.shape)}"
    return type(a).__name__


def check(op: str, name: str, a, shape, dtype, contiguous: bool = True) -> None:
    """Raise ValueError unless a is a device array of this shape and dtype (and
    C-contiguous when asked)."""
    ok = (is_device_array(a) and np.dtype(a.dtype) == np.dtype(dtype)
          and tuple(a.shape) == tuple(shape) and (not contiguous or _contiguous(a)))
    if not ok:
        need = "C-contiguous " if contiguous else ""
        raise ValueError(f"{op}: {name} must be a {need}{np.dtype(dtype)} device array of "
                         f"shape {tuple(shape)}, got {describe(a)}")


def check_gate(op: str, arrays: dict) -> tuple:
    """The operands of an elementwise gate (swiglu, geglu): arrays["g"] a 2-D float32
    device array, every array (name -> array) C-contiguous of its shape; returns it."""
    shape = check_ndim(op, "g", arrays["g"], 2, np.float32)
    for name, a in arrays.items():
        check(op, name, a, shape, np.float32)
    return shape


GATE_THREADS = 256
"""Threads per block of the elementwise gate kernels (one thread per element)."""


def launch_gate(op: str, kernel, arrays: dict) -> None:
    """Check the operands of an elementwise gate (check_gate) and launch kernel, one
    thread per element (thread_element), on the arrays in their order."""
    N, F = check_gate(op, arrays)
    if N * F:
        kernel[cdiv(N * F, GATE_THREADS), GATE_THREADS](*arrays.values())


def check_ndim(op: str, name: str, a, ndim: int, dtype) -> tuple:
    """Check a's kind, rank and dtype; return its shape."""
    if not (is_device_array(a) and len(a.shape) == ndim and np.dtype(a.dtype) == np.dtype(dtype)):
        raise ValueError(f"{op}: {name} must be a {ndim}-D {np.dtype(dtype)} device array, "
                         f"got {describe(a)}")
    return tuple(a.shape)



# --------------------------------------------------------------- cuBLAS operands
def array_of(op: str, name: str, a):
    """The array a library call (cuBLAS through CuPy, CuPy's own ops) takes for device
    array `a`: on a GPU a zero-copy CuPy view of anything exporting
    __cuda_array_interface__ (a numba DeviceNDArray included: CuPy's cuBLAS wrappers
    read private attributes of their own arrays and fail on any other); under the
    simulator the numpy memory behind its device array. Either way a numpy host array
    (or anything else) is refused, as check() refuses it: CuPy would copy it to the
    GPU and a result written there would never reach it."""
    if not SIM:
        import cupy
        if isinstance(a, cupy.ndarray):
            return a
    if not is_device_array(a):
        raise ValueError(f"{op}: {name} must be a device array, got {describe(a)}")
    if SIM:
        return np.asarray(getattr(a, "_ary", a))
    return cupy.asarray(a)


def blas_layout(op: str, name: str, a, dtype) -> tuple[bool, int]:
    """(row-major, leading dimension in elements) of a 2-D `dtype` matrix as cuBLAS reads
    it: rows of unit-stride elements a fixed stride apart (C order, or a column block of a
    wider array), or columns so (F order: a transposed view). Anything else (a view
    strided both ways, a wrong dtype or rank) is a ValueError on the simulator as on a
    GPU, where cuBLAS would misread it."""
    if len(a.shape) != 2 or a.dtype != dtype:
        raise ValueError(f"{op}: {name} must be a 2-D {np.dtype(dtype)} matrix, got {describe(a)}")
    rows, cols = a.shape
    flags = a.flags                                      # CuPy's or numpy's: the common cases at once
    if flags.c_contiguous:
        return True, max(1, cols)
    if flags.f_contiguous:
        return False, max(1, rows)
    size = np.dtype(dtype).itemsize
    s0, s1 = (int(s) for s in a.strides)
    if (cols <= 1 or s1 == size) and (rows <= 1 or (s0 % size == 0 and s0 >= cols * size)):
        return True, (s0 // size if rows > 1 else max(1, cols))          # row-major
    if (rows <= 1 or s0 == size) and (cols <= 1 or (s1 % size == 0 and s1 >= rows * size)):
        return False, (s1 // size if cols > 1 else max(1, rows))         # column-major
    raise ValueError(f"{op}: {name} {tuple(a.shape)} with strides {tuple(a.strides)} is neither row- nor "
                     f"column-major with unit element stride: cuBLAS cannot read it")
