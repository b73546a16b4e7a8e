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

from ._common import cdiv, check_gate, cuda

_THREADS = 256
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
_COEF_A = np.float32(0.044715)
_COEF_3A = np.float32(3 * 0.044715)

__all__ = ["geglu_forward", "geglu_backward"]


@cuda.jit(device=True)
def _tanh_of(x):
    # t = tanh(sqrt(2/pi) x (1 + 0.044715 x^2)), ggml_gelu_f32's operation order
    return np.float32(math.tanh(_SQRT_2_OVER_PI * x * (_ONE + _COEF_A * x * x)))


@cuda.jit
def _geglu_forward_kernel(h, g, u):
    # h, g, u (N, F)
    N, F = g.shape
    idx = cuda.grid(1)
    if idx < N * F:
        n = idx // F
        f = idx % F
        x = g[n, f]
        h[n, f] = _HALF * x * (_ONE + _tanh_of(x)) * u[n, f]


@cuda.jit
def _geglu_backward_kernel(dg, du, dh, g, u):
    N, F = g.shape
    idx = cuda.grid(1)
    if idx < N * F:
        n = idx // F
        f = idx % F
        x = g[n, f]
        uu = u[n, f]
        d = dh[n, f]
        t = _tanh_of(x)
        dgelu = _HALF * (_ONE + t) + _HALF * x * (_ONE - t * t) * _SQRT_2_OVER_PI * (
            _ONE + _COEF_3A * x * x)
        dg[n, f] = d * uu * dgelu
        du[n, f] = d * (_HALF * x * (_ONE + t))


def geglu_forward(h, g, u) -> None:
    """h (N, F) = gelu_tanh(g) * u (overwritten); g, u (N, F); float32 device arrays."""
    N, F = check_gate("geglu", dict(h=h, g=g, u=u))
    if N * F:
        _geglu_forward_kernel[cdiv(N * F, _THREADS), _THREADS](h, g, u)


def geglu_backward(dg, du, dh, g, u) -> None:
    """dg, du (N, F) = dL/dg, dL/du (overwritten); dh, g, u (N, F)."""
    N, F = check_gate("geglu", dict(dg=dg, du=du, dh=dh, g=g, u=u))
    if N * F:
        _geglu_backward_kernel[cdiv(N * F, _THREADS), _THREADS](dg, du, dh, g, u)
