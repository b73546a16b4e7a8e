"""The short causal depthwise convolution with SiLU of the gated delta-net layers
(Qwen3.5, Qwen3-Next), forward and backward (numba CPU kernels + numpy references).

    y[t, c] = sum_j w[c, j] x[t + j - (K - 1), c],   out = silu(y)     (K = 4 in the models)

with x = 0 before the sequence (training), or the K - 1 inputs of a decode state.
This is HF transformers' `causal_conv1d_fn` / `causal_conv1d_update` with
activation "silu" (modeling_qwen3_5.py: F.conv1d with groups = channels, padding
K - 1, the first T outputs), and llama.cpp's ggml_ssm_conv on the concatenation of
the conv state and the new tokens, then ggml_silu (src/models/qwen35.cpp,
delta-net-base.cpp `build_conv_state`). w (C, K) is HF's conv1d.weight (C, 1, K)
squeezed, and the GGUF's ssm_conv1d (ne = [K, C]).

Packed rows (training): `segments` (B, T) int32 sample ids, as attention's; an output
then reads only the inputs of its own sample (zeros before the sample's first token).

Decoding: `state` (B, K - 1, C) holds the K - 1 inputs before x, oldest first (llama.cpp
keeps the same K - 1 columns; HF keeps K); the forward reads it and then overwrites
it with the last K - 1 inputs of [state | x], for the next call.

The backward recomputes y (nothing saved): dy = dout * silu'(y),
dx[s, c] = sum_j w[c, j] dy[s + K - 1 - j, c], dw[c, j] += sum_t dy[t, c] x[t + j - (K - 1), c].
Gradient rule: dx overwritten, dw accumulated (+=), as rmsnorm's.
"""

import numpy as np
from numba import njit, prange

from ._checks import check_array
from .attention import segment_starts
from .vecmath import FASTMATH
from .vecmath import expf as _exp

_ROWS = 64  # rows (time steps of one batch row) per task


@njit(inline="always")
def _source(x, state, b, s):
    # row s of [state | x] along time, s = t + j - (K - 1) relative to x
    return x[b, s] if s >= 0 else state[b, state.shape[1] + s]


@njit(inline="always")
def _seen(starts, b, t, s):
    # whether output (b, t) reads input row s: within t's sample (or in the state, s < 0)
    return s < 0 or s >= starts[b, t]


@njit(inline="always")
def _preact(y, x, wt, state, starts, b, t):
    # y (C,) = the convolution's output before the SiLU at (b, t)
    K = wt.shape[0]
    y[:] = 0
    for j in range(K):
        if _seen(starts, b, t, t + j - (K - 1)):
            src = _source(x, state, b, t + j - (K - 1))
            for c in range(y.shape[0]):
                y[c] += wt[j, c] * src[c]


@njit(cache=True, parallel=True, fastmath=FASTMATH, error_model="numpy")
def _conv_forward_kernel(out, x, wt, state, starts):
    # out (B, T, C) = silu(y); wt (K, C) = w^T; state (B, K - 1, C) the inputs before x;
    # starts (B, T) the first row of each token's sample (zeros: one sample a row)
    B, T, C = x.shape
    n_blocks = (T + _ROWS - 1) // _ROWS
    for task in prange(B * n_blocks):
        b, t0 = task // n_blocks, (task % n_blocks) * _ROWS
        y = np.empty(C, x.dtype)
        for t in range(t0, min(T, t0 + _ROWS)):
            _preact(y, x, wt, state, starts, b, t)
            for c in range(C):
                out[b, t, c] = y[c] / (1 + _exp(-y[c]))


@njit(cache=True, parallel=True, fastmath=FASTMATH, error_model="numpy")
def _conv_dy_dw_kernel(d, dw, x, wt, state, starts):
    # d (B, T, C): dout in, dy = dout * silu'(y) out, silu'(y) = s (1 + y (1 - s)), s = sigmoid(y);
    # dw (C, K) += sum_t dy[t, c] x[t + j - (K - 1), c]: each task sums its rows into its own
    # float64 row of a scratch, and the rows are added in task order (independent of the
    # thread count)
    B, T, C = x.shape
    K = wt.shape[0]
    n_blocks = (T + _ROWS - 1) // _ROWS
    part = np.zeros((B * n_blocks, K, C))
    for task in prange(B * n_blocks):
        b, t0 = task // n_blocks, (task % n_blocks) * _ROWS
        y = np.empty(C, x.dtype)
        acc = part[task]
        for t in range(t0, min(T, t0 + _ROWS)):
            _preact(y, x, wt, state, starts, b, t)
            for c in range(C):
                sg = 1 / (1 + _exp(-y[c]))
                d[b, t, c] = d[b, t, c] * sg * (1 + y[c] * (1 - sg))
            for j in range(K):
                if _seen(starts, b, t, t + j - (K - 1)):
                    src = _source(x, state, b, t + j - (K - 1))
                    for c in range(C):
                        acc[j, c] += d[b, t, c] * src[c]
    for task in range(B * n_blocks):
        for j in range(K):
            for c in range(C):
                dw[c, j] += part[task, j, c]


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _conv_dx_kernel(d, wt, starts):
    # d (B, T, C): dy in, dx out, in place: dx[s] = sum_j wt[j] dy[s + K - 1 - j]. Each task
    # goes along its block of rows in increasing s: row s's dy is read before its dx is
    # written and no later row of the block needs it; the K - 1 rows after the block
    # (another task's) are copied first (halo), as they may be overwritten meanwhile.
    B, T, C = d.shape
    K = wt.shape[0]
    n_blocks = (T + _ROWS - 1) // _ROWS
    halo = np.zeros((B * n_blocks, max(K - 1, 1), C), d.dtype)
    for task in range(B * n_blocks):
        b, t1 = task // n_blocks, (task % n_blocks + 1) * _ROWS
        for u in range(t1, min(T, t1 + K - 1)):
            halo[task, u - t1] = d[b, u]
    for task in prange(B * n_blocks):
        b, t0 = task // n_blocks, (task % n_blocks) * _ROWS
        t1 = min(T, t0 + _ROWS)
        acc = np.empty(C, d.dtype)
        for s in range(t0, t1):
            acc[:] = 0
            for j in range(K):
                u = s + K - 1 - j
                if u < T and s >= starts[b, u]:  # x[s] is in output u's sample
                    src = d[b, u] if u < t1 else halo[task, u - t1]
                    for c in range(C):
                        acc[c] += wt[j, c] * src[c]
            d[b, s] = acc


