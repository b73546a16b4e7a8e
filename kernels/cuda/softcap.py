"""Soft-capping (tanh) of logits on the GPU, forward and backward (float32; CPU
twin and numpy references: ``llamatune.kernels.softcap``).

    y = cap * tanh(x * (1/cap))          dx = dy * (1 - (y * (1/cap))^2)

One thread per element over the flattened array (any shape, C-contiguous); 1/cap
is rounded to float32 on the host, as ggml's `ggml_scale(x, 1/cap)` does. In
place is allowed: y may be x, dx may be dy.
"""
from __future__ import annotations

import math

import numpy as np

from ..softcap import cap_scalars
from ._common import cdiv, check, cuda, describe, is_device_array

_THREADS = 256
_ONE = np.float32(1.0)

__all__ = ["softcap_forward", "softcap_backward"]


@cuda.jit
def _softcap_forward_kernel(y, x, cap, inv):
    # y, x (n,) flat
    i = cuda.grid(1)
    if i < x.size:
        y[i] = cap * np.float32(math.tanh(x[i] * inv))


@cuda.jit
def _softcap_backward_kernel(dx, dy, y, inv):
    # dx, dy, y (n,) flat; dx may be dy
    i = cuda.grid(1)
    if i < y.size:
        t = y[i] * inv
        dx[i] = dy[i] * (_ONE - t * t)


def _check_all(cap, **arrays):
    name, first = next(iter(arrays.items()))
    if not (is_device_array(first) and np.dtype(first.dtype) == np.float32):
        raise ValueError(f"softcap: {name} must be a float32 device array, got {describe(first)}")
    for name, a in arrays.items():
        check("softcap", name, a, first.shape, np.float32)
    return (int(np.prod(first.shape)), *cap_scalars(cap, np.float32))


def softcap_forward(y, x, cap) -> None:
    """y = cap * tanh(x / cap) (overwritten; y may be x); float32 device arrays, any shape."""
    n, c, inv = _check_all(cap, y=y, x=x)
    if n:
        _softcap_forward_kernel[cdiv(n, _THREADS), _THREADS](y.reshape(n), x.reshape(n), c, inv)


def softcap_backward(dx, dy, y, cap) -> None:
    """dx = dy * (1 - (y / cap)^2) = dL/dx (overwritten; dx may be dy); y the forward's output."""
    n, _, inv = _check_all(cap, dx=dx, dy=dy, y=y)
    if n:
        _softcap_backward_kernel[cdiv(n, _THREADS), _THREADS](dx.reshape(n), dy.reshape(n),
                                                             y.reshape(n), inv)
