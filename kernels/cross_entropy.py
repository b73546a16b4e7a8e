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
one exp per logit), which training uses; `cross_entropy_backward` is the same
kernel with its losses dropped. Its exps are vecmath's vectorized float32
polynomial (within 3 ulp of expf) and its row sum is regrouped: float32 sums of
1024 exps, each in 16 fixed lanes, added in double, and the gradient scaled in float
(the loops run 8-wide where double arithmetic ran them 4-wide, 16.3 -> 9.2 ms for
512 x 32000 logits on two Zen 3 cores, 27.1 -> 14.2 on one). The lanes, not LLVM's
reassociation, make the sum vectorize, so its order is fixed by the code (left to
LLVM, it differed between a kernel numba had just compiled and the same kernel
loaded from its disk cache). Its losses
agree with the forward's to float rounding, not bit for bit; the forward alone,
which perplexity uses, keeps libm's expf and llama-perplexity's order. (Validation
losses come from the fused kernel, so they equal training's bit for bit.)
"""

import numba
import numpy as np
from numba import njit, prange

from ._checks import check_array
from .dequant import _f32_to_bf16
from .vecmath import FASTMATH, expf, row_max


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


_CHUNK = np.uint64(1024)  # exps summed in the row's type before their sum joins the double
_LANES = np.uint64(16)    # the chunk sum's fixed lanes
_ROW_FLAGS = FASTMATH - {"reassoc"}  # no sum left to LLVM to regroup (_exp_lane_sum)


@njit(inline="always")
def _ce_row(dst, src, tgt, wn, lanes):
    # dst[:] = wn * (softmax(src) - onehot(tgt)) (0 when wn == 0), row src (V,) read
    # before each slot of dst (which may be src) is written; returns the row's loss.
    # The row max in eight chains and the float32 exp by vecmath's polynomial, both
    # vectorized; the sum of the exps in double, as the forward, over sums in the
    # row's type of _CHUNK exps, each in _LANES lanes (lanes: scratch of _LANES).
    V = np.uint64(src.shape[0])
    lt = src[tgt]
    mx = row_max(src, np.uint64(0), V)
    tot = 0.0
    for c in range(np.uint64(0), V, _CHUNK):
        tot += _exp_lane_sum(dst, src, mx, c, min(c + _CHUNK, V), lanes)
    if wn == 0:
        for j in range(V):
            dst[j] = 0.0
    else:
        k = dst.dtype.type(wn / tot)  # in the row's type, so the loop below runs 8-wide
        for j in range(V):
            dst[j] = dst[j] * k
        dst[tgt] -= wn
    return -((lt - mx) - np.log(tot))


@njit(inline="always")
def _exp_lane_sum(dst, src, mx, lo, hi, lanes):
    # dst[j] = expf(src[j] - mx) for j in [lo, hi), and their sum in a fixed order:
    # lane l adds those of j = lo + l, lo + l + 16, ... (elementwise across lanes, which
    # LLVM vectorizes without reassociating), then the lanes in order, then the tail.
    # A sum left to LLVM to regroup ('reassoc') came out grouped one way in a kernel
    # numba had just compiled and another in the same kernel loaded from its disk
    # cache: a run that compiled its kernels and a resumed run that loaded them
    # differed in the last bits.
    lanes[:] = 0.0
    j = lo
    while j + _LANES <= hi:
        for lane in range(_LANES):
            e = expf(src[j + lane] - mx)
            dst[j + lane] = e
            lanes[lane] += e
        j += _LANES
    s = lanes[0]
    for lane in range(np.uint64(1), _LANES):
        s += lanes[lane]
    for t in range(j, hi):
        e = expf(src[t] - mx)
        dst[t] = e
        s += e
    return s


@njit(cache=True, parallel=True, fastmath=_ROW_FLAGS)
def _ce_forward_backward_kernel(losses, dlogits, logits, targets, weights):
    # losses (N,), dlogits (N, V) = (not logits: see _inplace), logits (N, V), targets (N,) int64, weights (N,)
    N, V = logits.shape
    lanes = np.empty((N, _LANES), logits.dtype)      # each row's own, for _exp_lane_sum
    for n in prange(N):
        if targets[n] < 0:
            losses[n] = 0.0
            dlogits[n, :] = 0.0
        else:
            losses[n] = _ce_row(dlogits[n], logits[n], targets[n], weights[n], lanes[n])


@njit(cache=True, parallel=True, fastmath=_ROW_FLAGS)
def _ce_forward_backward_inplace_kernel(losses, logits, targets, weights):
    # the same with dlogits = logits: one array, so LLVM sees each slot read then
    # written (two arrays that may alias would send it to its scalar fallback)
    N, V = logits.shape
    lanes = np.empty((N, _LANES), logits.dtype)
    for n in prange(N):
        if targets[n] < 0:
            losses[n] = 0.0
            logits[n, :] = 0.0
        else:
            row = logits[n]
            losses[n] = _ce_row(row, row, targets[n], weights[n], lanes[n])


# ---------------------------------------------------------------- column blocks, bf16 gradient
# The training head with bf16 products (train/head.py) multiplies the head W (V, C) a
# block of `width` rows at a time; each block's logits land contiguous where oneDNN
# writes them fastest (a column slice of (n, V) logits ran at 0.4-0.5x its rate, or
# needed a copy). "Column blocks": block b, the columns [lo, hi) = [b*width,
# min(V, (b+1)*width)), is the (n, hi - lo) C-order array at logits[n*lo : n*hi] of the
# flat buffer. The gradient, which only feeds the bf16 product dx += g W, is written
# as bf16 bits over the logits it came from: row r of block b in the first half of
# that row's own float32 slots (so no row's write touches another row's logits), i.e.
# the (n, w) bits with row stride 2w at logits.view(uint16)[2*n*lo : 2*n*hi].


def column_block(logits: np.ndarray, n: int, lo: int, hi: int) -> np.ndarray:
    """Block [lo, hi) of column-blocked logits (flat float32): an (n, hi - lo) array."""
    return logits[n * lo: n * hi].reshape(n, hi - lo)


def column_block_grad(logits: np.ndarray, n: int, lo: int, hi: int) -> np.ndarray:
    """The bf16 gradient cross_entropy_blocked wrote over block [lo, hi): an (n, hi - lo)
    uint16 view with rows 2 (hi - lo) apart."""
    w = hi - lo
    return logits.view(np.uint16)[2 * n * lo: 2 * n * hi].reshape(n, 2 * w)[:, :w]


@njit(inline="always")
def _block_row(n, V, width, r, lo):
    # where row r of the column block starting at column lo begins in the flat logits
    return n * lo + r * min(width, V - lo)


@njit(inline="always")
def _ce_blocked_row(logits, ex, lanes, n, V, width, r, tgt):
    # row r of column-blocked logits: its exps into ex (V,); returns (loss, sum of exps),
    # each block's share summed as _ce_row sums a row (float32 sums of _CHUNK exps in
    # fixed lanes, added in double)
    u = np.uint64
    mx = logits[_block_row(n, V, width, r, 0)]
    for lo in range(0, V, width):
        at = _block_row(n, V, width, r, lo)
        mx = max(mx, row_max(logits, u(at), u(at + min(width, V - lo))))
    lo_t = tgt // width * width
    lt = logits[_block_row(n, V, width, r, lo_t) + tgt - lo_t]
    tot = 0.0
    for lo in range(0, V, width):
        w = min(width, V - lo)
        at = _block_row(n, V, width, r, lo)
        seg, dst = logits[at: at + w], ex[lo: lo + w]
        for c in range(u(0), u(w), _CHUNK):
            tot += _exp_lane_sum(dst, seg, mx, c, min(c + _CHUNK, u(w)), lanes)
    return -((lt - mx) - np.log(tot)), tot


@njit(cache=True, parallel=True, fastmath=_ROW_FLAGS)
def _ce_blocked_kernel(losses, logits, bits, n, width, targets, weights, grad, workers):
    # losses (n,); logits flat (n*V,) in column blocks, bits its uint16 view (the
    # gradient's place); rows dealt to `workers` in contiguous runs, each worker with
    # its own (V,) row of exps (L2-resident: logits are read twice, the gradient
    # written once, as bf16)
    V = logits.shape[0] // n
    exps = np.empty((workers, V), logits.dtype)
    lanes = np.empty((workers, _LANES), logits.dtype)
    per = (n + workers - 1) // workers
    for t in prange(workers):
        ex = exps[t]
        for r in range(t * per, min(n, (t + 1) * per)):
            tgt = targets[r]
            k = logits.dtype.type(0.0)
            wn = weights[r]
            if tgt < 0:
                losses[r] = 0.0
            else:
                loss, tot = _ce_blocked_row(logits, ex, lanes[t], n, V, width, r, tgt)
                losses[r] = loss
                if wn != 0:
                    k = logits.dtype.type(wn / tot)
            if not grad:
                continue
            for lo in range(0, V, width):
                w = np.uint64(min(width, V - lo))       # unsigned: see vecmath.row_max
                at, ul = np.uint64(2 * _block_row(n, V, width, r, lo)), np.uint64(lo)
                if k == 0:                          # no target or weight 0: gradient 0
                    for j in range(np.uint64(0), w):
                        bits[at + j] = 0
                else:
                    for j in range(np.uint64(0), w):
                        bits[at + j] = _f32_to_bf16(ex[ul + j] * k)
            if k != 0:
                lo = tgt // width * width
                bits[2 * _block_row(n, V, width, r, lo) + tgt - lo] = _f32_to_bf16(ex[tgt] * k - wn)


def cross_entropy_blocked(losses, logits, width, targets, weights, grad=True):
    """Cross-entropy of n = len(targets) rows of column-blocked logits (flat float32,
    blocks of `width` columns: column_block), as cross_entropy_forward_backward: losses
    (n,) and, with `grad`, the gradient weights * (softmax - onehot) rounded to bf16
    over the logits (column_block_grad reads it). The losses agree with
    cross_entropy_forward_backward's on the same logits to float rounding."""
    n = targets.shape[0] if isinstance(targets, np.ndarray) and targets.ndim == 1 else -1
    if not (isinstance(logits, np.ndarray) and logits.ndim == 1 and logits.dtype == np.float32
            and logits.flags.c_contiguous and n > 0 and logits.size % n == 0 and logits.size):
        raise ValueError("cross_entropy: blocked logits must be a flat C-contiguous float32 array "
                         "of n x V values (n = len(targets) > 0)")
    V = logits.size // n
    if not (isinstance(width, (int, np.integer)) and width > 0):
        raise ValueError(f"cross_entropy: width must be an integer > 0, got {width!r}")
    _check("targets", targets, (n,), np.int64)
    _check("losses", losses, (n,), np.float32)
    _check("weights", weights, (n,), np.float32)
    if targets.max() >= V:
        raise ValueError(f"cross_entropy: target {targets.max()} out of range for vocabulary size {V}")
    _ce_blocked_kernel(losses, logits, logits.view(np.uint16), n, int(width), targets, weights, bool(grad),
                       max(1, min(n, numba.get_num_threads())))


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
    _forward_backward(np.empty(targets.shape, logits.dtype), dlogits, logits, targets, weights)


def cross_entropy_forward_backward(losses, dlogits, logits, targets, weights):
    """cross_entropy_forward and cross_entropy_backward in one pass: losses (N,) and
    dlogits (N, V), which may be logits (in place)."""
    _check_logits_targets(logits, targets)
    _check("losses", losses, targets.shape, logits.dtype)
    _check("dlogits", dlogits, logits.shape, logits.dtype)
    _check("weights", weights, targets.shape, logits.dtype)
    _forward_backward(losses, dlogits, logits, targets, weights)


def _forward_backward(losses, dlogits, logits, targets, weights):
    if dlogits.ctypes.data == logits.ctypes.data:    # checked C-contiguous, same shape: the same array
        _ce_forward_backward_inplace_kernel(losses, logits, targets, weights)
    elif np.shares_memory(dlogits, logits):
        raise ValueError("cross_entropy: dlogits must be logits itself or not overlap it")
    else:
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


def unblock(logits, n, width):
    """(n, V) logits in C order from column-blocked ones (flat)."""
    V = logits.size // n
    return np.concatenate([column_block(logits, n, lo, min(V, lo + width)) for lo in range(0, V, width)], axis=1)


def cross_entropy_blocked_ref(losses, logits, width, targets, weights):
    """losses, and the gradient's bf16 bits (n, V) uint16 in C order (of float64
    arithmetic, rounded once)."""
    from .bf16 import to_bf16_ref
    n = targets.shape[0]
    x = unblock(logits, n, width)
    cross_entropy_forward_ref(losses, x, targets)
    g = np.empty(x.shape, np.float64)
    cross_entropy_backward_ref(g, x, targets, weights.astype(np.float64))
    return to_bf16_ref(g.astype(np.float32))
