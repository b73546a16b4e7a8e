"""Causal grouped-query softmax attention on the GPU, forward and backward
(float32; CPU twin and numpy references: ``llamatune.kernels.attention``).

    out_i = sum_j P_ij v_j,  P_ij = softmax_j(s_ij),  s_ij = q_i . k_j * scale

over keys j <= n_past + i; query head h reads kv head h // (NH // NKV). The options
of the CPU twin (see its docstring) are here too: `scale` (None: 1/sqrt(HS)),
`softcap` > 0 (s_ij = softcap * tanh(q_i . k_j * scale / softcap), and dS times
scale * (1 - tanh^2) in the backward), `window` > 0 (sliding window: also
n_past + i - j < window) and, for packed training rows, `segments` (B, T) int32
sample ids whose runs must be contiguous (the CPU twin's `segment_starts` checks
that on the host): query i sees the keys [start_i, i], start_i the first token of
its sample, found on the device by `_starts_kernel`.

The layout is the CPU twin's, with every product a cuBLAS batched matmul (CuPy)
and the softmax rows numba-cuda kernels:
* q, k, v (and in the backward dout) are first copied into head-major buffers:
  q as (B*NKV, T*G, HS), the G query heads of a kv head interleaved row by row
  (row t*G + g is query t of head kvh*G + g), k and v as (B*NKV, S, HS). So every
  kv head's K and V meet all G of its query heads in one product, and a block of
  query rows [i0, i1) is the contiguous rows [i0*G, i1*G) of each batch matrix.
* queries go in blocks of `block_q` rows; block [i0, i1) meets only the keys
  [j0, n_past + i1), j0 the first key its first row can see (0, or where its
  sliding window starts), which skips most of the masked upper triangle. Its
  scores are one (B*NKV, TQ*G, W) buffer: Q K^T, then `_softmax_kernel` (one thread
  block per row: soft-cap, mask, max, exp, sum, normalize, the log-sum-exp saved
  for the backward; 0 outside the row's visible keys), then P V.
* the backward recomputes P = exp(s - lse) from the saved lse and
  D_i = rowsum(dout_i * out_i): per block Q K^T and dout V^T, then
  `_softmax_backward_kernel` (P, and dS = P * (dP - D) * ds/d(q.k)), then
  dq = dS K, dk^T += Q^T dS and dv^T += dout^T P, the group sum done by the product
  (its inner dimension runs over the G interleaved heads; transposed, so the large
  dS and P are the untransposed operand, which CuPy does not copy). All gradients are
  overwritten; nothing uses atomics, so results are deterministic.
The query block is sized so each score buffer stays under SCORE_FLOATS floats and
the causal waste of the diagonal blocks is at most a quarter (at least four
blocks once T >= 4 * MIN_BLOCK); the buffers come from CuPy's memory pool, and the
blocks run last first (`_blocks`), so the pool grows by one block's key-sized
buffers. The kernels are built per (packed, capped), so the plain path has neither
branch; the GPU memory estimate counts `scratch_floats`.
Products run in float32, or TF32 after `llamatune.backend.set_tf32`.

Arrays: float32 device arrays (CuPy, numba DeviceNDArray or anything exporting
``__cuda_array_interface__``; numpy host arrays are refused). They are viewed as
CuPy arrays without a copy; under the simulator (``NUMBA_ENABLE_CUDASIM=1``) the
products are numpy's on the simulator arrays' memory, so the whole path runs in CI.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from numba import int32

from ..attention import attention_options
from ._common import (MAX_THREADS, SIM, block_max, block_sum, cdiv, check, check_ndim, cuda,
                      float32, row_threads)

SCORE_FLOATS = 1 << 25  # 128 MiB per score buffer (the backward holds two)
MIN_BLOCK = 64          # query rows of a block when the budget allows

__all__ = ["attention_forward", "attention_backward", "query_block", "scratch_floats"]


# ------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def _row(starts, packed, b, t, p, j0, window):
    """(lo, hi): the block-local visible keys [lo, hi) of query t of row b at
    absolute position p, the block's keys starting at key j0."""
    first = 0
    if packed:
        first = starts[b, t]
    if window > 0:
        first = max(first, p - window + 1)
    return max(first - j0, 0), p + 1 - j0


