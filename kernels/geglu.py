"""GeGLU gate of the gemma feed-forward block, forward and backward (numba + numpy refs).

    h = gelu(g) * u,   gelu(x) = 0.5 x (1 + tanh(a)),   a = sqrt(2/pi) (x + 0.044715 x^3)

with g = x @ W_gate and u = x @ W_up (the tanh approximation of GELU). Mirrors
llama.cpp's `ggml_geglu_split` as ggml computes it without its lookup table
(ggml-cpu vec.h `ggml_vec_geglu_f32` in the `#else` branch:
`ggml_gelu_f32(x) * g`, `ggml_gelu_f32(x) = 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f
+ GELU_COEF_A*x*x)))`), in that order of float32 operations, with vecmath's
vectorized float32 tanh (within 1.2 ulp of tanhf; libm's tanhf made this kernel 18x
slower than SwiGLU's, 9.8 ns an element on two Zen 3 cores).

ggml's CPU build defines GGML_GELU_FP16 by default and then looks gelu up in a
65536-entry table instead: x <= -10 gives 0, x >= 10 gives x, anything between is
rounded to float16, looked up, and the table holds gelu of that float16 rounded to
float16 again. Against the formula above that is off by up to 1.2e-4 for x in
(-3, 0), 5.0e-4 for |x| < 1, 2.0e-3 for |x| < 4 and 3.9e-3 (one float16 ulp of
the result) for |x| < 10; for x > 0 the relative difference stays under 1.0e-3
(measured over 4e6 evenly spaced float32 inputs in [-10, 10]). We keep the exact
formula: it is what ggml's GPU backends and its non-table CPU build compute, and
its derivative is smooth.

Backward (both overwritten), with t = tanh(a):
    gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    dg = dh * u * gelu'(g)
    du = dh * gelu(g)
Same calling convention as `swiglu`: outputs first; each element is read before
it is written, so h may be g or u, and dg/du may alias dh, g or u element for element.
"""

import numpy as np
from numba import njit, prange

from ._checks import check_gate
from .dequant import _get, _kept
from .scalar import gelu, gelu_grad, gelu_tanh_arg
from .vecmath import tanhf



@njit(cache=True, parallel=True)
def _geglu_forward_kernel(h, g, u, g16, u16):
    # h, g, u (N, F), g and u float or bf16 bits; g16, u16: as swiglu's
    N, F = g.shape
    for n in prange(N):
        for f in range(F):
            x = _kept(g16, (n, f), _get(g, (n, f)))
            h[n, f] = gelu(x, tanhf(gelu_tanh_arg(x))) * _kept(u16, (n, f), _get(u, (n, f)))


@njit(cache=True, parallel=True)
def _geglu_backward_kernel(dg, du, dh, g, u):
    # dg, du (N, F) =, dh, g, u (N, F); each element is read before it is written
    N, F = g.shape
    for n in prange(N):
        for f in range(F):
            x = _get(g, (n, f))
            t = tanhf(gelu_tanh_arg(x))
            d = dh[n, f]
            dg[n, f] = d * _get(u, (n, f)) * gelu_grad(x, t)
            du[n, f] = d * gelu(x, t)


def geglu_forward(h, g, u, g16=None, u16=None):
    """h (N, F) = gelu_tanh(g) * u (overwritten); g, u, g16, u16 as in swiglu_forward."""
    check_gate("geglu", dict(h=h, g=g, u=u, g16=g16, u16=u16))
    _geglu_forward_kernel(h, g, u, g16, u16)


def geglu_backward(dg, du, dh, g, u):
    """dg, du (N, F) = dL/dg, dL/du (overwritten); dh, g, u (N, F), g and u as in the forward."""
    check_gate("geglu", dict(dg=dg, du=du, dh=dh, g=g, u=u))
    _geglu_backward_kernel(dg, du, dh, g, u)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def _gelu_ref(x):
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * x * (1 + t), t


def geglu_forward_ref(h, g, u):
    h[:] = _gelu_ref(g)[0] * u


def geglu_backward_ref(dg, du, dh, g, u):
    gelu, t = _gelu_ref(g)
    dgelu = 0.5 * (1 + t) + 0.5 * g * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * g**2)
    dg[:] = dh * u * dgelu
    du[:] = dh * gelu
