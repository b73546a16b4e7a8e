"""Matrix products through cuBLAS's cublasGemmEx (CuPy's binding), float32 or bf16 in,
float32 out, float32 accumulation: out = alpha a @ b + beta out in one launch.

    gemm(out, a, b, alpha, beta)        float32 a, b: plain float32 (CUBLAS_COMPUTE_32F, never
                                        TF32, whatever CuPy's matmul compute type)
    gemm_bf16(out, a, b, alpha, beta)   bf16 a, b (uint16 arrays holding the bits, as
                                        kernels/bf16.py on the CPU): tensor cores, float32 sums

Operands are 2-D device arrays, each row-major or column-major with unit element stride
(a C array, a transposed view, a column block of a wider array: `_common.blas_layout`),
`out` included; anything else is a ValueError. Row-major data is column-major data of
the transpose, so out = a b is computed as out^T = b^T a^T with no copy.

Under numba's CUDA simulator (no cuBLAS) the same checks run and numpy computes the
product on the operands' values (a bf16 operand widened exactly to float32), the
product first, then the scale, then the add, as cuBLAS's epilogue.
"""
from __future__ import annotations

import numpy as np

from ._common import SIM, array_of, blas_layout

__all__ = ["gemm", "gemm_bf16", "gemm_arrays", "bf16_to_f32_ref"]

CUDA_R_32F, CUDA_R_16BF = 0, 14          # cudaDataType_t
CUBLAS_COMPUTE_32F = 68                  # cublasComputeType_t: plain float32 sums
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0
OP_N, OP_T = 0, 1


def bf16_to_f32_ref(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) as the float32 values they are (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def gemm(out, a, b, alpha: float = 1.0, beta: float = 0.0):
    """out (M, N) = alpha a (M, K) @ b (K, N) + beta out, float32 device arrays (CuPy's,
    numba's, ...); out None: a new C array (beta ignored). Returns out (CuPy's array, or
    numpy's in the simulator)."""
    return _product("gemm", *_device("gemm", out, a, b), alpha, beta, np.float32)


def gemm_bf16(out, a, b, alpha: float = 1.0, beta: float = 0.0):
    """As gemm with bf16 operands a, b (uint16 bits) and a float32 out: tensor cores on a
    GPU of compute capability 8.0 or newer."""
    return _product("gemm_bf16", *_device("gemm_bf16", out, a, b), alpha, beta, np.uint16)


def gemm_arrays(out, a, b, alpha: float = 1.0, beta: float = 0.0):
    """gemm on the library's own arrays (CuPy's on a GPU; in the simulator the numpy
    memory of its device arrays, which only a caller that took them so may pass): for
    products of views of arguments already taken (lora.py)."""
    out = None if out is None else _library("gemm", "out", out)
    return _product("gemm", out, _library("gemm", "a", a), _library("gemm", "b", b), alpha, beta, np.float32)


def _device(op: str, out, a, b):
    return (None if out is None else array_of(op, "out", out)), array_of(op, "a", a), array_of(op, "b", b)


def _library(op: str, name: str, a):
    """a itself when it is the library's array (numpy in the simulator, CuPy on a GPU)."""
    if SIM:
        if isinstance(a, np.ndarray):
            return a
    elif isinstance(a, _cupy().ndarray):
        return a
    raise ValueError(f"{op}: {name} must be an array of the backend's array module, got {type(a).__name__}")


def _product(op, out, a, b, alpha, beta, in_dtype):
    (a_rows, lda), (b_rows, ldb) = blas_layout(op, "a", a, in_dtype), blas_layout(op, "b", b, in_dtype)
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"{op}: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply")
    N = b.shape[1]
    if out is None:
        xp = np if SIM else _cupy()
        out, beta = xp.empty((M, N), np.float32), 0.0
    if tuple(out.shape) != (M, N):
        raise ValueError(f"{op}: out must be ({M}, {N}), got {tuple(out.shape)}")
    out_rows, ldc = blas_layout(op, "out", out, np.float32)
    if SIM:
        _emulate(out, a, b, alpha, beta, in_dtype)
        return out
    if M == 0 or N == 0:
        return out
    # cuBLAS is column-major: a row-major out is out^T = b^T a^T; a column-major one is a b
    if out_rows:
        first, second, m, n = (b, b_rows, ldb), (a, a_rows, lda), N, M
        op1, op2 = OP_N if b_rows else OP_T, OP_N if a_rows else OP_T
    else:
        first, second, m, n = (a, a_rows, lda), (b, b_rows, ldb), M, N
        op1, op2 = OP_T if a_rows else OP_N, OP_T if b_rows else OP_N
    cublas, handle = _cublas(), _cupy().cuda.device.get_cublas_handle()
    kind = CUDA_R_16BF if in_dtype == np.uint16 else CUDA_R_32F
    scalars = np.array([alpha, beta], np.float32)        # host scalars, read by the call itself
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)   # as CuPy's own wrappers set it per call
    cublas.gemmEx(handle, op1, op2, m, n, K,
                  scalars.ctypes.data, first[0].data.ptr, kind, first[2],
                  second[0].data.ptr, kind, second[2],
                  scalars.ctypes.data + 4, out.data.ptr, CUDA_R_32F, ldc,
                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    return out


def _emulate(out, a, b, alpha, beta, in_dtype) -> None:
    if in_dtype == np.uint16:
        a, b = bf16_to_f32_ref(a), bf16_to_f32_ref(b)
    res = np.matmul(a, b)
    if alpha != 1.0:
        res *= np.float32(alpha)
    if beta == 0.0:
        out[...] = res
        return
    if beta != 1.0:
        out *= np.float32(beta)
    out += res


def _cupy():
    import cupy
    return cupy


def _cublas():
    """CuPy's cuBLAS binding (cupy_backends' module; cupy.cuda.cublas in older releases)."""
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:
        from cupy.cuda import cublas
    return cublas