@cuda.jit(device=True)
def _score_row(att, lse, i0):
    """(bk, r, b, h, t) of this thread block's score row: batch matrix bk = b * NKV +
    kv head, row r = (t - i0) * G + g, query t of query head h = kv head * G + g."""
    r = cuda.blockIdx.x
    bk = cuda.blockIdx.y
    NKV = att.shape[0] // lse.shape[0]
    G = lse.shape[1] // NKV
    return bk, r, bk // NKV, (bk % NKV) * G + r % G, i0 + r // G


@lru_cache(maxsize=None)
def _softmax_kernel(packed: bool, capped: bool):
    NEG_INF = float32(-math.inf)

    @cuda.jit
    def kernel(att, lse, starts, i0, j0, n_past, scale, cap, kcap, window):
        # grid (TQ * G, B * NKV), block a power of two <= MAX_THREADS;
        # att (B*NKV, TQ*G, W): raw scores q.k in, P out; lse (B, NH, T) out
        bk, r, b, h, t = _score_row(att, lse, i0)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        W = att.shape[2]
        p = n_past + t
        lo, hi = _row(starts, packed, b, t, p, j0, window)
        buf = cuda.shared.array(MAX_THREADS, float32)
        mx = NEG_INF
        for j in range(lo + tid, hi, nt):
            if capped:
                s = cap * float32(math.tanh(att[bk, r, j] * kcap))
                att[bk, r, j] = s
            else:
                s = att[bk, r, j] * scale
            mx = max(mx, s)
        mx = block_max(buf, tid, mx)
        tot = float32(0.0)
        for j in range(lo + tid, hi, nt):  # the entries this thread wrote above
            s = att[bk, r, j] if capped else att[bk, r, j] * scale
            e = float32(math.exp(s - mx))
            att[bk, r, j] = e
            tot += e
        tot = block_sum(buf, tid, tot)  # its barriers publish every thread's exps
        inv = float32(1.0) / tot
        for j in range(tid, W, nt):
            if lo <= j and j < hi:
                att[bk, r, j] *= inv
            else:
                att[bk, r, j] = 0.0
        if tid == 0:
            lse[b, h, t] = mx + float32(math.log(tot))

    return kernel


@lru_cache(maxsize=None)
def _softmax_backward_kernel(packed: bool, capped: bool):
    @cuda.jit
    def kernel(att, dp, lse, dd, starts, i0, j0, scale, cap, kcap, window):
        # grid (TQ * G, B * NKV); att (B*NKV, TQ*G, W): raw scores q.k in, P out;
        # dp (same): dout.v in, dS out; lse (B, NH, T); dd (B, T, NH) rowsum(dout * out)
        bk, r, b, h, t = _score_row(att, lse, i0)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        W = att.shape[2]
        lo, hi = _row(starts, packed, b, t, t, j0, window)
        lse_i = lse[b, h, t]
        d = dd[b, t, h]
        for j in range(tid, W, nt):
            if lo <= j and j < hi:
                if capped:
                    th = float32(math.tanh(att[bk, r, j] * kcap))
                    s = cap * th
                    ds = scale - scale * th * th
                else:
                    s = att[bk, r, j] * scale
                    ds = scale
                pr = float32(math.exp(s - lse_i))
                att[bk, r, j] = pr
                dp[bk, r, j] = pr * (dp[bk, r, j] - d) * ds
            else:
                att[bk, r, j] = 0.0
                dp[bk, r, j] = 0.0

    return kernel


