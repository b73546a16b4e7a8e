"""RMS normalisation on the GPU, forward and backward (float32; the CPU twin and its
numpy references are ``llamatune.kernels.rmsnorm``).

    y = x * rstd * w,   rstd = 1 / sqrt(mean(x^2) + eps)

* forward: one thread block per row; float32 squares summed in float64 with a
  block tree reduction, then mean rounded to float32, rstd = 1.0f/sqrtf(mean+eps)
  and y = (x*rstd)*w in float32, as the CPU kernel (the summation order differs,
  so results agree to rounding, not bit for bit).
* backward dx: one block per row, dot = sum(dout*w*x) in float64,
  dx = r*w*dout - (dot*r^3/C)*x (overwritten).
* backward dw: one thread per column summing dout*x*rstd over all rows in float64,
  then dw += (accumulated, as on the CPU). Deterministic (no atomics).
"""
from __future__ import annotations

import math

import numpy as np

from ._common import (MAX_THREADS, block_sum, cdiv, check, check_ndim, cuda, float64,
                      row_threads)

__all__ = ["rmsnorm_forward", "rmsnorm_backward"]

_DW_THREADS = 128


@cuda.jit
def _rmsnorm_forward_kernel(out, rstd, x, w, eps):
    # grid N, block row_threads(C); out, x (N, C), rstd (N,), w (C,), eps float32
    n = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    C = x.shape[1]
    buf = cuda.shared.array(MAX_THREADS, float64)
    ss = 0.0
    for c in range(tid, C, cuda.blockDim.x):
        xc = x[n, c]
        ss += xc * xc  # float32 product widened, as ggml
    ss = block_sum(buf, tid, ss)
    mean = np.float32(ss / C)
    r = np.float32(1.0) / np.float32(math.sqrt(mean + eps))
    if tid == 0:
        rstd[n] = r
    for c in range(tid, C, cuda.blockDim.x):
        out[n, c] = x[n, c] * r * w[c]


@cuda.jit
def _rmsnorm_dx_kernel(dx, dout, x, w, rstd):
    # grid N, block row_threads(C); dx may not alias dout (the dw kernel reads it after)
    n = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    C = x.shape[1]
    buf = cuda.shared.array(MAX_THREADS, float64)
    r = rstd[n]
    dot = 0.0
    for c in range(tid, C, cuda.blockDim.x):
        dot += dout[n, c] * w[c] * x[n, c]
    dot = block_sum(buf, tid, dot)
    k = dot * r * r * r / C
    for c in range(tid, C, cuda.blockDim.x):
        dx[n, c] = r * w[c] * dout[n, c] - k * x[n, c]


@cuda.jit
def _rmsnorm_dw_kernel(dw, dout, x, rstd):
    # grid ceil(C / _DW_THREADS); thread = column: dw[c] += sum_n dout*x*rstd
    c = cuda.grid(1)
    N, C = x.shape
    if c < C:
        acc = 0.0
        for n in range(N):
            acc += dout[n, c] * x[n, c] * rstd[n]
        dw[c] += acc


def _shape(x):
    return check_ndim("rmsnorm", "x", x, 2, np.float32)


def rmsnorm_forward(out, rstd, x, w, eps) -> None:
    """out (N, C) = x * rstd * w; rstd (N,) saved for backward; x (N, C); w (C,).
    All float32 device arrays; out may be x (every thread rereads its own x
    values after the reduction barrier)."""
    N, C = _shape(x)
    for name, a, shape in (("out", out, (N, C)), ("rstd", rstd, (N,)), ("x", x, (N, C)),
                           ("w", w, (C,))):
        check("rmsnorm", name, a, shape, np.float32)
    if not eps > 0:
        raise ValueError(f"rmsnorm: eps must be > 0, got {eps}")
    if N and C:
        _rmsnorm_forward_kernel[N, row_threads(C)](out, rstd, x, w, np.float32(eps))


def rmsnorm_backward(dx, dw, dout, x, w, rstd) -> None:
    """dx (N, C) = dL/dx (overwritten); dw (C,) += dL/dw; dout, x (N, C); w (C,); rstd (N,)."""
    N, C = _shape(x)
    for name, a, shape in (("dx", dx, (N, C)), ("dw", dw, (C,)), ("dout", dout, (N, C)),
                           ("x", x, (N, C)), ("w", w, (C,)), ("rstd", rstd, (N,))):
        check("rmsnorm", name, a, shape, np.float32)
    if N and C:
        _rmsnorm_dx_kernel[N, row_threads(C)](dx, dout, x, w, rstd)
        _rmsnorm_dw_kernel[cdiv(C, _DW_THREADS), _DW_THREADS](dw, dout, x, rstd)
