"""Softmax cross-entropy over the vocabulary, forward and backward (numba + numpy refs).

    loss_n = -log softmax(logits_n)[target_n] = -(l[t] - max - log(sum_j exp(l_j - max)))

The forward mirrors llama.cpp's `log_softmax` in tools/perplexity/perplexity.cpp:
the row max in float, the sum of expf(l - max) accumulated in double, and
logprob = (l[tok] - max) - log(sum) in double (rounded to float on store here).

Rows whose target is negative (padding / prompt tokens) get loss 0 and gradient 0.
The backward takes per-row weights (e.g. 1/number-of-counted-tokens for a mean):
    dlogits_n = weights_n * (softmax(logits_n) - onehot(target_n))      (overwritten)
and may run in place on the logits buffer (dlogits is logits).

`cross_entropy_forward_backward` does both in one pass over each row (one max,
one exp per logit instead of two of each), with the very operations of the two
kernels: its losses and gradient are bit-identical to forward then backward.
Training uses it; evaluation and perplexity use the forward alone.
"""

import numpy as np
from numba import njit, prange

from ._checks import check_array


@njit(cache=True, parallel=True)
def _ce_forward_kernel(losses, logits, targets):
    # losses (N,), logits (N, V), targets (N,) int64
    N, V = logits.shape
    for n in prange(N):
        tgt = targets[n]
        if tgt < 0:
            losses[n] = 0.0
        else:
            mx = logits[n, 0]
            for j in range(1, V):
                mx = max(mx, logits[n, j])
            tot = 0.0  # double accumulator of float exps, as llama-perplexity
            for j in range(V):
                tot += np.exp(logits[n, j] - mx)
            losses[n] = -((logits[n, tgt] - mx) - np.log(tot))


@njit(cache=True, parallel=True)
def _ce_backward_kernel(dlogits, logits, targets, weights):
    # dlogits (N, V) =, may alias logits; logits (N, V); targets (N,) int64; weights (N,)
    N, V = logits.shape
    for n in prange(N):
        tgt = targets[n]
        wn = weights[n]
        if tgt < 0 or wn == 0:
            for j in range(V):
                dlogits[n, j] = 0.0
        else:
            mx = logits[n, 0]
            for j in range(1, V):
                mx = max(mx, logits[n, j])
            # Store the unnormalised exps in dlogits: each logit is read before
            # its slot is overwritten, so aliasing dlogits with logits is safe.
            tot = 0.0
            for j in range(V):
                e = np.exp(logits[n, j] - mx)
                dlogits[n, j] = e
                tot += e
            k = wn / tot
            for j in range(V):
                dlogits[n, j] = dlogits[n, j] * k
            dlogits[n, tgt] -= wn


@njit(cache=True, parallel=True)
def _ce_forward_backward_kernel(losses, dlogits, logits, targets, weights):
    # losses (N,), dlogits (N, V) = (may alias logits), logits (N, V), targets (N,) int64, weights (N,)
    N, V = logits.shape
    for n in prange(N):
        tgt = targets[n]
        wn = weights[n]
        if tgt < 0:
            losses[n] = 0.0
            for j in range(V):
                dlogits[n, j] = 0.0
            continue
        lt = logits[n, tgt]  # read before its slot is overwritten
        mx = logits[n, 0]
        for j in range(1, V):
            mx = max(mx, logits[n, j])
        tot = 0.0  # double accumulator of float exps, as the forward
        for j in range(V):
            e = np.exp(logits[n, j] - mx)
            dlogits[n, j] = e
            tot += e
        losses[n] = -((lt - mx) - np.log(tot))
        if wn == 0:
            for j in range(V):
                dlogits[n, j] = 0.0
        else:
            k = wn / tot
            for j in range(V):
                dlogits[n, j] = dlogits[n, j] * k
            dlogits[n, tgt] -= wn


def _check(name, a, shape, dtype):
    check_array("cross_entropy", name, a, shape, dtype)


def _check_logits_targets(logits, targets):
    if not (isinstance(logits, np.ndarray) and logits.ndim == 2 and logits.shape[1] > 0
            and logits.dtype in (np.float32, np.float64)):
        raise ValueError("cross_entropy: logits must be a 2-D float32 or float64 array (N, V)")
    N, V = logits.shape
    _check("logits", logits, (N, V), logits.dtype)
    _check("targets", targets, (N,), np.int64)
    if N and targets.max() >= V:
        raise ValueError(f"cross_entropy: target {targets.max()} out of range for "
                         f"vocabulary size {V}")


def cross_entropy_forward(losses, logits, targets):
    """losses (N,) = -log softmax(logits)[targets] (0 where target < 0); logits (N, V)."""
    _check_logits_targets(logits, targets)
    _check("losses", losses, targets.shape, logits.dtype)
    _ce_forward_kernel(losses, logits, targets)


def cross_entropy_backward(dlogits, logits, targets, weights):
    """dlogits (N, V) = weights[:, None] * (softmax(logits) - onehot(targets)), overwritten.

    Rows with target < 0 or weight 0 get 0. dlogits may be logits (in place).
    """
    _check_logits_targets(logits, targets)
    _check("dlogits", dlogits, logits.shape, logits.dtype)
    _check("weights", weights, targets.shape, logits.dtype)
    _ce_backward_kernel(dlogits, logits, targets, weights)


def cross_entropy_forward_backward(losses, dlogits, logits, targets, weights):
    """cross_entropy_forward and cross_entropy_backward in one pass, bit-identical to
    the two: losses (N,) and dlogits (N, V), which may be logits (in place)."""
    _check_logits_targets(logits, targets)
    _check("losses", losses, targets.shape, logits.dtype)
    _check("dlogits", dlogits, logits.shape, logits.dtype)
    _check("weights", weights, targets.shape, logits.dtype)
    _ce_forward_backward_kernel(losses, dlogits, logits, targets, weights)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def _log_softmax_ref(logits):
    mx = logits.max(axis=1, keepdims=True)
    tot = np.exp(logits - mx).astype(np.float64).sum(axis=1, keepdims=True)
    return (logits - mx) - np.log(tot)  # (N, V) float64


def cross_entropy_forward_ref(losses, logits, targets):
    rows = np.arange(len(targets))
    logp = _log_softmax_ref(logits)[rows, np.maximum(targets, 0)]
    losses[:] = np.where(targets < 0, 0.0, -logp)


def cross_entropy_backward_ref(dlogits, logits, targets, weights):
    w = np.where(targets < 0, 0.0, weights.astype(np.float64))  # (N,)
    grad = np.exp(_log_softmax_ref(logits)) * w[:, None]
    rows = np.flatnonzero(targets >= 0)
    grad[rows, targets[rows]] -= w[rows]
    dlogits[:] = grad


def cross_entropy_forward_backward_ref(losses, dlogits, logits, targets, weights):
    logits = logits.copy()  # dlogits may be logits
    cross_entropy_forward_ref(losses, logits, targets)
    cross_entropy_backward_ref(dlogits, logits, targets, weights)
