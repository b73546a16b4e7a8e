"""Causal grouped-query softmax attention on the GPU, forward and backward, tiled in
the flash-attention way (float32; CPU twin and numpy references:
``llamatune.kernels.attention``).

    out_i = sum_j P_ij v_j,  P_ij = softmax_j(s_ij),  s_ij = q_i . k_j * scale

over keys j <= n_past + i; query head h reads kv head h // (NH // NKV). The options
of the CPU twin (see its docstring) are here too: `scale` (None: 1/sqrt(HS)),
`softcap` > 0 (s_ij = softcap * tanh(q_i . k_j * scale / softcap), and dS times
scale * (1 - tanh^2) in the backward) and `window` > 0 (sliding window: also
n_past + i - j < window; the forward and dq kernels start at the first key tile
the window reaches, the dk/dv kernel stops at the last query tile that reaches its
keys). They are runtime arguments: the default path runs the same arithmetic as
before they existed. Packed rows
(training): with `segments` (B, T) int32 sample ids, whose runs must be contiguous
(the CPU twin's `segment_starts` checks that on the host), query i sees the keys
[start_i, i], start_i the first token of its sample; a token always sees itself,
so no row is empty. Each block finds the starts of its rows from `segments`
(`_tile_starts`, one thread), starts its key loop at the first tile its rows can
see, and the dk/dv blocks stop at the first query tile that sees none of their
keys. segments=None launches kernels compiled without any of this (`packed` is a
constant of each kernel factory, so its branches fold away); they take a 1 x 1 int32
array in the place of `seg` and never read it (numba-cuda compiles a None argument
but cannot launch with one).

Nothing of size T x S is ever stored: every kernel works on tiles in shared
memory and keeps per-row softmax statistics.

* forward: one block per (query tile of BR rows, b * NH + h). The block loads its
  Q tile, then walks over key tiles of BC keys up to the last key its rows can
  see: S = Q K^T * scale (masked entries -inf), online softmax (running max m and
  sum l per row, the accumulator rescaled by exp(m_old - m_new)), O += P V.
  Finally out = O / l and lse = m + log(l) (saved for the backward).
* backward (n_past = 0), two kernels, both recomputing P = exp(q.k*scale - lse)
  from the saved lse and D_i = rowsum(dout_i * out_i):
  - dq: one block per (query tile, b * NH + h), over the key tiles it sees:
    dS = P * (dout.v - D) * scale, dq += dS K;
  - dk, dv: one block per (key tile, b * NKV + kvh), over the G query heads of
    the kv head and the query tiles at or below the diagonal:
    dv += P^T dout, dk += dS^T q; the group sum happens inside the block, so there
    are no atomics and the result is deterministic.
  All gradients are overwritten.

Tile sizes are picked from the head size so the static shared memory stays under
48 KiB (HS <= 256; see ``tiles``); K/V tiles are padded by one float per row against bank
conflicts. Kernels are built per (HS, tile sizes, threads) on first use.
Limits (see the report / docs): float32 scores and accumulators, scalar FMA
loops over shared memory (no tensor cores), one kernel per query head (K/V tiles
are re-read by each head of a group), block of 128 threads; good enough for
LoRA fine-tuning of small models, not tuned against FlashAttention-2.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from numba import int32

from ..attention import attention_options
from ._common import cdiv, check, check_ndim, cuda, float32

NTHREADS = 128
MAX_HS = 256
_SMEM_BUDGET = 48 * 1024 - 256  # static shared memory per block (48 KiB limit without opt-in)

__all__ = ["attention_forward", "attention_backward", "tiles"]


def _smem_rows(HS, BR, BC):
    # forward / dq: two (BR, HS) row tiles, two padded (BC, HS+1) key tiles,
    # two (BR, BC) score tiles, four (BR,) vectors (one: the rows' sample starts)
    return 4 * (2 * BR * HS + 2 * BC * (HS + 1) + 2 * BR * BC + 4 * BR)


def _smem_keys(HS, BR, BC):
    # dk/dv: four padded (BC, HS+1) key tiles, two (BR, HS) row tiles, two (BR, BC)
    # score tiles, three (BR,) vectors
    return 4 * (4 * BC * (HS + 1) + 2 * BR * HS + 2 * BR * BC + 3 * BR)


def _pick(HS, smem):
    # largest tile area, then the most query rows, with BR <= BC
    sizes = (32, 16, 8, 4)
    cands = sorted(((BR * BC, BR, BC) for BR in sizes for BC in sizes if BR <= BC), reverse=True)
    for _, BR, BC in cands:
        if smem(HS, BR, BC) <= _SMEM_BUDGET:
            return BR, BC
    return 4, 4  # unreachable for HS <= MAX_HS


@lru_cache(maxsize=None)
def tiles(HS: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((BR, BC) of the forward and dq kernels, (BR, BC) of the dk/dv kernel) for
    head size HS: the power-of-two tiles (query rows BR <= keys BC <= 32) of the
    largest area whose static shared memory fits the budget. HS=64: (32, 32),
    (16, 32); HS=128: (16, 16), (8, 16); HS=256: (8, 8), (4, 8)."""
    return _pick(HS, _smem_rows), _pick(HS, _smem_keys)


