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

# Columns per dw task: each task owns a disjoint slice of dw, so there is no race.
_DW_BLOCK = 64


@njit(cache=True, parallel=True)
def _rmsnorm_forward_kernel(out, rstd, x, w, eps):
    # out (N, C), rstd (N,), x (N, C), w (C,); eps has x's dtype
    N, C = x.shape
    for n in prange(N):
        ss = 0.0  # float64 accumulator, like ggml_float
        for c in range(C):
            ss += x[n, c] * x[n, c]  # product in x's dtype, then widened (as ggml)
        rstd[n] = ss / C  # the mean, rounded to x's dtype by the store
        rstd[n] = np.float32(1.0) / np.sqrt(rstd[n] + eps)  # 1.0f/sqrtf(mean+eps)
        r = rstd[n]
        for c in range(C):
            out[n, c] = x[n, c] * r * w[c]  # (x*scale)*w, the rms_norm then the mul


@njit(cache=True, parallel=True)
def _rmsnorm_dx_kernel(dx, dout, x, w, rstd):
    # dx (N, C) =, dout (N, C), x (N, C), w (C,), rstd (N,)
    # dx_i = r w_i dout_i - x_i r^3/C * sum_c(dout_c w_c x_c)
    N, C = x.shape
    for n in prange(N):
        r = rstd[n]
        dot = 0.0
        for c in range(C):
            dot += dout[n, c] * w[c] * x[n, c]
        k = dot * r * r * r / C
        for c in range(C):
            dx[n, c] = r * w[c] * dout[n, c] - k * x[n, c]


@njit(cache=True, parallel=True)
def _rmsnorm_dw_kernel(dw, dout, x, rstd):
    # dw (C,) +=, dout (N, C), x (N, C), rstd (N,)
    # dw_c += sum_n dout[n,c] * x[n,c] * rstd[n], one column block per task
    N, C = x.shape
    n_blocks = (C + _DW_BLOCK - 1) // _DW_BLOCK
    for bi in prange(n_blocks):
        c0 = bi * _DW_BLOCK
        c1 = min(c0 + _DW_BLOCK, C)
        acc = np.zeros(c1 - c0)  # per-task float64 scratch (<= _DW_BLOCK values)
        for n in range(N):
            r = rstd[n]
            for c in range(c0, c1):
                acc[c - c0] += dout[n, c] * x[n, c] * r
        for c in range(c0, c1):
            dw[c] += acc[c - c0]


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
