"""Soft-capping (tanh) of logits, forward and backward (numba + numpy refs).

    y = cap * tanh(x / cap)          dx = dy * (1 - (y / cap)^2)

Gemma 2 caps its final logits this way before the softmax (and, inside attention,
its attention scores: that one lives in `attention`, fused with the softmax).
Mirrors llama.cpp's gemma2 graph (src/models/gemma2.cpp): `ggml_scale(cur, 1/cap)`,
`ggml_tanh`, `ggml_scale(cur, cap)`, i.e. in float32 y = cap * tanhf(x * (1/cap))
with 1/cap rounded to float32 first; we compute that sequence, with vecmath's
vectorized float32 tanh (within 1.2 ulp of tanhf; Gemma 2 caps every logit of its
256000-word vocabulary, so libm's scalar tanhf cost seconds a step).

The backward needs only the forward's output y (tanh' = 1 - tanh^2), so the
logits chunk can be capped in place and its gradient computed in place too:
`softcap_forward(x, x, cap)` and `softcap_backward(dy, dy, y, cap)` are allowed.
Arrays of any shape (the graph passes (n, V) chunks of logits), C-contiguous,
float32 or float64; dx is overwritten.
"""

import math

import numpy as np
from numba import njit, prange

from ._checks import check_array
from .vecmath import tanhf

_ONE = np.float32(1.0)


@njit(cache=True, parallel=True)
def _softcap_forward_kernel(y, x, cap, inv):
    # y, x (n,) flat; cap, inv = 1/cap in x's dtype
    for i in prange(x.size):
        y[i] = cap * tanhf(x[i] * inv)


@njit(cache=True, parallel=True)
def _softcap_backward_kernel(dx, dy, y, inv):
    # dx, dy, y (n,) flat; dx may be dy
    for i in prange(y.size):
        t = y[i] * inv  # tanh(x / cap)
        dx[i] = dy[i] * (_ONE - t * t)


def cap_scalars(cap, dtype):
    """(cap, 1/cap) as dtype scalars (1/cap rounded from the rounded cap, as ggml);
    ValueError unless cap is a finite number > 0."""
    if not (isinstance(cap, (int, float, np.floating, np.integer)) and math.isfinite(cap)
            and cap > 0):
        raise ValueError(f"softcap: cap must be a finite number > 0, got {cap!r}")
    dt = np.dtype(dtype).type
    return dt(cap), dt(1) / dt(cap)


def _check_all(cap, **arrays):
    first = next(iter(arrays.values()))
    if not isinstance(first, np.ndarray) or first.dtype not in (np.float32, np.float64):
        raise ValueError(f"softcap: {next(iter(arrays))} must be a float32 or float64 array")
    for name, a in arrays.items():
        check_array("softcap", name, a, first.shape, first.dtype)
    return cap_scalars(cap, first.dtype)


def softcap_forward(y, x, cap):
    """y = cap * tanh(x / cap) (overwritten; y may be x); x any shape, C-contiguous."""
    c, inv = _check_all(cap, y=y, x=x)
    _softcap_forward_kernel(y.reshape(-1), x.reshape(-1), c, inv)


def softcap_backward(dx, dy, y, cap):
    """dx = dy * (1 - (y / cap)^2) = dL/dx (overwritten; dx may be dy); y the forward's output."""
    _, inv = _check_all(cap, dx=dx, dy=dy, y=y)
    _softcap_backward_kernel(dx.reshape(-1), dy.reshape(-1), y.reshape(-1), inv)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def softcap_forward_ref(y, x, cap):
    y[...] = cap * np.tanh(x / cap)


def softcap_backward_ref(dx, dy, y, cap):
    dx[...] = dy * (1 - (y / cap) ** 2)