@cuda.jit
def _starts_kernel(starts, seg):
    # grid cdiv(B, 32), block 32: starts[b, t] = the first token of t's run of ids
    b = cuda.grid(1)
    if b < seg.shape[0]:
        first = int32(0)
        for t in range(seg.shape[1]):
            if t > 0 and seg[b, t] != seg[b, t - 1]:
                first = t
            starts[b, t] = first


# ---------------------------------------------------------------- Python API
def _xp(a):
    """(array module, a as an array of it): CuPy and a zero-copy CuPy view of a
    device array; under the simulator numpy and the simulator array's memory."""
    if SIM:
        return np, getattr(a, "_ary", a)
    import cupy
    return cupy, cupy.asarray(a)


def _dev(x):
    """An array of `_xp` as a kernel argument (the simulator's wrapper over the same
    memory: numba would copy a numpy argument in and back out)."""
    if SIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(x)
    return x


def _check_qkv(q, k, v, S, kv_contiguous=True):
    B, T, NH, HS = check_ndim("attention", "q", q, 4, np.float32)
    Bk, Sk, NKV, HSk = check_ndim("attention", "k", k, 4, np.float32)
    if NKV < 1 or NH % NKV:
        raise ValueError(f"attention: query heads {NH} must be a multiple of kv heads {NKV}")
    check("attention", "q", q, (B, T, NH, HS), np.float32)
    check("attention", "k", k, (B, S, NKV, HS), np.float32, contiguous=kv_contiguous)
    check("attention", "v", v, (B, S, NKV, HS), np.float32, contiguous=kv_contiguous)
    return B, T, NH, NKV, HS


def _check_segments(segments, B, T, n_past):
    if segments is None:
        return
    if n_past:
        raise ValueError(f"attention: segments need n_past = 0 (training), got {n_past}")
    check("attention", "segments", segments, (B, T), np.int32)


