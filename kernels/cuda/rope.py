"""Rotary position embedding on the GPU, forward and backward (float32; CPU twin and
numpy references: ``llamatune.kernels.rope``).

ROPE_NORM (mode 0) rotates adjacent pairs (x[2i], x[2i+1]); ROPE_NEOX (mode 2)
rotates (x[i], x[i + n_rot/2]); dimensions >= n_rot pass through. The backward is
the rotation by -theta. cos/sin (T, n_rot//2) tables are the CPU's
``rope.rope_cache`` output copied to the device (computed once on the host, so
both backends rotate by the very same float32 angles); (B, T, n_rot//2) tables
give each row its own positions (packed rows, ``rope.rope_tables``).

One thread per (b, t, h, j) with j < D - n_rot/2: j < n_rot/2 rotates pair j
(reading both values before writing them, so out may be x), the others copy a
pass-through dimension (a no-op when in place).
"""
from __future__ import annotations

import numpy as np

from ..rope import table_shape
from ..scalar import rotate
from ._common import cdiv, check, check_ndim, cuda

ROPE_NORM = 0
ROPE_NEOX = 2
_THREADS = 128

__all__ = ["ROPE_NORM", "ROPE_NEOX", "rope_forward", "rope_backward"]


@cuda.jit(device=True)
def rotate_pair(out, x, cos, sin, b, t, j, n_rot, neox, inverse):
    # pair j of the head row x (1-D view) of token (b, t) rotated into out (may be x:
    # both values are read before either is written); shared with the fused kernels
    cb = b if cos.shape[0] > 1 else 0
    s = -sin[cb, t, j] if inverse else sin[cb, t, j]
    i0 = j if neox else 2 * j
    i1 = j + n_rot // 2 if neox else 2 * j + 1
    out[i0], out[i1] = rotate(x[i0], x[i1], cos[cb, t, j], s)


@cuda.jit
def _rope_kernel(out, x, cos, sin, n_rot, neox, inverse):
    # out, x (B, T, H, D), may alias; cos, sin (1 or B, T, n_rot//2): one table for
    # all rows, or one per row
    B, T, H, D = x.shape
    half = n_rot // 2
    W = D - half  # threads per head row
    idx = cuda.grid(1)
    if idx >= B * T * H * W:
        return
    j = idx % W
    row = idx // W
    h = row % H
    bt = row // H
    t = bt % T
    b = bt // T
    if j < half:
        rotate_pair(out[b, t, h], x[b, t, h], cos, sin, b, t, j, n_rot, neox, inverse)
    else:
        d = n_rot + (j - half)
        out[b, t, h, d] = x[b, t, h, d]


def _launch(out_name, out, x_name, x, cos, sin, n_rot, mode, inverse):
    B, T, H, D = check_ndim("rope", x_name, x, 4, np.float32)
    if n_rot <= 0 or n_rot % 2 or n_rot > D:
        raise ValueError(f"rope: n_rot must be even, > 0 and <= head size {D}, got {n_rot}")
    if mode not in (ROPE_NORM, ROPE_NEOX):
        raise ValueError(f"rope: mode must be ROPE_NORM (0) or ROPE_NEOX (2), got {mode}")
    check("rope", x_name, x, (B, T, H, D), np.float32)
    check("rope", out_name, out, (B, T, H, D), np.float32)
    shape = table_shape(x.shape, len(getattr(cos, "shape", ())), n_rot)
    check("rope", "cos", cos, shape, np.float32)
    check("rope", "sin", sin, shape, np.float32)
    if len(shape) == 2:
        cos, sin = cos.reshape(1, *shape), sin.reshape(1, *shape)
    n = B * T * H * (D - n_rot // 2)
    if n:
        _rope_kernel[cdiv(n, _THREADS), _THREADS](out, x, cos, sin, np.int64(n_rot),
                                                  mode == ROPE_NEOX, inverse)


def rope_forward(out, x, cos, sin, n_rot, mode) -> None:
    """out (B, T, H, D) = R(theta) x (out may be x); cos, sin (T, n_rot//2), or
    (B, T, n_rot//2) for per-token positions."""
    _launch("out", out, "x", x, cos, sin, n_rot, mode, False)


def rope_backward(dx, dout, cos, sin, n_rot, mode) -> None:
    """dx (B, T, H, D) = R(-theta) dout (overwritten; dx may be dout)."""
    _launch("dx", dx, "dout", dout, cos, sin, n_rot, mode, True)
