"""Softmax cross-entropy over the vocabulary on the GPU, forward and backward
(float32 logits; CPU twin and numpy references: ``llamatune.kernels.cross_entropy``).

    loss_n = -((l[t] - max) - log(sum_j exp(l_j - max)))
    dlogits_n = weights_n * (softmax(logits_n) - onehot(target_n))   (overwritten)

One thread block per row: a block max reduction (float32), then the sum of the
float32 exps in float64 (as llama-perplexity and the CPU kernel; block tree
order), then the loss / gradient. Rows with target < 0 get loss 0 and gradient 0
(and so do rows of weight 0 in the backward). dlogits may be logits: every thread
reads its logits before the barrier of the last reduction and then writes only
the entries it reads. `cross_entropy_forward_backward` computes the row statistics
once for both, as the CPU kernel of the same name.
"""
from __future__ import annotations

import math

import numpy as np

from ._common import (MAX_THREADS, block_max, block_sum, check, check_ndim, cuda, float32,
                      float64, row_threads)

__all__ = ["cross_entropy_forward", "cross_entropy_backward", "cross_entropy_forward_backward"]


@cuda.jit(device=True)
def _row_stats(logits, n, tid, fbuf, dbuf):
    """(max, sum of exp(l - max)) of row n, known to every thread."""
    V = logits.shape[1]
    mx = logits[n, 0]
    for j in range(tid, V, cuda.blockDim.x):
        mx = max(mx, logits[n, j])
    mx = block_max(fbuf, tid, mx)
    tot = 0.0
    for j in range(tid, V, cuda.blockDim.x):
        tot += math.exp(logits[n, j] - mx)
    tot = block_sum(dbuf, tid, tot)
    return mx, tot


@cuda.jit
def _ce_forward_kernel(losses, logits, targets):
    # grid N, block row_threads(V); losses (N,), logits (N, V), targets (N,) int64
    n = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    tgt = targets[n]
    if tgt < 0:  # uniform over the block: no barrier is skipped by only some threads
        if tid == 0:
            losses[n] = 0.0
        return
    fbuf = cuda.shared.array(MAX_THREADS, float32)
    dbuf = cuda.shared.array(MAX_THREADS, float64)
    mx, tot = _row_stats(logits, n, tid, fbuf, dbuf)
    if tid == 0:
        losses[n] = -((logits[n, tgt] - mx) - math.log(tot))


@cuda.jit
def _ce_backward_kernel(dlogits, logits, targets, weights):
    # grid N, block row_threads(V); dlogits (N, V) =, may be logits
    n = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    V = logits.shape[1]
    tgt = targets[n]
    wn = weights[n]
    if tgt < 0 or wn == 0:
        for j in range(tid, V, cuda.blockDim.x):
            dlogits[n, j] = 0.0
        return
    fbuf = cuda.shared.array(MAX_THREADS, float32)
    dbuf = cuda.shared.array(MAX_THREADS, float64)
    mx, tot = _row_stats(logits, n, tid, fbuf, dbuf)
    k = wn / tot
    for j in range(tid, V, cuda.blockDim.x):
        g = math.exp(logits[n, j] - mx) * k
        if j == tgt:
            g -= wn
        dlogits[n, j] = g


@cuda.jit
def _ce_forward_backward_kernel(losses, dlogits, logits, targets, weights):
    # grid N, block row_threads(V); losses (N,), dlogits (N, V) = (may be logits)
    n = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    V = logits.shape[1]
    tgt = targets[n]
    wn = weights[n]
    if tgt < 0:
        if tid == 0:
            losses[n] = 0.0
        for j in range(tid, V, cuda.blockDim.x):
            dlogits[n, j] = 0.0
        return
    lt = logits[n, tgt]  # read by thread 0 before any thread writes (the reductions' barriers)
    fbuf = cuda.shared.array(MAX_THREADS, float32)
    dbuf = cuda.shared.array(MAX_THREADS, float64)
    mx, tot = _row_stats(logits, n, tid, fbuf, dbuf)
    if tid == 0:
        losses[n] = -((lt - mx) - math.log(tot))
    k = wn / tot
    for j in range(tid, V, cuda.blockDim.x):
        g = 0.0
        if wn != 0:
            g = math.exp(logits[n, j] - mx) * k
            if j == tgt:
                g -= wn
        dlogits[n, j] = g


def _check_logits_targets(logits, targets):
    N, V = check_ndim("cross_entropy", "logits", logits, 2, np.float32)
    if V == 0:
        raise ValueError("cross_entropy: logits must have at least one column")
    check("cross_entropy", "logits", logits, (N, V), np.float32)
    check("cross_entropy", "targets", targets, (N,), np.int64)
    return N, V


def cross_entropy_forward(losses, logits, targets) -> None:
    """losses (N,) = -log softmax(logits)[targets] (0 where target < 0).

    logits (N, V) float32, targets (N,) int64 in [-inf, V) (not range-checked on
    the device: that would need a host sync), losses (N,) float32."""
    N, V = _check_logits_targets(logits, targets)
    check("cross_entropy", "losses", losses, (N,), np.float32)
    if N:
        _ce_forward_kernel[N, row_threads(V)](losses, logits, targets)


def cross_entropy_backward(dlogits, logits, targets, weights) -> None:
    """dlogits (N, V) = weights[:, None] * (softmax(logits) - onehot(targets)),
    overwritten; rows with target < 0 or weight 0 get 0; dlogits may be logits."""
    N, V = _check_logits_targets(logits, targets)
    check("cross_entropy", "dlogits", dlogits, (N, V), np.float32)
    check("cross_entropy", "weights", weights, (N,), np.float32)
    if N:
        _ce_backward_kernel[N, row_threads(V)](dlogits, logits, targets, weights)


def cross_entropy_forward_backward(losses, dlogits, logits, targets, weights) -> None:
    """cross_entropy_forward and cross_entropy_backward at once (dlogits may be logits)."""
    N, V = _check_logits_targets(logits, targets)
    check("cross_entropy", "losses", losses, (N,), np.float32)
    check("cross_entropy", "dlogits", dlogits, (N, V), np.float32)
    check("cross_entropy", "weights", weights, (N,), np.float32)
    if N:
        _ce_forward_backward_kernel[N, row_threads(V)](losses, dlogits, logits, targets, weights)