def _check(x, w, state, name_state="state"):
    if not isinstance(x, np.ndarray) or x.ndim != 3 or x.dtype not in (np.float32, np.float64):
        raise ValueError("causal_conv: x must be a 3-D float32 or float64 array (B, T, C)")
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.shape[0] != x.shape[2] or w.shape[1] < 1:
        got = f"{w.dtype} {w.shape}" if isinstance(w, np.ndarray) else type(w).__name__
        raise ValueError(f"causal_conv: w must be a (C, K) array with C = {x.shape[2]}, got {got}")
    B, T, C = x.shape
    K = w.shape[1]
    check_array("causal_conv", "x", x, (B, T, C), x.dtype)
    check_array("causal_conv", "w", w, (C, K), x.dtype)
    if state is not None:
        check_array("causal_conv", name_state, state, (B, K - 1, C), x.dtype)
    return B, T, C, K


def _state_or_zeros(state, B, K, C, dtype):
    return np.zeros((B, K - 1, C), dtype) if state is None else state


def _starts(segments, state, B, T):
    """(B, T) int64 first row of each token's sample: zeros without segments."""
    if segments is None:
        return np.zeros((B, T), np.int64)
    if state is not None:
        raise ValueError("causal_conv: segments (packed rows, training) take no state")
    try:
        return segment_starts(segments, (B, T))
    except ValueError as e:
        raise ValueError(str(e).replace("attention:", "causal_conv:")) from None


def causal_conv_forward(out, x, w, state=None, segments=None):
    """out (B, T, C) = silu(causal depthwise conv of x (B, T, C) with w (C, K));
    state: None (zeros before x) or (B, K - 1, C), read and then overwritten with the
    last K - 1 inputs (decoding; module docstring); segments: None or (B, T) int32
    sample ids of packed rows (attention's), a sample's outputs then read only its own
    inputs (no state)."""
    B, T, C, K = _check(x, w, state)
    check_array("causal_conv", "out", out, x.shape, x.dtype)
    starts = _starts(segments, state, B, T)
    src = _state_or_zeros(state, B, K, C, x.dtype)
    _conv_forward_kernel(out, x, np.ascontiguousarray(w.T), src, starts)
    if state is not None and K > 1:
        state[...] = np.concatenate([state, x], axis=1)[:, -(K - 1):]


def causal_conv_backward(dx, dw, dout, x, w, state=None, segments=None):
    """dx (B, T, C) = dL/dx (overwritten); dw (C, K) += dL/dw; dout, x (B, T, C); w (C, K);
    state: None (zeros before x, training) or (B, K - 1, C), the forward's state as it
    was before the forward (read only); segments as the forward's."""
    B, T, C, K = _check(x, w, state)
    for name, a, shape in (("dx", dx, x.shape), ("dw", dw, w.shape), ("dout", dout, x.shape)):
        check_array("causal_conv", name, a, shape, x.dtype)
    starts = _starts(segments, state, B, T)
    src = _state_or_zeros(state, B, K, C, x.dtype)
    wt = np.ascontiguousarray(w.T)
    dx[...] = dout
    _conv_dy_dw_kernel(dx, dw, x, wt, src, starts)  # dx = dy
    _conv_dx_kernel(dx, wt, starts)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def _preact_ref(x, w, state, segments):
    """y, [state | x] and the masks (K, B, T, 1): output t reads tap j (its sample's rows)."""
    B, T, C = x.shape
    K = w.shape[1]
    xx = np.concatenate([np.zeros((B, K - 1, C), x.dtype) if state is None else state, x], axis=1)
    seen = np.ones((K, B, T, 1), bool)
    if segments is not None:
        for b in range(B):
            for t in range(T):
                for j in range(K):  # the rows t + j - (K - 1) of t's sample, ids compared
                    s = t + j - (K - 1)
                    seen[j, b, t] = s >= 0 and np.all(segments[b, s: t + 1] == segments[b, t])
    y = sum(w[:, j] * xx[:, j: j + T] * seen[j] for j in range(K))
    return y, xx, seen


def causal_conv_forward_ref(out, x, w, state=None, segments=None):
    y, xx, _ = _preact_ref(x, w, state, segments)
    out[...] = y / (1 + np.exp(-y))
    if state is not None and w.shape[1] > 1:
        state[...] = xx[:, -(w.shape[1] - 1):]


def causal_conv_backward_ref(dx, dw, dout, x, w, state=None, segments=None):
    T, K = x.shape[1], w.shape[1]
    y, xx, seen = _preact_ref(x, w, state, segments)
    sg = 1 / (1 + np.exp(-y))
    dy = dout * sg * (1 + y * (1 - sg))
    dxx = np.zeros_like(xx)
    for j in range(K):
        dxx[:, j: j + T] += w[:, j] * dy * seen[j]
        dw[:, j] += np.sum(dy * xx[:, j: j + T] * seen[j], axis=(0, 1))
    dx[...] = dxx[:, K - 1:]
