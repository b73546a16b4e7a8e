"""SwiGLU gate of the llama feed-forward block, forward and backward (numba + numpy refs).

    out = silu(g) * u,   silu(x) = x / (1 + exp(-x)) = x * sigmoid(x)

with g = x @ W_gate and u = x @ W_up. Mirrors llama.cpp's `ggml_swiglu_split`
(ggml-cpu `ggml_vec_swiglu_f32`, scalar path `ggml_silu_f32(x) * g` with
`ggml_silu_f32(x) = x/(1.0f+expf(-x))`); ggml's SIMD path uses its own expf
approximation, and so does this kernel in float32 (vecmath.expf, vectorized; within
3 ulp of expf), so agreement with llama.cpp is to rounding, not bit for bit.

Backward (both overwritten):
    dg = dout * u * s * (1 + g * (1 - s)),   s = sigmoid(g)
    du = dout * silu(g)
"""

import numpy as np
from numba import njit, prange

from ._checks import check_gate
from .dequant import _get, _kept
from .scalar import silu, swiglu_dg
from .vecmath import expf

# A float32 one keeps float32 maths in float32 and promotes exactly under float64.
_ONE = np.float32(1.0)


@njit(cache=True, parallel=True)
def _swiglu_forward_kernel(out, g, u, g16, u16):
    # out, g, u (N, F), g and u float or bf16 bits; g16, u16 None, or (N, F) uint16 where
    # g and u are kept rounded to bf16 (and the gate computed from what is kept)
    N, F = g.shape
    for n in prange(N):
        for f in range(F):
            x = _kept(g16, (n, f), _get(g, (n, f)))
            out[n, f] = silu(x, expf(-x)) * _kept(u16, (n, f), _get(u, (n, f)))


@njit(cache=True, parallel=True)
def _swiglu_backward_kernel(dg, du, dout, g, u):
    # dg, du (N, F) =, dout, g, u (N, F); each element is read before it is written
    N, F = g.shape
    for n in prange(N):
        for f in range(F):
            x = _get(g, (n, f))
            s = _ONE / (_ONE + expf(-x))  # sigmoid(g)
            d = dout[n, f]
            dg[n, f] = swiglu_dg(d, _get(u, (n, f)), x, s)
            du[n, f] = d * x * s


def swiglu_forward(out, g, u, g16=None, u16=None):
    """out (N, F) = silu(g) * u; g, u (N, F) float, or bf16 bits (uint16, saved
    activations). g16, u16 (N, F) uint16: g and u (float32) rounded to bf16 are kept
    there, and out is computed from the rounded values (what backward will read)."""
    check_gate("swiglu", dict(out=out, g=g, u=u, g16=g16, u16=u16))
    _swiglu_forward_kernel(out, g, u, g16, u16)


def swiglu_backward(dg, du, dout, g, u):
    """dg, du (N, F) = dL/dg, dL/du (overwritten); dout, g, u (N, F), g and u as in the forward."""
    check_gate("swiglu", dict(dg=dg, du=du, dout=dout, g=g, u=u))
    _swiglu_backward_kernel(dg, du, dout, g, u)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def swiglu_forward_ref(out, g, u):
    out[:] = g / (1 + np.exp(-g)) * u


def swiglu_backward_ref(dg, du, dout, g, u):
    s = 1 / (1 + np.exp(-g))
    dg[:] = dout * u * s * (1 + g * (1 - s))
    du[:] = dout * g * s