def query_block(B: int, NH: int, T: int, S: int) -> int:
    """Query rows per block: T/4 rounded up (at least MIN_BLOCK, at most T), fewer
    where a (B*NH, rows, S) score buffer would pass SCORE_FLOATS (at least 1)."""
    rows = min(T, max(MIN_BLOCK, cdiv(T, 4)))
    return max(1, min(rows, SCORE_FLOATS // max(1, B * NH * S)))


def scratch_floats(B: int, T: int, NH: int, NKV: int, HS: int) -> int:
    """The most float32s a training call (the backward; its forward holds less) has
    allocated at once: head-major copies of q, dout (and dout * out, summed into D),
    k, v; D; dk, dv transposed; two score buffers; a block's product outputs and the
    copies CuPy makes of non-contiguous operands (at most a q block and a k slice)."""
    N, bq = B * T, query_block(B, NH, T, T)
    return (N * (3 * NH * HS + 4 * NKV * HS + NH) + 2 * B * NH * bq * T
            + 2 * B * NH * bq * HS + 2 * B * NKV * T * HS)


def _starts(xp, segments, B, T):
    """The (B, T) int32 first-token index of each token's sample (a 1 x 1 stand-in,
    never read, without segments: a kernel launch cannot take None)."""
    if segments is None:
        return _dev(xp.zeros((1, 1), np.int32))
    starts = xp.empty((B, T), np.int32)
    _starts_kernel[cdiv(B, 32), 32](_dev(starts), segments)
    return _dev(starts)


def _group_major(xp, a, B, NKV):
    """(B, T, NKV*G, HS) -> contiguous (B*NKV, T*G, HS): head-major, a kv head's
    query heads interleaved row by row."""
    _, T, NH, HS = a.shape
    G = NH // NKV
    return xp.ascontiguousarray(a.reshape(B, T, NKV, G, HS).transpose(0, 2, 1, 3, 4)).reshape(
        B * NKV, T * G, HS)


def _to_rows(dst, src, B, NKV, i0, i1):
    """dst (B, T, NH, HS)[:, i0:i1] = the group-major block src (B*NKV, (i1-i0)*G, HS)."""
    _, T, NH, HS = dst.shape
    G = NH // NKV
    dst.reshape(B, T, NKV, G, HS)[:, i0:i1] = src.reshape(B, NKV, i1 - i0, G, HS).transpose(
        0, 2, 1, 3, 4)


def _blocks(T, n_past, window, block_q):
    """[(i0, i1, j0)]: query block [i0, i1) computes the keys [j0, n_past + i1); the
    last block first. Its buffers that scale with the keys (CuPy's copies of key
    slices, the dk and dv products) are the largest, and the later blocks' fit in
    the pool memory they leave free, so the pool grows by one block's, not by all."""
    out = []
    for i0 in range(0, T, block_q):
        j0 = max(0, n_past + i0 - window + 1) if window > 0 else 0
        out.append((i0, min(T, i0 + block_q), j0))
    return out[::-1]


def attention_forward(out, lse, q, k, v, n_past, segments=None, *, scale=None, softcap=0.0,
                      window=0, block_q=None, threads=None) -> None:
    """Causal GQA attention for T new queries after n_past cached positions.

    out (B, T, NH, HS); lse (B, NH, T) saved log-sum-exp; q (B, T, NH, HS);
    k, v (B, S, NKV, HS) with S = n_past + T (may be [:, :S] slices of a cache:
    any strides). float32 device arrays. segments: None, or (B, T) int32 sample
    ids of packed rows (n_past = 0; contiguous runs, see the module docstring).
    scale (None: 1/sqrt(HS)), softcap (> 0: tanh soft-capping of the scores) and
    window (> 0: sliding-window mask) as in the CPU twin.
    block_q / threads override the query rows per block and the threads per
    softmax row (tests: small blocks exercise the block loop on tiny shapes)."""
    if n_past < 0:
        raise ValueError(f"attention: n_past must be >= 0, got {n_past}")
    T = q.shape[1] if len(getattr(q, "shape", ())) == 4 else 0
    B, T, NH, NKV, HS = _check_qkv(q, k, v, n_past + T, kv_contiguous=False)
    check("attention", "out", out, (B, T, NH, HS), np.float32)
    check("attention", "lse", lse, (B, NH, T), np.float32)
    _check_segments(segments, B, T, n_past)
    scale, cap, kcap = attention_options(np.float32, HS, scale, softcap, window)
    if B * T * NH == 0:
        return
    S, G = n_past + T, NH // NKV
    xp, outx = _xp(out)
    qg = _group_major(xp, _xp(q)[1], B, NKV)
    kb = xp.ascontiguousarray(_xp(k)[1].transpose(0, 2, 1, 3)).reshape(B * NKV, S, HS)
    vb = xp.ascontiguousarray(_xp(v)[1].transpose(0, 2, 1, 3)).reshape(B * NKV, S, HS)
    starts = _starts(xp, segments, B, T)
    bq = block_q or query_block(B, NH, T, S)
    scratch = xp.empty(B * NKV * bq * G * S, np.float32)
    kernel = _softmax_kernel(segments is not None, bool(cap))
    nt, lse_d = threads or row_threads(S), _dev(_xp(lse)[1])
    for i0, i1, j0 in _blocks(T, n_past, int(window), bq):
        W = n_past + i1 - j0
        att = scratch[: B * NKV * (i1 - i0) * G * W].reshape(B * NKV, (i1 - i0) * G, W)
        xp.matmul(qg[:, i0 * G:i1 * G], kb[:, j0:j0 + W].transpose(0, 2, 1), out=att)
        kernel[((i1 - i0) * G, B * NKV), nt](_dev(att), lse_d, starts, np.int64(i0),
                                             np.int64(j0), np.int64(n_past), scale, cap, kcap,
                                             np.int64(window))
        _to_rows(outx, xp.matmul(att, vb[:, j0:j0 + W]), B, NKV, i0, i1)


def attention_backward(dq, dk, dv, dout, q, k, v, out, lse, segments=None, *, scale=None,
                       softcap=0.0, window=0, block_q=None, threads=None) -> None:
    """Gradients of causal GQA attention for training (n_past = 0, S = T), overwritten.

    dq (B, T, NH, HS); dk, dv (B, T, NKV, HS) summed over each kv head's query
    heads; dout, q, out (B, T, NH, HS); k, v (B, T, NKV, HS); lse (B, NH, T);
    all C-contiguous float32 device arrays; segments, scale, softcap and window as
    in attention_forward. Overrides as attention_forward."""
    T = q.shape[1] if len(getattr(q, "shape", ())) == 4 else 0
    B, T, NH, NKV, HS = _check_qkv(q, k, v, T)
    for name, a in (("dq", dq), ("dout", dout), ("out", out)):
        check("attention", name, a, (B, T, NH, HS), np.float32)
    check("attention", "dk", dk, (B, T, NKV, HS), np.float32)
    check("attention", "dv", dv, (B, T, NKV, HS), np.float32)
    check("attention", "lse", lse, (B, NH, T), np.float32)
    _check_segments(segments, B, T, 0)
    scale, cap, kcap = attention_options(np.float32, HS, scale, softcap, window)
    if B * T * NH == 0:
        return
    G = NH // NKV
    xp, dqx = _xp(dq)
    doutx, outx = _xp(dout)[1], _xp(out)[1]
    qg, dog = _group_major(xp, _xp(q)[1], B, NKV), _group_major(xp, doutx, B, NKV)
    kb = xp.ascontiguousarray(_xp(k)[1].transpose(0, 2, 1, 3)).reshape(B * NKV, T, HS)
    vb = xp.ascontiguousarray(_xp(v)[1].transpose(0, 2, 1, 3)).reshape(B * NKV, T, HS)
    dd = (doutx * outx).sum(axis=3)  # (B, T, NH)
    dkt = xp.zeros((B * NKV, HS, T), np.float32)  # dk, dv transposed: dS and P stay the
    dvt = xp.zeros((B * NKV, HS, T), np.float32)  # right operand (CuPy copies a transposed one)
    starts = _starts(xp, segments, B, T)
    bq = block_q or query_block(B, NH, T, T)
    scratch = xp.empty((2, B * NKV * bq * G * T), np.float32)
    kernel = _softmax_backward_kernel(segments is not None, bool(cap))
    nt, lse_d, dd_d = threads or row_threads(T), _dev(_xp(lse)[1]), _dev(dd)
    for i0, i1, j0 in _blocks(T, 0, int(window), bq):
        W, rows = i1 - j0, slice(i0 * G, i1 * G)
        shape = (B * NKV, (i1 - i0) * G, W)
        att = scratch[0, : math.prod(shape)].reshape(shape)
        dp = scratch[1, : math.prod(shape)].reshape(shape)
        xp.matmul(qg[:, rows], kb[:, j0:i1].transpose(0, 2, 1), out=att)
        xp.matmul(dog[:, rows], vb[:, j0:i1].transpose(0, 2, 1), out=dp)
        kernel[((i1 - i0) * G, B * NKV), nt](_dev(att), _dev(dp), lse_d, dd_d, starts,
                                             np.int64(i0), np.int64(j0), scale, cap, kcap,
                                             np.int64(window))
        _to_rows(dqx, xp.matmul(dp, kb[:, j0:i1]), B, NKV, i0, i1)
        dkt[:, :, j0:i1] += xp.matmul(qg[:, rows].transpose(0, 2, 1), dp)
        dvt[:, :, j0:i1] += xp.matmul(dog[:, rows].transpose(0, 2, 1), att)
    _xp(dk)[1][...] = dkt.reshape(B, NKV, HS, T).transpose(0, 3, 1, 2)
    _xp(dv)[1][...] = dvt.reshape(B, NKV, HS, T).transpose(0, 3, 1, 2)
