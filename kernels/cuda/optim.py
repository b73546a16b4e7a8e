"""Optimizer updates on flat 1-D parameter segments on the GPU (float32 arrays;
CPU twin and numpy references: ``llamatune.kernels.optim``).

* ``adamw_update`` / ``sgd_update``: one thread per element; the scalars are
  float64 and each result is rounded to float32 on store, as the CPU kernels.
* ``global_norm_sq``: sum of squares in float64 without a host round trip and
  without atomics (deterministic): pass 1, a grid of at most NORM_BLOCKS blocks,
  each striding over the array and tree-reducing into one partial sum;
  pass 2, one block adding the partials (in fixed order) into ``out[0]``
  (or onto it, with ``accumulate=True``, to add up several segments).
  ``out`` is a float64 device array of NORM_BUF = 1 + NORM_BLOCKS values: out[0]
  is the result, out[1:] the partial sums (scratch).
* ``scale_inplace``: g *= s (s a host scalar); ``clip_inplace``: the same with
  s = max_norm / (norm + 1e-6) computed on the device from out[0] = norm^2,
  only when norm > max_norm (the CPU trainer's ``clip_gradients`` rule), so
  clipping needs no host sync.
"""
from __future__ import annotations

import math

import numpy as np

from ..optim import adamw_bias_corrections
from ..scalar import adamw_step, sgd_step
from ._common import MAX_THREADS, block_sum, cdiv, check, check_ndim, cuda, float64

_THREADS = 256
NORM_BLOCKS = 256
"""Most blocks of the first pass of global_norm_sq (so at most that many partials)."""
NORM_BUF = 1 + NORM_BLOCKS
"""Length of global_norm_sq's float64 output/scratch buffer."""

__all__ = ["NORM_BUF", "adamw_update", "sgd_update", "global_norm_sq", "scale_inplace",
           "clip_inplace"]


@cuda.jit
def _adamw_kernel(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bc1, bc2):
    i = cuda.grid(1)
    if i < p.shape[0]:
        p[i], m[i], v[i] = adamw_step(p[i], g[i], m[i], v[i], lr, beta1, beta2, eps, weight_decay, bc1, bc2)


@cuda.jit
def _sgd_kernel(p, g, lr, weight_decay):
    i = cuda.grid(1)
    if i < p.shape[0]:
        p[i] = sgd_step(p[i], g[i], lr, weight_decay)


@cuda.jit
def _norm_partial_kernel(out, g):
    # grid n_blocks <= NORM_BLOCKS, block _THREADS: out[1 + block] = sum of squares of
    # the elements block, block + n_blocks*_THREADS, ... (grid stride)
    tid = cuda.threadIdx.x
    buf = cuda.shared.array(MAX_THREADS, float64)
    s = 0.0
    for i in range(cuda.grid(1), g.shape[0], cuda.gridDim.x * cuda.blockDim.x):
        gi = float64(g[i])
        s += gi * gi
    s = block_sum(buf, tid, s)
    if tid == 0:
        out[1 + cuda.blockIdx.x] = s


@cuda.jit
def _norm_final_kernel(out, n_parts, accumulate):
    # one block of NORM_BLOCKS threads: out[0] (+)= sum(out[1:1 + n_parts])
    tid = cuda.threadIdx.x
    buf = cuda.shared.array(NORM_BLOCKS, float64)
    s = out[1 + tid] if tid < n_parts else 0.0
    s = block_sum(buf, tid, s)
    if tid == 0:
        out[0] = out[0] + s if accumulate else s


@cuda.jit
def _scale_kernel(g, s):
    i = cuda.grid(1)
    if i < g.shape[0]:
        g[i] *= s


@cuda.jit
def _clip_kernel(g, norm_sq, max_norm):
    i = cuda.grid(1)
    if i < g.shape[0]:
        norm = math.sqrt(norm_sq[0])
        if max_norm > 0 and norm > max_norm:
            g[i] *= np.float32(max_norm / (norm + 1e-6))


def _check_flat(**arrays):
    first_name, first = next(iter(arrays.items()))
    (n,) = check_ndim("optim", first_name, first, 1, np.float32)
    for name, a in arrays.items():
        check("optim", name, a, (n,), np.float32)
    return n


def _grid(n):
    return cdiv(n, _THREADS), _THREADS


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, t) -> None:
    """AdamW step t (>= 1) in place on p, m, v (n,) from gradient g (n,)."""
    n = _check_flat(p=p, g=g, m=m, v=v)
    bc1, bc2 = adamw_bias_corrections(beta1, beta2, t)
    if n:
        _adamw_kernel[_grid(n)](p, g, m, v, float(lr), float(beta1), float(beta2), float(eps),
                                float(weight_decay), bc1, bc2)


def sgd_update(p, g, lr, weight_decay) -> None:
    """p (n,) -= lr * (g + weight_decay * p), in place; g (n,)."""
    n = _check_flat(p=p, g=g)
    if n:
        _sgd_kernel[_grid(n)](p, g, float(lr), float(weight_decay))


def global_norm_sq(out, g, accumulate: bool = False) -> None:
    """out[0] = sum(g**2) in float64 (+= with accumulate=True), on the device.

    out: float64 device array (NORM_BUF,), out[1:] used as scratch; g (n,) float32.
    Read the result with ``out[:1].copy_to_host()`` (one sync) or feed it to
    ``clip_inplace``."""
    n = _check_flat(g=g)
    check("optim", "out", out, (NORM_BUF,), np.float64)
    n_blocks = max(1, min(NORM_BLOCKS, cdiv(n, _THREADS)))
    _norm_partial_kernel[n_blocks, _THREADS](out, g)
    _norm_final_kernel[1, NORM_BLOCKS](out, n_blocks, bool(accumulate))


def scale_inplace(g, s) -> None:
    """g (n,) *= s (a host scalar, rounded to float32), in place."""
    n = _check_flat(g=g)
    if n:
        _scale_kernel[_grid(n)](g, np.float32(s))


def clip_inplace(g, norm_sq, max_norm) -> None:
    """Gradient clipping without a host sync: with norm = sqrt(norm_sq[0]) (the
    ``global_norm_sq`` buffer), g *= float32(max_norm / (norm + 1e-6)) when
    max_norm > 0 and norm > max_norm, else g is left as it is."""
    n = _check_flat(g=g)
    (k,) = check_ndim("optim", "norm_sq", norm_sq, 1, np.float64)
    if k < 1:
        raise ValueError("optim: norm_sq must hold norm^2 in its element 0")
    if n:
        _clip_kernel[_grid(n)](g, norm_sq, float(max_norm))
