"""The LoRA adapter's products on the GPU (CPU twin and references:
``llamatune.kernels.lora``, whose docstring has the maths).

Each product is one cuBLAS sgemm through CuPy (``cupy.cublas.gemm``), whose epilogue
applies the scale and the accumulation, out = alpha op(a) op(b) + beta out: the
forward's y += s xa B^T is one launch (a product, a scale and an add before), the
backward four (eleven before: each `grad[...] += s * (a @ b)` was a product, a scale,
an add and a copy). sgemm is plain float32 whatever CuPy's matmul compute type
(--tf32 leaves the rank-r products exact). Under numba's CUDA simulator the arrays
are numpy (the simulator's device arrays share their memory) and `gemm` computes
the same in numpy, the product first, then the scale, then the add, as cuBLAS.
"""
from __future__ import annotations

import numpy as np

from ._common import SIM

__all__ = ["lora_forward", "lora_backward", "gemm"]


def _array(a):
    """The array behind a simulator device array (numpy), or a itself (CuPy)."""
    return np.asarray(a._ary) if type(a).__name__ == "FakeCUDAArray" else a


def gemm(out, a, b, alpha: float = 1.0, beta: float = 0.0):
    """out = alpha * a @ b + beta * out (out None: a new array, beta ignored); a, b, out 2-D
    float32, each C- or F-contiguous (a transposed view is F-contiguous). One launch."""
    if SIM:
        res = np.matmul(a, b)
        if alpha != 1.0:
            res *= np.float32(alpha)
        if out is None:
            return res
        if beta == 0.0:
            out[...] = res
        else:
            if beta != 1.0:
                out *= np.float32(beta)
            out += res
        return out
    import cupy.cublas
    return cupy.cublas.gemm("N", "N", a, b, out=out, alpha=alpha, beta=beta)


def lora_forward(y, xa, B, scale, scratch) -> None:
    """y (N, n_out) += scale * xa (N, r) B^T, in one launch (scratch unused)."""
    y, xa, B = map(_array, (y, xa, B))
    gemm(y, xa, B.T, scale, 1.0)


def lora_backward(dA, dB, dx, dy, xd, xa, A, B, scale, scratch, mask=None) -> None:
    """dB += s dy^T xa, dxa = s dy B, dA += dxa^T xd, dx += (dxa A) (* mask): four launches
    (five with a dropout mask: scratch gets dxa A, then dx += scratch * mask)."""
    dA, dB, dy, xd, xa, A, B = map(_array, (dA, dB, dy, xd, xa, A, B))
    gemm(dB, dy.T, xa, scale, 1.0)
    dxa = gemm(None, dy, B, scale)                                 # (N, r)
    gemm(dA.T, xd.T, dxa, 1.0, 1.0)                                # dA^T (n_in, r) += xd^T dxa
    if dx is None:
        return
    dx = _array(dx)
    if mask is None:
        gemm(dx, dxa, A, 1.0, 1.0)
    else:
        dx += gemm(_array(scratch), dxa, A) * _array(mask)
