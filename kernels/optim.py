"""Optimizer updates on flat 1-D parameter segments (numba CPU kernels + numpy refs).

The caller keeps parameters, gradients and moments in flat buffers and calls an
update once per contiguous segment (so different segments can use different
learning rates or weight decay). All updates are in place.

* `adamw_update`: AdamW (Loshchilov & Hutter) with decoupled weight decay and bias
  correction, as llm.c's `adamw_kernel` (train_gpt2.c) / torch.optim.AdamW:
      m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
      p -= lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd * p)
  llama.cpp's old finetune (ggml.c `ggml_opt_adam`) does the same update with
  lr = alpha*sched, decaying only tensors with >= decay_min_ndim dimensions (the
  caller's choice per segment here) after clipping by the global gradient norm.
* `sgd_update`: p -= lr * (g + wd * p).
* `global_norm_sq` / `scale_inplace`: the two halves of gradient-norm clipping.

Scalars are applied in float64 and each result is rounded to the array dtype on store.
"""

import numpy as np
from numba import njit, prange

from .scalar import adamw_step, sgd_step


@njit(cache=True, parallel=True)
def _adamw_kernel(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bc1, bc2):
    # p, g, m, v (n,); bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
    for i in prange(p.shape[0]):
        p[i], m[i], v[i] = adamw_step(p[i], g[i], m[i], v[i], lr, beta1, beta2, eps, weight_decay, bc1, bc2)


@njit(cache=True, parallel=True)
def _sgd_kernel(p, g, lr, weight_decay):
    # p, g (n,)
    for i in prange(p.shape[0]):
        p[i] = sgd_step(p[i], g[i], lr, weight_decay)


@njit(cache=True, parallel=True)
def _norm_sq_kernel(g):
    # g (n,) -> sum of squares in float64 (prange reduction)
    s = 0.0
    for i in prange(g.shape[0]):
        gi = np.float64(g[i])
        s += gi * gi
    return s


@njit(cache=True, parallel=True)
def _scale_kernel(g, s):
    # g (n,) *= s, s in g's dtype
    for i in prange(g.shape[0]):
        g[i] *= s


def _check_flat(**arrays):
    first = next(iter(arrays.values()))
    if not isinstance(first, np.ndarray) or first.dtype not in (np.float32, np.float64):
        raise ValueError("optim: arrays must be float32 or float64 numpy arrays")
    for name, a in arrays.items():
        if not (isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype == first.dtype
                and a.shape == first.shape and a.flags.c_contiguous):
            got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"optim: {name} must be a contiguous 1-D {first.dtype} array "
                             f"of shape {first.shape[:1]}, got {got}")


def adamw_bias_corrections(beta1, beta2, t) -> tuple[float, float]:
    """(1 - beta1^t, 1 - beta2^t) of AdamW step t; ValueError unless t is an integer
    >= 1 and both betas lie in [0, 1). Shared with the CUDA kernels."""
    if int(t) != t or t < 1:
        raise ValueError(f"optim: adamw step t must be an integer >= 1, got {t}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"optim: adamw betas must lie in [0, 1), got {beta1}, {beta2}")
    return 1.0 - beta1 ** int(t), 1.0 - beta2 ** int(t)


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, t):
    """AdamW step t (>= 1) in place on p, m, v (n,), from gradient g (n,)."""
    _check_flat(p=p, g=g, m=m, v=v)
    bc1, bc2 = adamw_bias_corrections(beta1, beta2, t)
    _adamw_kernel(p, g, m, v, float(lr), float(beta1), float(beta2), float(eps),
                  float(weight_decay), bc1, bc2)


BF16_CHUNK = 1 << 18          # moments widened to f32 this many at a time (2 x 1 MiB, cache-resident)


def adamw_update_bf16(p, g, m, v, lr, beta1, beta2, eps, weight_decay, t):
    """adamw_update with the moments m, v kept as bf16 bits (uint16 (n,)): each chunk of
    them widened to f32, updated by the f32 kernel, rounded back to nearest even. The
    parameters move exactly as adamw_update moves them from the widened moments."""
    from . import bf16
    _check_flat(p=p, g=g)
    for name, a in (("m", m), ("v", v)):
        if not (isinstance(a, np.ndarray) and a.dtype == np.uint16 and a.shape == p.shape and a.flags.c_contiguous):
            raise ValueError(f"optim: {name} must be a contiguous 1-D uint16 (bf16) array of shape {p.shape[:1]}")
    n = p.shape[0]
    mf, vf = np.empty(min(n, BF16_CHUNK), np.float32), np.empty(min(n, BF16_CHUNK), np.float32)
    for lo in range(0, n, BF16_CHUNK):
        hi = min(n, lo + BF16_CHUNK)
        mc, vc = mf[: hi - lo], vf[: hi - lo]
        bf16.from_bf16(mc, m[lo:hi])
        bf16.from_bf16(vc, v[lo:hi])
        adamw_update(p[lo:hi], g[lo:hi], mc, vc, lr, beta1, beta2, eps, weight_decay, t)
        bf16.to_bf16(m[lo:hi], mc)
        bf16.to_bf16(v[lo:hi], vc)


def sgd_update(p, g, lr, weight_decay):
    """p (n,) -= lr * (g + weight_decay * p), in place; g (n,)."""
    _check_flat(p=p, g=g)
    _sgd_kernel(p, g, float(lr), float(weight_decay))


def global_norm_sq(g):
    """Sum of squares of g (n,), accumulated in float64; returns a Python float."""
    _check_flat(g=g)
    return float(_norm_sq_kernel(g))


def scale_inplace(g, s):
    """g (n,) *= s, in place (gradient clipping: s = max_norm / norm)."""
    _check_flat(g=g)
    _scale_kernel(g, g.dtype.type(s))


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def adamw_update_ref(p, g, m, v, lr, beta1, beta2, eps, weight_decay, t):
    g64 = g.astype(np.float64)
    m64 = beta1 * m + (1.0 - beta1) * g64
    v64 = beta2 * v + (1.0 - beta2) * g64 * g64
    mhat = m64 / (1.0 - beta1**t)
    vhat = v64 / (1.0 - beta2**t)
    p[:] = p - lr * (mhat / (np.sqrt(vhat) + eps) + weight_decay * p)
    m[:] = m64
    v[:] = v64


def sgd_update_ref(p, g, lr, weight_decay):
    p[:] = p - lr * (g.astype(np.float64) + weight_decay * p)


def global_norm_sq_ref(g):
    return float(np.sum(g.astype(np.float64) ** 2))


def scale_inplace_ref(g, s):
    g *= g.dtype.type(s)
