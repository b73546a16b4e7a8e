"""GeGLU gate on the GPU, forward and backward (float32; CPU twin and numpy
references: ``llamatune.kernels.geglu``, whose docstring says how this formula
relates to ggml's table-lookup GELU).

    h = gelu(g) * u,  gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    dg = dh * u * gelu'(g),  du = dh * gelu(g)
    gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),  t = tanh(.)

One thread per element (flat index over the N*F values). tanhf on the device is
libdevice's ``__nv_tanhf``, so the results agree with the CPU to rounding. Each
element is read before it is written: h may be g or u, and dg/du may alias dh,
g or u element for element.
"""
from __future__ import annotations

import math

import numpy as np

from ..scalar import gelu, gelu_grad, gelu_tanh_arg
from ._common import cuda, launch_gate, thread_element

__all__ = ["geglu_forward", "geglu_backward"]


@cuda.jit(device=True)
def _tanh_of(x):
    # t = tanh(sqrt(2/pi) x (1 + 0.044715 x^2)), ggml_gelu_f32's operation order
    return np.float32(math.tanh(gelu_tanh_arg(x)))


@cuda.jit
def _geglu_forward_kernel(h, g, u):
    # h, g, u (N, F)
    n, f = thread_element(g)
    if n < g.shape[0]:
        x = g[n, f]
        h[n, f] = gelu(x, _tanh_of(x)) * u[n, f]


@cuda.jit
def _geglu_backward_kernel(dg, du, dh, g, u):
    n, f = thread_element(g)
    if n < g.shape[0]:
        x = g[n, f]
        t = _tanh_of(x)
        d = dh[n, f]
        dg[n, f] = d * u[n, f] * gelu_grad(x, t)  # u read before dg is written
        du[n, f] = d * gelu(x, t)


def geglu_forward(h, g, u) -> None:
    """h (N, F) = gelu_tanh(g) * u (overwritten); g, u (N, F); float32 device arrays."""
    launch_gate("geglu", _geglu_forward_kernel, dict(h=h, g=g, u=u))


def geglu_backward(dg, du, dh, g, u) -> None:
    """dg, du (N, F) = dL/dg, dL/du (overwritten); dh, g, u (N, F)."""
    launch_gate("geglu", _geglu_backward_kernel, dict(dg=dg, du=du, dh=dh, g=g, u=u))
