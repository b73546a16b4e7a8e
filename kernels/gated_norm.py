"""The gated RMS norm of the gated delta-net layers' output (Qwen3.5, Qwen3-Next),
forward and backward (numba CPU kernels + numpy references).

    out = x * rstd * w * silu(z),   rstd = 1 / sqrt(mean(x^2) + eps)   (one row of D channels)

HF transformers' Qwen3_5RMSNormGated (norm, weight, then times silu of the gate, in
float32) and llama.cpp's `build_norm_gated` (ggml_rms_norm, ggml_mul by the weight,
ggml_mul by ggml_silu(z): src/models/qwen35.cpp). A row is one value head's DV
outputs; w (D,) is shared by the heads. The sum of squares is accumulated in float64,
as ggml's rms_norm does.

Backward, with n = x rstd w and s = silu(z):
    dz = dout n silu'(z),   dn = dout s,   dw += sum_rows(dn x rstd),
    dx = rstd w dn - x rstd^3 / D sum(dn w x)
Gradient rule: dx, dz overwritten, dw accumulated (+=), as rmsnorm's.
"""

import numpy as np
from numba import njit, prange

from ._checks import check_array
from .vecmath import FASTMATH
from .vecmath import expf as _exp

_DW_ROWS = 128  # rows per dw task (each sums into its own row of a scratch, added in order)


@njit(cache=True, parallel=True, fastmath=FASTMATH, error_model="numpy")
def _forward_kernel(out, rstd, x, z, w, eps):
    N, D = x.shape
    for n in prange(N):
        ss = 0.0
        for c in range(D):
            ss += x[n, c] * x[n, c]
        rstd[n] = 1 / np.sqrt(ss / D + eps)
        r = rstd[n]
        for c in range(D):
            out[n, c] = x[n, c] * r * w[c] * (z[n, c] / (1 + _exp(-z[n, c])))


@njit(cache=True, parallel=True, fastmath=FASTMATH, error_model="numpy")
def _backward_kernel(dx, dz, dw, dout, x, z, w, rstd):
    # dx, dz (N, D) out; dw (D,) +=; the rest in. Each task of _DW_ROWS rows sums its share
    # of dw into its own float64 row of a scratch; the rows are added in task order
    # (independent of the thread count)
    N, D = x.shape
    n_blocks = (N + _DW_ROWS - 1) // _DW_ROWS
    part = np.zeros((n_blocks, D))
    for bi in prange(n_blocks):
        acc = part[bi]
        for n in range(bi * _DW_ROWS, min(N, bi * _DW_ROWS + _DW_ROWS)):
            r = rstd[n]
            dot = r - r
            for c in range(D):
                sg = 1 / (1 + _exp(-z[n, c]))
                dn = dout[n, c] * z[n, c] * sg
                dot += dn * w[c] * x[n, c]
                acc[c] += dn * x[n, c] * r
                dz[n, c] = dout[n, c] * x[n, c] * r * w[c] * sg * (1 + z[n, c] * (1 - sg))
                dx[n, c] = dn  # dn kept in dx until the row's dot is known
            k = x.dtype.type(dot * r * r * r / D)
            for c in range(D):
                dx[n, c] = r * w[c] * dx[n, c] - k * x[n, c]
    for bi in range(n_blocks):
        for c in range(D):
            dw[c] += part[bi, c]


def _check_x(x):
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype not in (np.float32, np.float64):
        raise ValueError("gated_norm: x must be a 2-D float32 or float64 array (N, D)")
    return x.shape


def gated_rmsnorm_forward(out, rstd, x, z, w, eps):
    """out (N, D) = x * rstd * w * silu(z); rstd (N,) saved for backward; x, z (N, D); w (D,)."""
    N, D = _check_x(x)
    for name, a, shape in (("out", out, (N, D)), ("rstd", rstd, (N,)), ("x", x, (N, D)),
                           ("z", z, (N, D)), ("w", w, (D,))):
        check_array("gated_norm", name, a, shape, x.dtype)
    if not eps > 0:
        raise ValueError(f"gated_norm: eps must be > 0, got {eps}")
    _forward_kernel(out, rstd, x, z, w, x.dtype.type(eps))


def gated_rmsnorm_backward(dx, dz, dw, dout, x, z, w, rstd):
    """dx, dz (N, D) overwritten; dw (D,) += dL/dw; dout, x, z (N, D); w (D,); rstd (N,)."""
    N, D = _check_x(x)
    for name, a, shape in (("dx", dx, (N, D)), ("dz", dz, (N, D)), ("dw", dw, (D,)),
                           ("dout", dout, (N, D)), ("x", x, (N, D)), ("z", z, (N, D)),
                           ("w", w, (D,)), ("rstd", rstd, (N,))):
        check_array("gated_norm", name, a, shape, x.dtype)
    _backward_kernel(dx, dz, dw, dout, x, z, w, rstd)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def gated_rmsnorm_forward_ref(out, rstd, x, z, w, eps):
    ss = np.sum((x * x).astype(np.float64), axis=1)
    rstd[:] = 1 / np.sqrt(ss / x.shape[1] + eps)
    out[:] = x * rstd[:, None] * w * (z / (1 + np.exp(-z)))


def gated_rmsnorm_backward_ref(dx, dz, dw, dout, x, z, w, rstd):
    r = rstd[:, None]
    sg = 1 / (1 + np.exp(-z))
    dz[:] = dout * x * r * w * sg * (1 + z * (1 - sg))
    dn = dout * z * sg
    dw += np.sum((dn * x * r).astype(np.float64), axis=0)  # float64 sums, as the kernel's
    dx[:] = r * w * dn - x * (np.sum(dn * w * x, axis=1, keepdims=True) * r ** 3 / x.shape[1])
