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

import numpy as np

from ..scalar import inv_rms
from ._common import (MAX_THREADS, block_sum, cdiv, check, check_ndim, cuda, float64,
                      row_threads)

__all__ = ["rmsnorm_forward", "rmsnorm_backward"]

_DW_THREADS = 128


# ------------------------------------------------ one row or column (shared with the fused kernels)
@cuda.jit(device=True)
def sum_squares(x):
    # this thread's share of sum(x^2) over the row x (1-D view): float32 squares
    # widened and summed in float64, as ggml
    ss = 0.0
    for c in range(cuda.threadIdx.x, x.shape[0], cuda.blockDim.x):
        xc = x[c]
        ss += xc * xc
    return ss


@cuda.jit(device=True)
def norm_row(buf, out, x, w, ss, eps):
    # out = x * r * w over the row x (1-D views; out may be x), r = rstd of the row whose
    # threads' sums of squares are ss; returns r. buf: the block's float64 shared scratch
    C = x.shape[0]
    r = inv_rms(np.float32(block_sum(buf, cuda.threadIdx.x, ss) / C), eps)
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        out[c] = x[c] * r * w[c]
    return r


@cuda.jit(device=True)
def norm_dx_row(buf, dx, dout, x, w, r, accumulate):
    # dx (=, or += with accumulate) r*w*dout - (dot*r^3/C)*x over the row (1-D views),
    # dot = sum(dout*w*x) in float64; dx may not alias dout or x
    C = x.shape[0]
    dot = 0.0
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        dot += dout[c] * w[c] * x[c]
    k = block_sum(buf, cuda.threadIdx.x, dot) * r * r * r / C
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        v = r * w[c] * dout[c] - k * x[c]
        dx[c] = dx[c] + v if accumulate else v


@cuda.jit(device=True)
def norm_dw_column(dw, dout, x, rstd, c):
    # dw[c] += sum_n dout[n, c] * x[n, c] * rstd[n], in float64, rows in order
    acc = 0.0
    for n in range(x.shape[0]):
        acc += dout[n, c] * x[n, c] * rstd[n]
    dw[c] += acc


# ------------------------------------------------------------------ the kernels
@cuda.jit
def _rmsnorm_forward_kernel(out, rstd, x, w, eps):
    # grid N, block row_threads(C); out, x (N, C), rstd (N,), w (C,), eps float32
    n = cuda.blockIdx.x
    buf = cuda.shared.array(MAX_THREADS, float64)
    r = norm_row(buf, out[n], x[n], w, sum_squares(x[n]), eps)
    if cuda.threadIdx.x == 0:
        rstd[n] = r


@cuda.jit
def _rmsnorm_dx_kernel(dx, dout, x, w, rstd):
    # grid N, block row_threads(C); dx may not alias dout (the dw kernel reads it after)
    n = cuda.blockIdx.x
    buf = cuda.shared.array(MAX_THREADS, float64)
    norm_dx_row(buf, dx[n], dout[n], x[n], w, rstd[n], False)


@cuda.jit
def _rmsnorm_dw_kernel(dw, dout, x, rstd):
    # grid ceil(C / _DW_THREADS); thread = column: dw[c] += sum_n dout*x*rstd
    c = cuda.grid(1)
    if c < x.shape[1]:
        norm_dw_column(dw, dout, x, rstd, c)


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
