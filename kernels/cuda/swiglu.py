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

from ..scalar import silu, swiglu_dg
from ._common import cuda, launch_gate, thread_element

_ONE = np.float32(1.0)

__all__ = ["swiglu_forward", "swiglu_backward"]


@cuda.jit
def _swiglu_forward_kernel(out, g, u):
    # out, g, u (N, F)
    n, f = thread_element(g)
    if n < g.shape[0]:
        x = g[n, f]
        out[n, f] = silu(x, np.float32(math.exp(-x))) * u[n, f]


@cuda.jit
def _swiglu_backward_kernel(dg, du, dout, g, u):
    n, f = thread_element(g)
    if n < g.shape[0]:
        x = g[n, f]
        s = _ONE / (_ONE + np.float32(math.exp(-x)))  # sigmoid(g)
        d = dout[n, f]
        dg[n, f] = swiglu_dg(d, u[n, f], x, s)    # u read before dg is written
        du[n, f] = d * x * s


def swiglu_forward(out, g, u) -> None:
    """out (N, F) = silu(g) * u; g, u (N, F); float32 device arrays."""
    launch_gate("swiglu", _swiglu_forward_kernel, dict(out=out, g=g, u=u))


def swiglu_backward(dg, du, dout, g, u) -> None:
    """dg, du (N, F) = dL/dg, dL/du (overwritten); dout, g, u (N, F)."""
    launch_gate("swiglu", _swiglu_backward_kernel, dict(dg=dg, du=du, dout=dout, g=g, u=u))