# ------------------------------------------------------------------- forward
@lru_cache(maxsize=None)
def _forward_kernel(HS: int, BR: int, BC: int, packed: bool):
    HP = HS + 1  # padded row length of the K/V tiles
    NEG_INF = -math.inf

    @cuda.jit
    def kernel(out, lse, q, k, v, seg, n_past, scale, cap, kcap, window):
        # grid (ceil(T / BR), B * NH), block NTHREADS; seg (B, T) int32 when packed;
        # cap > 0: soft-capped scores (kcap = scale / cap); window > 0: sliding window
        T, NH = q.shape[1], q.shape[2]
        S, NKV = k.shape[1], k.shape[2]
        G = NH // NKV
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        b = cuda.blockIdx.y // NH
        h = cuda.blockIdx.y % NH
        kvh = h // G
        i0 = cuda.blockIdx.x * BR
        sq = cuda.shared.array((BR, HS), float32)
        so = cuda.shared.array((BR, HS), float32)
        sk = cuda.shared.array((BC, HP), float32)
        sv = cuda.shared.array((BC, HP), float32)
        ss = cuda.shared.array((BR, BC), float32)
        sm = cuda.shared.array(BR, float32)  # running max
        sl = cuda.shared.array(BR, float32)  # running sum
        sa = cuda.shared.array(BR, float32)  # rescale of this step
        sst = cuda.shared.array(BR, int32)  # first visible key of each row (packed rows)

        jlo = 0  # the first key tile any row of this block sees
        if packed:
            if tid == 0:
                _tile_starts(sst, seg, b, i0, T, BR, -1)
            cuda.syncthreads()
            jlo = (sst[0] // BC) * BC
        if window > 0:  # the first row's window starts at n_past + i0 - window + 1
            jlo = max(jlo, (max(n_past + i0 - window + 1, 0) // BC) * BC)
        for e in range(tid, BR * HS, nt):
            r = e // HS
            d = e % HS
            sq[r, d] = q[b, i0 + r, h, d] if i0 + r < T else 0.0
            so[r, d] = 0.0
        for r in range(tid, BR, nt):
            sm[r] = NEG_INF
            sl[r] = 0.0
        # keys seen by some row of the tile: j <= n_past + min(i0 + BR, T) - 1
        n_keys = n_past + min(i0 + BR, T)
        for j0 in range(jlo, n_keys, BC):
            cuda.syncthreads()  # the previous step is done with sk, sv, ss
            for e in range(tid, BC * HS, nt):
                c = e // HS
                d = e % HS
                if j0 + c < S:
                    sk[c, d] = k[b, j0 + c, kvh, d]
                    sv[c, d] = v[b, j0 + c, kvh, d]
                else:
                    sk[c, d] = 0.0
                    sv[c, d] = 0.0
            cuda.syncthreads()
            for e in range(tid, BR * BC, nt):
                r = e // BC
                c = e % BC
                i = i0 + r
                j = j0 + c
                visible = i < T and j <= n_past + i
                if window > 0:
                    visible = visible and n_past + i - j < window
                if packed:
                    visible = visible and j >= sst[r]
                if visible:
                    acc = float32(0.0)
                    for d in range(HS):
                        acc += sq[r, d] * sk[c, d]
                    if cap > 0:
                        ss[r, c] = cap * float32(math.tanh(acc * kcap))
                    else:
                        ss[r, c] = acc * scale
                else:
                    ss[r, c] = NEG_INF
            cuda.syncthreads()
            for r in range(tid, BR, nt):
                m_old = sm[r]
                mx = m_old
                for c in range(BC):
                    mx = max(mx, ss[r, c])
                if mx == NEG_INF:  # nothing visible yet (or a padding row)
                    for c in range(BC):
                        ss[r, c] = 0.0
                    sa[r] = 1.0
                else:
                    alpha = float32(math.exp(m_old - mx))  # 0 on the first visible tile
                    tot = float32(0.0)
                    for c in range(BC):
                        p = float32(math.exp(ss[r, c] - mx))
                        ss[r, c] = p
                        tot += p
                    sl[r] = sl[r] * alpha + tot
                    sm[r] = mx
                    sa[r] = alpha
            cuda.syncthreads()
            for e in range(tid, BR * HS, nt):
                r = e // HS
                d = e % HS
                acc = so[r, d] * sa[r]
                for c in range(BC):
                    acc += ss[r, c] * sv[c, d]
                so[r, d] = acc
        cuda.syncthreads()
        for e in range(tid, BR * HS, nt):
            r = e // HS
            d = e % HS
            if i0 + r < T:
                out[b, i0 + r, h, d] = so[r, d] / sl[r]
        for r in range(tid, BR, nt):
            if i0 + r < T:
                lse[b, h, i0 + r] = sm[r] + math.log(sl[r])

    return kernel


# ------------------------------------------------------------------ backward
@cuda.jit(device=True)
def _load_rows(sq, sdo, slse, sdd, q, dout, out, lse, b, h, i0, T, HS, BR, tid, nt):
    """Load the Q and dout tiles of rows i0..i0+BR of head h, their lse and
    D = rowsum(dout * out) (zeros for rows >= T)."""
    for e in range(tid, BR * HS, nt):
        r = e // HS
        d = e % HS
        if i0 + r < T:
            sq[r, d] = q[b, i0 + r, h, d]
            sdo[r, d] = dout[b, i0 + r, h, d]
        else:
            sq[r, d] = 0.0
            sdo[r, d] = 0.0
    for r in range(tid, BR, nt):
        acc = float32(0.0)
        if i0 + r < T:
            for d in range(HS):
                acc += dout[b, i0 + r, h, d] * out[b, i0 + r, h, d]
            slse[r] = lse[b, h, i0 + r]
        else:
            slse[r] = 0.0
        sdd[r] = acc


@cuda.jit(device=True)
def _load_keys(sk, sv, k, v, b, kvh, j0, T, HS, BC, tid, nt):
    for e in range(tid, BC * HS, nt):
        c = e // HS
        d = e % HS
        if j0 + c < T:
            sk[c, d] = k[b, j0 + c, kvh, d]
            sv[c, d] = v[b, j0 + c, kvh, d]
        else:
            sk[c, d] = 0.0
            sv[c, d] = 0.0


@cuda.jit(device=True)
def _tile_starts(sst, seg, b, i0, T, BR, prev):
    """(One thread.) sst[r] = the first token of row i0 + r's sample (rows past T
    repeat the last one); prev: that of row i0 - 1 when known, else -1 (then it is
    found by scanning back). Runs of equal ids are samples."""
    s = seg[b, i0]
    st = i0
    if i0 > 0 and seg[b, i0 - 1] == s:
        if prev >= 0:
            st = prev
        else:
            st = i0 - 1
            while st > 0 and seg[b, st - 1] == s:
                st -= 1
    sst[0] = st
    for r in range(1, BR):
        i = i0 + r
        if i < T and seg[b, i] != seg[b, i - 1]:
            st = i
        sst[r] = st


@cuda.jit(device=True)
def _probs_and_ds(sp, sds, sq, sdo, sk, sv, slse, sdd, packed, sst, i0, j0, T, HS, BR, BC, scale,
                  cap, kcap, window, tid, nt):
    """sp = P, sds = dS = P * (dout.v - D) * ds/d(q.k) on the (BR, BC) tile (0 where
    masked; when packed, keys before sst[r] are masked too, with a window the keys
    i - j >= window); ds/d(q.k) = scale, or scale * (1 - t^2) when soft-capped."""
    for e in range(tid, BR * BC, nt):
        r = e // BC
        c = e % BC
        i = i0 + r
        j = j0 + c
        visible = i < T and j <= i
        if window > 0:
            visible = visible and i - j < window
        if packed:
            visible = visible and j >= sst[r]
        if visible:
            s = float32(0.0)
            dp = float32(0.0)
            for d in range(HS):
                s += sq[r, d] * sk[c, d]
                dp += sdo[r, d] * sv[c, d]
            if cap > 0:
                t = float32(math.tanh(s * kcap))
                p = float32(math.exp(cap * t - slse[r]))
                sp[r, c] = p
                sds[r, c] = p * (dp - sdd[r]) * (scale - scale * t * t)
            else:
                p = float32(math.exp(s * scale - slse[r]))
                sp[r, c] = p
                sds[r, c] = p * (dp - sdd[r]) * scale
        else:
            sp[r, c] = 0.0
            sds[r, c] = 0.0


@lru_cache(maxsize=None)
def _dq_kernel(HS: int, BR: int, BC: int, packed: bool):
    HP = HS + 1

    @cuda.jit
    def kernel(dq, dout, q, k, v, out, lse, seg, scale, cap, kcap, window):
        # grid (ceil(T / BR), B * NH), block NTHREADS; seg (B, T) int32 when packed
        T, NH = q.shape[1], q.shape[2]
        G = NH // k.shape[2]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        b = cuda.blockIdx.y // NH
        h = cuda.blockIdx.y % NH
        kvh = h // G
        i0 = cuda.blockIdx.x * BR
        sq = cuda.shared.array((BR, HS), float32)
        sdo = cuda.shared.array((BR, HS), float32)
        sdq = cuda.shared.array((BR, HS), float32)
        sk = cuda.shared.array((BC, HP), float32)
        sv = cuda.shared.array((BC, HP), float32)
        sp = cuda.shared.array((BR, BC), float32)
        sds = cuda.shared.array((BR, BC), float32)
        slse = cuda.shared.array(BR, float32)
        sdd = cuda.shared.array(BR, float32)
        sst = cuda.shared.array(BR, int32)

        _load_rows(sq, sdo, slse, sdd, q, dout, out, lse, b, h, i0, T, HS, BR, tid, nt)
        for e in range(tid, BR * HS, nt):
            sdq[e // HS, e % HS] = 0.0
        jlo = 0
        if packed:
            if tid == 0:
                _tile_starts(sst, seg, b, i0, T, BR, -1)
            cuda.syncthreads()
            jlo = (sst[0] // BC) * BC
        if window > 0:
            jlo = max(jlo, (max(i0 - window + 1, 0) // BC) * BC)
        n_keys = min(i0 + BR, T)
        for j0 in range(jlo, n_keys, BC):
            cuda.syncthreads()
            _load_keys(sk, sv, k, v, b, kvh, j0, T, HS, BC, tid, nt)
            cuda.syncthreads()
            _probs_and_ds(sp, sds, sq, sdo, sk, sv, slse, sdd, packed, sst, i0, j0, T, HS, BR, BC,
                          scale, cap, kcap, window, tid, nt)
            cuda.syncthreads()
            for e in range(tid, BR * HS, nt):
                r = e // HS
                d = e % HS
                acc = sdq[r, d]
                for c in range(BC):
                    acc += sds[r, c] * sk[c, d]
                sdq[r, d] = acc
        cuda.syncthreads()
        for e in range(tid, BR * HS, nt):
            r = e // HS
            d = e % HS
            if i0 + r < T:
                dq[b, i0 + r, h, d] = sdq[r, d]

    return kernel


@lru_cache(maxsize=None)
def _dkdv_kernel(HS: int, BR: int, BC: int, packed: bool):
    HP = HS + 1

    @cuda.jit
    def kernel(dk, dv, dout, q, k, v, out, lse, seg, scale, cap, kcap, window):
        # grid (ceil(T / BC), B * NKV), block NTHREADS; seg (B, T) int32 when packed
        T, NH = q.shape[1], q.shape[2]
        NKV = k.shape[2]
        G = NH // NKV
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        b = cuda.blockIdx.y // NKV
        kvh = cuda.blockIdx.y % NKV
        j0 = cuda.blockIdx.x * BC
        sk = cuda.shared.array((BC, HP), float32)
        sv = cuda.shared.array((BC, HP), float32)
        sdk = cuda.shared.array((BC, HP), float32)
        sdv = cuda.shared.array((BC, HP), float32)
        sq = cuda.shared.array((BR, HS), float32)
        sdo = cuda.shared.array((BR, HS), float32)
        sp = cuda.shared.array((BR, BC), float32)
        sds = cuda.shared.array((BR, BC), float32)
        slse = cuda.shared.array(BR, float32)
        sdd = cuda.shared.array(BR, float32)
        sst = cuda.shared.array(BR, int32)

        _load_keys(sk, sv, k, v, b, kvh, j0, T, HS, BC, tid, nt)
        for e in range(tid, BC * HS, nt):
            sdk[e // HS, e % HS] = 0.0
            sdv[e // HS, e % HS] = 0.0
        first = (j0 // BR) * BR  # first query tile with a row i >= j0
        i_end = T  # past the last row that sees a key of this tile
        if window > 0:  # row i sees key j0 + BC - 1 while i - (j0 + BC - 1) < window
            i_end = min(T, j0 + BC - 1 + window)
        for g in range(G):
            h = kvh * G + g
            for i0 in range(first, i_end, BR):
                cuda.syncthreads()
                if packed:
                    if tid == 0:  # sst[BR - 1] is row i0 - 1's start after the first tile
                        _tile_starts(sst, seg, b, i0, T, BR, sst[BR - 1] if i0 > first else -1)
                    cuda.syncthreads()
                    if sst[0] >= j0 + BC:  # starts never decrease: no later row sees this tile
                        break
                _load_rows(sq, sdo, slse, sdd, q, dout, out, lse, b, h, i0, T, HS, BR, tid, nt)
                cuda.syncthreads()
                _probs_and_ds(sp, sds, sq, sdo, sk, sv, slse, sdd, packed, sst, i0, j0, T, HS, BR,
                              BC, scale, cap, kcap, window, tid, nt)
                cuda.syncthreads()
                for e in range(tid, BC * HS, nt):
                    c = e // HS
                    d = e % HS
                    ak = sdk[c, d]
                    av = sdv[c, d]
                    for r in range(BR):
                        ak += sds[r, c] * sq[r, d]
                        av += sp[r, c] * sdo[r, d]
                    sdk[c, d] = ak
                    sdv[c, d] = av
        cuda.syncthreads()
        for e in range(tid, BC * HS, nt):
            c = e // HS
            d = e % HS
            if j0 + c < T:
                dk[b, j0 + c, kvh, d] = sdk[c, d]
                dv[b, j0 + c, kvh, d] = sdv[c, d]

    return kernel


# ---------------------------------------------------------------- Python API
def _check_qkv(q, k, v, S, kv_contiguous=True):
    B, T, NH, HS = check_ndim("attention", "q", q, 4, np.float32)
    Bk, Sk, NKV, HSk = check_ndim("attention", "k", k, 4, np.float32)
    if NKV < 1 or NH % NKV:
        raise ValueError(f"attention: query heads {NH} must be a multiple of kv heads {NKV}")
    if not 0 < HS <= MAX_HS:
        raise ValueError(f"attention: head size {HS} is not in [1, {MAX_HS}]")
    check("attention", "q", q, (B, T, NH, HS), np.float32)
    check("attention", "k", k, (B, S, NKV, HS), np.float32, contiguous=kv_contiguous)
    check("attention", "v", v, (B, S, NKV, HS), np.float32, contiguous=kv_contiguous)
    return B, T, NH, NKV, HS


def _tiles(HS, block_q, block_k):
    (r1, c1), (r2, c2) = tiles(HS)
    return (block_q or r1, block_k or c1), (block_q or r2, block_k or c2)


def _check_segments(segments, B, T, n_past):
    """The array the kernels take as `seg`: segments, or an unread 1 x 1 stand-in."""
    if segments is None:
        return _no_segments()
    if n_past:
        raise ValueError(f"attention: segments need n_past = 0 (training), got {n_past}")
    check("attention", "segments", segments, (B, T), np.int32)
    return segments


@lru_cache(maxsize=None)
def _no_segments():
    return cuda.to_device(np.zeros((1, 1), np.int32))


def attention_forward(out, lse, q, k, v, n_past, segments=None, *, scale=None, softcap=0.0,
                      window=0, block_q=None, block_k=None, threads=None) -> None:
    """Causal GQA attention for T new queries after n_past cached positions.

    out (B, T, NH, HS); lse (B, NH, T) saved log-sum-exp; q (B, T, NH, HS);
    k, v (B, S, NKV, HS) with S = n_past + T (may be [:, :S] slices of a cache:
    any strides). float32 device arrays. segments: None, or (B, T) int32 sample
    ids of packed rows (n_past = 0; contiguous runs, see the module docstring).
    scale (None: 1/sqrt(HS)), softcap (> 0: tanh soft-capping of the scores) and
    window (> 0: sliding-window mask) as in the CPU twin.
    block_q / block_k / threads override the tile sizes and the block size
    (tests: small tiles exercise the tile loops on tiny shapes)."""
    if n_past < 0:
        raise ValueError(f"attention: n_past must be >= 0, got {n_past}")
    T = q.shape[1] if len(getattr(q, "shape", ())) == 4 else 0
    B, T, NH, NKV, HS = _check_qkv(q, k, v, n_past + T, kv_contiguous=False)
    check("attention", "out", out, (B, T, NH, HS), np.float32)
    check("attention", "lse", lse, (B, NH, T), np.float32)
    seg = _check_segments(segments, B, T, n_past)
    scale, cap, kcap = attention_options(np.float32, HS, scale, softcap, window)
    if B * T * NH == 0:
        return
    (BR, BC), _ = _tiles(HS, block_q, block_k)
    kernel = _forward_kernel(HS, BR, BC, segments is not None)
    kernel[(cdiv(T, BR), B * NH), threads or NTHREADS](out, lse, q, k, v, seg,
                                                       np.int64(n_past), scale, cap, kcap,
                                                       np.int64(window))


def attention_backward(dq, dk, dv, dout, q, k, v, out, lse, segments=None, *, scale=None,
                       softcap=0.0, window=0, block_q=None, block_k=None,
                       threads=None) -> None:
    """Gradients of causal GQA attention for training (n_past = 0, S = T), overwritten.

    dq (B, T, NH, HS); dk, dv (B, T, NKV, HS) summed over each kv head's query
    heads; dout, q, out (B, T, NH, HS); k, v (B, T, NKV, HS); lse (B, NH, T);
    all C-contiguous float32 device arrays; segments, scale, softcap and window as
    in attention_forward.
    Overrides as attention_forward."""
    T = q.shape[1] if len(getattr(q, "shape", ())) == 4 else 0
    B, T, NH, NKV, HS = _check_qkv(q, k, v, T)
    for name, a in (("dq", dq), ("dout", dout), ("out", out)):
        check("attention", name, a, (B, T, NH, HS), np.float32)
    check("attention", "dk", dk, (B, T, NKV, HS), np.float32)
    check("attention", "dv", dv, (B, T, NKV, HS), np.float32)
    check("attention", "lse", lse, (B, NH, T), np.float32)
    seg = _check_segments(segments, B, T, 0)
    scale, cap, kcap = attention_options(np.float32, HS, scale, softcap, window)
    if B * T * NH == 0:
        return
    (BR, BC), (BR2, BC2) = _tiles(HS, block_q, block_k)
    nt, packed = threads or NTHREADS, segments is not None
    opts = (scale, cap, kcap, np.int64(window))
    _dq_kernel(HS, BR, BC, packed)[(cdiv(T, BR), B * NH), nt](dq, dout, q, k, v, out, lse, seg,
                                                              *opts)
    _dkdv_kernel(HS, BR2, BC2, packed)[(cdiv(T, BC2), B * NKV), nt](dk, dv, dout, q, k, v, out,
                                                                    lse, seg, *opts)
