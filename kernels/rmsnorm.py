"""RMS normalisation, forward and backward (numba CPU kernels + numpy references).

    y = x * rstd * w,   rstd = 1 / sqrt(mean(x^2) + eps)      (one row of C channels)

The forward mirrors llama.cpp's `ggml_compute_forward_rms_norm_f32` (ggml-cpu
ops.cpp) followed by the `ggml_mul` with the norm weight: the sum of squares is
accumulated in double (`ggml_float`) from float products, `mean = sum/C` and
`scale = 1.0f/sqrtf(mean + eps)` are rounded to float, then `y = (x*scale)*w` in float.
The backward (dx, dw) is ours; llama.cpp's RMS_NORM_BACK only gives dx.

Gradient rule: dx is overwritten, dw is accumulated (+=).
Kernels are dtype-generic (float32 in production, float64 in finite-difference tests).
"""

import numpy as np
from numba import njit, prange

from ._checks import check_array
from .scalar import inv_rms
from .vecmath import FASTMATH

# Rows per dw task: each task sums its rows into its own row of a scratch.
_DW_ROWS = 128


@njit(cache=True, parallel=True)
def _rmsnorm_forward_kernel(out, rstd, x, w, eps):
    # out (N, C), rstd (N,), x (N, C), w (C,); eps has x's dtype
    # Each row's sum of squares is one serial float64 chain (ggml's order, bit for bit);
    # four rows run side by side so that four chains are in flight at once.
    N, C = x.shape
    for g in prange((N + 3) // 4):
        n0 = 4 * g
        if n0 + 4 <= N:
            s0 = s1 = s2 = s3 = 0.0  # float64 accumulators, like ggml_float
            for c in range(C):
                s0 += x[n0, c] * x[n0, c]  # product in x's dtype, then widened (as ggml)
                s1 += x[n0 + 1, c] * x[n0 + 1, c]
                s2 += x[n0 + 2, c] * x[n0 + 2, c]
                s3 += x[n0 + 3, c] * x[n0 + 3, c]
            rstd[n0], rstd[n0 + 1], rstd[n0 + 2], rstd[n0 + 3] = s0 / C, s1 / C, s2 / C, s3 / C
        else:
            for n in range(n0, N):
                ss = 0.0
                for c in range(C):
                    ss += x[n, c] * x[n, c]
                rstd[n] = ss / C  # the mean, rounded to x's dtype by the store
        for n in range(n0, min(N, n0 + 4)):
            rstd[n] = inv_rms(rstd[n], eps)  # 1.0f/sqrtf(mean+eps)
            r = rstd[n]
            for c in range(C):
                out[n, c] = x[n, c] * r * w[c]  # (x*scale)*w, the rms_norm then the mul


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _rmsnorm_dx_kernel(dx, dout, x, w, rstd):
    # dx (N, C) =, dout (N, C), x (N, C), w (C,), rstd (N,)
    # dx_i = r w_i dout_i - x_i r^3/C * sum_c(dout_c w_c x_c)  (the sum reassociated: vectorized)
    # in x's dtype throughout (a float64 literal would turn both loops into 4-wide doubles)
    N, C = x.shape
    for n in prange(N):
        r = rstd[n]
        dot = r - r
        for c in range(C):
            dot += dout[n, c] * w[c] * x[n, c]
        k = x.dtype.type(dot * r * r * r / C)
        for c in range(C):
            dx[n, c] = r * w[c] * dout[n, c] - k * x[n, c]


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _rmsnorm_dw_kernel(dw, dout, x, rstd):
    # dw (C,) +=, dout (N, C), x (N, C), rstd (N,)
    # dw_c += sum_n dout[n,c] * x[n,c] * rstd[n]: each block of _DW_ROWS rows sums into its
    # own float64 row (contiguous, vectorized), then the rows are added in block order, so
    # the result does not depend on the thread count
    N, C = x.shape
    n_blocks = (N + _DW_ROWS - 1) // _DW_ROWS
    part = np.zeros((n_blocks, C))
    for bi in prange(n_blocks):
        acc = part[bi]
        for n in range(bi * _DW_ROWS, min(N, bi * _DW_ROWS + _DW_ROWS)):
            r = rstd[n]
            for c in range(C):
                acc[c] += dout[n, c] * x[n, c] * r
    for bi in range(n_blocks):
        for c in range(C):
            dw[c] += part[bi, c]


def _check(name, a, shape, dtype):
    check_array("rmsnorm", name, a, shape, dtype)


def _check_x(x):
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype not in (np.float32, np.float64):
        raise ValueError("rmsnorm: x must be a 2-D float32 or float64 array (N, C)")


def rmsnorm_forward(out, rstd, x, w, eps):
    """out (N, C) = x * rstd * w; rstd (N,) saved for backward; x (N, C); w (C,)."""
    _check_x(x)
    N, C = x.shape
    for name, a, shape in (("out", out, (N, C)), ("rstd", rstd, (N,)), ("x", x, (N, C)),
                           ("w", w, (C,))):
        _check(name, a, shape, x.dtype)
    if not eps > 0:
        raise ValueError(f"rmsnorm: eps must be > 0, got {eps}")
    _rmsnorm_forward_kernel(out, rstd, x, w, x.dtype.type(eps))


def rmsnorm_backward(dx, dw, dout, x, w, rstd):
    """dx (N, C) = dL/dx (overwritten); dw (C,) += dL/dw; dout, x (N, C); w (C,); rstd (N,)."""
    _check_x(x)
    N, C = x.shape
    for name, a, shape in (("dx", dx, (N, C)), ("dw", dw, (C,)), ("dout", dout, (N, C)),
                           ("x", x, (N, C)), ("w", w, (C,)), ("rstd", rstd, (N,))):
        _check(name, a, shape, x.dtype)
    _rmsnorm_dx_kernel(dx, dout, x, w, rstd)
    _rmsnorm_dw_kernel(dw, dout, x, rstd)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def rmsnorm_forward_ref(out, rstd, x, w, eps):
    ss = np.sum((x * x).astype(np.float64), axis=1)  # float products, double sum
    mean = (ss / x.shape[1]).astype(x.dtype)
    rstd[:] = x.dtype.type(1.0) / np.sqrt(mean + x.dtype.type(eps))
    out[:] = x * rstd[:, None] * w


def rmsnorm_backward_ref(dx, dw, dout, x, w, rstd):
    r = rstd[:, None]
    dot = np.sum(dout * w * x, axis=1, keepdims=True)
    dx[:] = r * w * dout - x * (dot * r**3 / x.shape[1])
    dw += np.sum(dout * x * r, axis=0)
