"""SwiGLU gate on the GPU, forward and backward (float32; CPU twin and numpy
references: ``llamatune.kernels.swiglu``).

    out = silu(g) * u,  silu(x) = x / (1 + exp(-x))
    dg = dout * u * s * (1 + g * (1 - s)),  du = dout * silu(g),  s = sigmoid(g)

One thread per element (flat index over the N*F values). expf on the device is
libdevice's ``__nv_expf`` (max 2 ulp), so the results agree with the CPU to
rounding. Each element is read before it is written: out may be g or u, and
dg/du may alias dout, g or u element for element.
"""
from __future__ import annotations

import math

import numpy as np

from ._common import cdiv, check_gate, cuda

_THREADS = 256
_ONE = np.float32(1.0)

__all__ = ["swiglu_forward", "swiglu_backward"]


@cuda.jit
def _swiglu_forward_kernel(out, g, u):
    # out, g, u (N, F)
    N, F = g.shape
    idx = cuda.grid(1)
    if idx < N * F:
        n = idx // F
        f = idx % F
        x = g[n, f]
        e = np.float32(math.exp(-x))
        out[n, f] = x / (_ONE + e) * u[n, f]


@cuda.jit
def _swiglu_backward_kernel(dg, du, dout, g, u):
    N, F = g.shape
    idx = cuda.grid(1)
    if idx < N * F:
        n = idx // F
        f = idx % F
        x = g[n, f]
        uu = u[n, f]
        d = dout[n, f]
        s = _ONE / (_ONE + np.float32(math.exp(-x)))
        dg[n, f] = d * uu * s * (_ONE + x * (_ONE - s))
        du[n, f] = d * x * s


def swiglu_forward(out, g, u) -> None:
    """out (N, F) = silu(g) * u; g, u (N, F); float32 device arrays."""
    N, F = check_gate("swiglu", dict(out=out, g=g, u=u))
    if N * F:
        _swiglu_forward_kernel[cdiv(N * F, _THREADS), _THREADS](out, g, u)


def swiglu_backward(dg, du, dout, g, u) -> None:
    """dg, du (N, F) = dL/dg, dL/du (overwritten); dout, g, u (N, F)."""
    N, F = check_gate("swiglu", dict(dg=dg, du=du, dout=dout, g=g, u=u))
    if N * F:
        _swiglu_backward_kernel[cdiv(N * F, _THREADS), _THREADS](dg, du, dout, g, u)
