"""gpt-oss's clamped SwiGLU gate of its experts, forward and backward (numba + numpy refs).

    x = min(g, limit);  y = clamp(u, -limit, limit)
    out = x * sigmoid(alpha x) * (y + 1)

with alpha 1.702 and limit 7.0. Mirrors llama.cpp's `ggml_swiglu_oai` (ggml-cpu ops.cpp
`ggml_compute_forward_swiglu_oai_f32`: `out_glu = x / (1.f + expf(alpha * (-x)))`,
`dst = out_glu * (y + 1.f)`; build_moe_ffn's LLM_FFN_SWIGLU_OAI_MOE with those constants)
and HF's `GptOssExperts._apply_gate` (gate and up taken from the interleaved gate_up).

Backward (both overwritten), with s = sigmoid(alpha x):
    dg = dout * (y + 1) * s * (1 + alpha x (1 - s))   where g < limit, else 0
    du = dout * x * s                                  where |u| < limit, else 0
(at the clamp's edge itself, where autograd's clamp passes the gradient, the one-sided
derivative is taken the same way: g == limit and |u| == limit pass it too).
"""

import numpy as np
from numba import njit, prange

from ._checks import check_gate

ALPHA = 1.702        # build_moe_ffn's LLM_FFN_SWIGLU_OAI_MOE; HF GptOssConfig.swiglu_alpha
LIMIT = 7.0          # ... swiglu_limit
_ONE = np.float32(1.0)


@njit(cache=True, parallel=True)
def _forward_kernel(out, g, u, alpha, limit):
    N, F = g.shape
    for n in prange(N):
        for f in range(F):
            x = min(g[n, f], limit)
            y = min(max(u[n, f], -limit), limit)
            out[n, f] = x / (_ONE + np.exp(alpha * (-x))) * (y + _ONE)


@njit(cache=True, parallel=True)
def _backward_kernel(dg, du, dout, g, u, alpha, limit):
    N, F = g.shape
    for n in prange(N):
        for f in range(F):
            gv, uv, d = g[n, f], u[n, f], dout[n, f]
            x = min(gv, limit)
            y = min(max(uv, -limit), limit)
            s = _ONE / (_ONE + np.exp(alpha * (-x)))
            dg[n, f] = d * (y + _ONE) * s * (_ONE + alpha * x * (_ONE - s)) if gv <= limit else d * 0
            du[n, f] = d * x * s if -limit <= uv <= limit else d * 0


def _constants(g):
    t = g.dtype.type
    return t(np.float32(ALPHA)), t(np.float32(LIMIT))


def swiglu_oai_forward(out, g, u):
    """out (N, F) = the clamped SwiGLU of g (gate) and u (up), (N, F) float32 or float64."""
    check_gate("swiglu_oai", dict(out=out, g=g, u=u))
    _forward_kernel(out, g, u, *_constants(g))


def swiglu_oai_backward(dg, du, dout, g, u):
    """dg, du (N, F) = dL/dg, dL/du (overwritten); dout, g, u (N, F)."""
    check_gate("swiglu_oai", dict(dg=dg, du=du, dout=dout, g=g, u=u))
    _backward_kernel(dg, du, dout, g, u, *_constants(g))


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def swiglu_oai_forward_ref(out, g, u):
    alpha, limit = _constants(g)
    x, y = np.minimum(g, limit), np.clip(u, -limit, limit)
    out[:] = x / (1 + np.exp(-alpha * x)) * (y + 1)


def swiglu_oai_backward_ref(dg, du, dout, g, u):
    alpha, limit = _constants(g)
    x, y = np.minimum(g, limit), np.clip(u, -limit, limit)
    s = 1 / (1 + np.exp(-alpha * x))
    dg[:] = np.where(g <= limit, dout * (y + 1) * s * (1 + alpha * x * (1 - s)), 0)
    du[:] = np.where(np.abs(u) <= limit, dout * x * s, 0)
