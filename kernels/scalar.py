"""Scalar maths written once for the numba CPU kernels and their CUDA twins (kernels/cuda/).

Each function is a `numba.extending.register_jitable`: numba compiles it into the
kernel that calls it, an `@njit` CPU kernel (LLVM inlines it there, and the loop around
it still vectorizes) or a `@cuda.jit` kernel (a device function; under the CUDA
simulator it runs as the Python function it is). A formula fixed here is fixed on
both backends. They are not `inline="always"`: numba-cuda cannot lower numba's
IR-inlined overloads. No fastmath: an expression moved here computes the bits it
computed in place, in the same order and types, so call them from kernels without
fastmath (LLVM would not contract or regroup across the call as it does in the caller).

The transcendental functions stay with the callers, which pass their results in:
the CPU has vecmath's vectorizable expf/tanhf, the GPU libdevice's.
"""
import math

import numpy as np
from numba.extending import register_jitable

# float32 constants keep float32 maths in float32 and promote exactly under float64
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)  # ggml's SQRT_2_OVER_PI
_COEF_A = np.float32(0.044715)  # ggml's GELU_COEF_A
_COEF_3A = np.float32(3 * 0.044715)  # d/dx of x * (1 + A x^2)


# ---------------------------------------------------------------- rmsnorm, rope
@register_jitable
def inv_rms(mean, eps):
    """1.0f / sqrtf(mean + eps): rmsnorm's scale from the row's mean square (float32
    in, float32 out; float64 in float64 finite-difference tests)."""
    return _ONE / math.sqrt(mean + eps)


@register_jitable
def rotate(x0, x1, c, s):
    """Rope's rotation of the pair (x0, x1) by the angle of cos c, sin s (sin negated:
    the backward): (x0 c - x1 s, x0 s + x1 c)."""
    return x0 * c - x1 * s, x0 * s + x1 * c


# ---------------------------------------------------------------- gates
@register_jitable
def silu(x, e):
    """silu(x) = x / (1 + e), e = exp(-x) (ggml_silu_f32)."""
    return x / (_ONE + e)


@register_jitable
def swiglu_dg(d, u, x, s):
    """dL/dg of h = silu(g) u: d u s (1 + g (1 - s)), d = dL/dh, s = sigmoid(g)."""
    return d * u * s * (_ONE + x * (_ONE - s))


@register_jitable
def gelu_tanh_arg(x):
    """sqrt(2/pi) x (1 + 0.044715 x^2), the argument of tanh in ggml_gelu_f32 (its order)."""
    return _SQRT_2_OVER_PI * x * (_ONE + _COEF_A * x * x)


@register_jitable
def gelu(x, t):
    """0.5 x (1 + t), t = tanh(gelu_tanh_arg(x))."""
    return _HALF * x * (_ONE + t)


@register_jitable
def gelu_grad(x, t):
    """gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)."""
    return _HALF * (_ONE + t) + _HALF * x * (_ONE - t * t) * _SQRT_2_OVER_PI * (_ONE + _COEF_3A * x * x)


# ---------------------------------------------------------------- optimizers
@register_jitable
def adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bc1, bc2):
    """One element's AdamW update: (p, m, v) after it, from the float64 scalars
    (bc1 = 1 - beta1^t, bc2 = 1 - beta2^t); the caller rounds each on store."""
    mi = beta1 * m + (1.0 - beta1) * g
    vi = beta2 * v + (1.0 - beta2) * g * g
    return p - lr * ((mi / bc1) / (math.sqrt(vi / bc2) + eps) + weight_decay * p), mi, vi


@register_jitable
def sgd_step(p, g, lr, weight_decay):
    """One element's SGD update: p - lr (g + weight_decay p)."""
    return p - lr * (g + weight_decay * p)
