"""Causal GQA attention with bf16 products (oneDNN, AMX or AVX512_BF16), float32 scores
and softmax.

The same contract, masks, query blocks and tiles as kernels/attention.py (whose
docstring explains them); what differs is how the T x S products run. Each worker
thread of the pool runs its own single-threaded oneDNN products (kernels/bf16.batched),
as numpy's single-threaded BLAS runs in the float32 path:
- the scores q k^T (forward, and again in the backward) in float32: oneDNN's float32
  kernels on float32 copies of q and k;
- P v of the forward and the backward's dout v^T, dS k, dS^T q and P^T dout in bf16
  with float32 accumulation: their inputs rounded to bf16.
The softmax, its log-sum-exp, rowsum(dout * out) and every sum over blocks stay float32.
The errors are bf16's rounding of v, dout, P, dS and of q and k in dq and dk's products:
relative errors of a few 1e-3 of the outputs' scale (tests/test_op_attention_bf16.py).

Why the scores stay float32: q and k rounded to bf16 put an absolute error of about
2^-8 |q| |k| on each q.k, which the softmax exponentiates. Models whose q and k are
large (Qwen2's biased q and k) then attend elsewhere: an earlier version multiplied the
scores in bf16 too, and on Qwen2.5-Coder-0.5B's 50-step chat run (`bench/compute_dtype.py
... --steps 50 --lr 1e-3 --extra=--pack`) it moved the final validation loss to -2.96 %
of the float32 run's (issue #29 bounds it at 1 %). The test with q and k of a large norm
shows the difference: out 9.5 % of its scale off with bf16 scores, 0.3 % with these.

Layout: oneDNN runs its brgemm kernels on dense batches of matrices, not on the strided
(B, T, heads, HS) rows numpy's matmul reads in place (it then picks a jit gemm that ran
no faster than float32). So each query block copies its keys and values into head-major
blocks (nk, W, HS) and its q (and dout) rows into (nk, G * TQ, HS): a kv head's G query
heads are one matrix of G * TQ rows against its keys. (Copying a tile's keys once and
multiplying each block's slice of them was measured: no faster, the gathers being a
small share; forward 54.9 against 56.6 ms, backward 120 against 118 at T 1024.) The rounding
is the gather (one pass that reads the float32 rows once and writes the bf16 copy, and
the float32 one the scores need).

A block's keys start at a multiple of KEY_ALIGN (the keys before its first visible one
are computed and masked to 0): with packed samples the first visible key can be any
position, and each distinct width would be a product to build and JIT-compile.

For float32 inputs of at least MIN_ROWS queries without soft-capping; the rest goes to
the float32 kernels unchanged (decode steps, float64 finite-difference checks, gemma2's
cap). Used by training, perplexity and generation when the products are bf16
(models/products.Products.attention_ops).

Measured, `python bench/attention.py --threads 2 --T 256 --dtype f32,bf16` (B 8, 8/4
heads of 64): on 2 Zen 4 cores (AVX512_BF16), forward 5.5 against 6.7 ms and backward
11.7 against 16.4 ms; packed samples 3.9 against 4.9 and 9.0 against 11.1.
"""
import numpy as np
from numba import njit

from . import attention as f32
from . import bf16
from .attention import _zero_outside
from .dequant import _f32_to_bf16
from .vecmath import FASTMATH as _FASTMATH
from .vecmath import expf as _exp
from .vecmath import row_max as _row_max

KEY_ALIGN = 64   # a block's first computed key is a multiple of this
MIN_ROWS = 16    # fewer queries (a decode step) go to the float32 kernels


@njit(cache=True, nogil=True)
def _gather_bf16(out, src, r0, h0, d=None, other=None, out32=None):
    # out (H, R, C) uint16 = bf16(src[r0 + r, h0 + h, c]): src a batch row (T, heads, C),
    # C-contiguous, indexed rather than sliced so the inner loop has unit stride (numba
    # vectorizes it; on a strided view it ran scalar, 1.3 ns a value). With out32 (out's
    # shape, float32): the same rows unrounded too. With d (H, R) and other (src's
    # layout): d = sum_c src * other of the same rows in float32, summed in order (no
    # fastmath: the same bits whatever the tiling)
    H, R, C = out.shape
    for h in range(H):
        for r in range(R):
            row, o = src[r0 + r, h0 + h], out[h, r]
            if out32 is not None:
                o32 = out32[h, r]
                for c in range(C):
                    o32[c] = row[c]
            if d is None:
                for c in range(C):
                    o[c] = _f32_to_bf16(row[c])
            else:
                oth = other[r0 + r, h0 + h]
                acc = np.float32(0)
                for c in range(C):
                    x = row[c]
                    o[c] = _f32_to_bf16(x)
                    acc += x * oth[c]
                d[h, r] = acc


@njit(cache=True, nogil=True)
def _copy_block(block, rows, r0, h0, into_rows):
    # block (H, R, C) head-major <-> rows[r0 + r, h0 + h, c] of a batch row (T, heads, C),
    # C-contiguous: the block written back into the rows when into_rows (dq, dk, dv,
    # out), else gathered from them unrounded (q and k for the float32 scores)
    H, R, C = block.shape
    for r in range(R):
        for h in range(H):
            x, y = block[h, r], rows[r0 + r, h0 + h]
            if into_rows:
                for c in range(C):
                    y[c] = x[c]
            else:
                for c in range(C):
                    x[c] = y[c]


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _softmax_bf16_kernel(att, p16, lse, scale, lo, hi):
    # att (R, TQ, W): raw scores q.k (float32, overwritten); p16 (R, TQ, W) out:
    # bf16(P), 0 outside [lo[i], hi[i]); lse (nk, G, TQ) out; R = nk * G
    R, TQ = att.shape[:2]
    G = lse.shape[1]
    one = np.float32(1)
    for r in range(R * TQ):
        h = r // TQ
        i = r % TQ
        row, prow = att[h, i], p16[h, i]
        a, n = np.uint64(lo[i]), np.uint64(hi[i])
        mx = _row_max(row, a, n) * scale
        tot = scale - scale
        for j in range(a, n):
            e = _exp(row[j] * scale - mx)
            row[j] = e
            tot += e
        inv = one / tot
        for j in range(a, n):
            prow[j] = _f32_to_bf16(row[j] * inv)
        _zero_outside(prow, a, n)
        lse[h // G, h % G, i] = mx + np.log(tot)


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def _softmax_backward_bf16_kernel(att, dp, p16, ds16, lse, d, scale, lo, hi):
    # att (R, TQ, W) raw scores, dp (R, TQ, W) dout.v (float32 in); p16, ds16 out:
    # bf16(P) and bf16(P (dp - d) scale), 0 outside [lo[i], hi[i]); lse (nk, G, TQ);
    # d (R, TQ): rowsum(dout * out)
    R, TQ = att.shape[:2]
    G = lse.shape[1]
    for r in range(R * TQ):
        h = r // TQ
        i = r % TQ
        a, n = np.uint64(lo[i]), np.uint64(hi[i])
        d_i, lse_i = d[h, i], lse[h // G, h % G, i]
        row, drow, prow, dsrow = att[h, i], dp[h, i], p16[h, i], ds16[h, i]
        for j in range(a, n):
            p = _exp(row[j] * scale - lse_i)
            prow[j] = _f32_to_bf16(p)
            dsrow[j] = _f32_to_bf16(p * (drow[j] - d_i) * scale)
        _zero_outside(prow, a, n)
        _zero_outside(dsrow, a, n)


def _aligned(blocks):
    """The blocks of attention._blocks with each first key j0 moved down to a multiple of
    KEY_ALIGN (lo and hi shifted with it)."""
    out = []
    for i0, i1, j0, lo, hi in blocks:
        shift = j0 % KEY_ALIGN
        out.append((i0, i1, j0 - shift, lo + shift, hi + shift))
    return out


def _float32_path(q, T, softcap) -> bool:
    return q.dtype != np.float32 or T < MIN_ROWS or softcap > 0


def scratch_bytes(B, T, NH, NKV, HS, softcap=0.0):
    """attention.scratch_bytes for these kernels: the bytes of the `work` buffers of
    attention_forward or attention_backward (n_past 0, S = T), the larger, times the
    workers that run (a training step's float32 queries; fewer than MIN_ROWS or capped
    scores: the float32 kernels' figure). At the bench shape (B 8 x T 256, 8/4 heads
    of 64, 2 threads): 9.5 MiB."""
    if T < MIN_ROWS or softcap > 0:
        return f32.scratch_bytes(B, T, NH, NKV, HS, softcap)
    G, QB = NH // NKV, min(T, f32._QBLOCK)
    tiles = f32._tiles(B, NKV, G * QB * T)
    most = tiles[0][1].stop
    rows, kv, scores = most * G * QB * HS, most * T * HS, most * G * QB * T
    forward = 4 * rows + 6 * kv + 6 * scores + 4 * rows               # qh; kh, vh; scores, p16; o
    backward = (4 * rows + 4 * kv + 4 * rows + 4 * kv                 # qh, doh; kh, vh; q32; k32
                + 8 * scores + 4 * scores + 4 * rows + 8 * kv + 4 * most * G * QB)  # scores, dps; p16, ds16; dqh; dkv; d
    return f32._workers(len(tiles)) * max(forward, backward)


def attention_forward(out, lse, q, k, v, n_past, segments=None, *, scale=None, softcap=0.0,
                      window=0):
    """attention.attention_forward with bf16 products (same arguments and contract)."""
    T = q.shape[1] if isinstance(q, np.ndarray) and q.ndim == 4 else 0
    if not isinstance(q, np.ndarray) or _float32_path(q, T, softcap) or n_past < 0:
        return f32.attention_forward(out, lse, q, k, v, n_past, segments, scale=scale,
                                     softcap=softcap, window=window)
    B, T, NH, NKV, HS = f32._check_qkv(q, k, v, n_past + T)
    f32._check("out", out, q.shape, q.dtype)
    f32._check("lse", lse, (B, NH, T), q.dtype)
    scale = f32.attention_options(q.dtype, HS, scale, softcap, window)[0]
    starts = f32._starts(segments, B, T, n_past)
    blocks = [_aligned(f32._blocks(T, n_past, starts[b], window)) for b in range(B)]
    G, QB, S = NH // NKV, min(T, f32._QBLOCK), n_past + T
    tiles = f32._tiles(B, NKV, G * QB * S)
    lse4 = lse.reshape(B, NKV, G, T)
    most = tiles[0][1].stop  # the largest tile's kv heads

    def work(items):
        qh = np.empty(most * G * QB * HS, np.float32)
        kh = np.empty(most * S * HS, np.float32)  # a block's keys (float32: the scores) and values
        vh = np.empty(most * S * HS, np.uint16)
        scores = np.empty(most * G * QB * S, np.float32)
        p16 = np.empty(most * G * QB * S, np.uint16)
        o = np.empty(most * G * QB * HS, np.float32)
        for item in items:
            b, ks = tiles[item]
            nk = ks.stop - ks.start
            heads = slice(ks.start * G, ks.stop * G)
            for i0, i1, j0, lo, hi in blocks[b]:
                TQ, W = i1 - i0, n_past + i1 - j0
                qb = qh[: nk * G * TQ * HS].reshape(nk * G, TQ, HS)
                kb, vb = kh[: nk * W * HS].reshape(nk, W, HS), vh[: nk * W * HS].reshape(nk, W, HS)
                _copy_block(qb, q[b], i0, heads.start, False)
                _copy_block(kb, k[b], j0, ks.start, False)
                _gather_bf16(vb, v[b], j0, ks.start)
                att = scores[: nk * G * TQ * W].reshape(nk, G * TQ, W)
                pb = p16[: nk * G * TQ * W].reshape(nk, G * TQ, W)
                bf16.batched(att, qb.reshape(nk, G * TQ, HS), kb.transpose(0, 2, 1))  # float32
                _softmax_bf16_kernel(att.reshape(nk * G, TQ, W), pb.reshape(nk * G, TQ, W),
                                     lse4[b, ks, :, i0:i1], scale, lo, hi)
                ob = o[: nk * G * TQ * HS].reshape(nk, G * TQ, HS)
                bf16.batched(ob, pb, vb)
                _copy_block(ob.reshape(nk * G, TQ, HS), out[b], i0, heads.start, True)

    f32._run_items(work, len(tiles))


def attention_backward(dq, dk, dv, dout, q, k, v, out, lse, segments=None, *, scale=None,
                       softcap=0.0, window=0):
    """attention.attention_backward with bf16 products (same arguments and contract)."""
    T = q.shape[1] if isinstance(q, np.ndarray) and q.ndim == 4 else 0
    if not isinstance(q, np.ndarray) or _float32_path(q, T, softcap):
        return f32.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, segments, scale=scale,
                                      softcap=softcap, window=window)
    B, T, NH, NKV, HS = f32._check_qkv(q, k, v, T)
    for name, a in (("dq", dq), ("dout", dout), ("out", out)):
        f32._check(name, a, q.shape, q.dtype)
    f32._check("dk", dk, k.shape, q.dtype)
    f32._check("dv", dv, k.shape, q.dtype)
    f32._check("lse", lse, (B, NH, T), q.dtype)
    scale = f32.attention_options(q.dtype, HS, scale, softcap, window)[0]
    starts = f32._starts(segments, B, T, 0)
    blocks = [_aligned(f32._blocks(T, 0, starts[b], window)) for b in range(B)]
    G, QB = NH // NKV, min(T, f32._QBLOCK)
    tiles = f32._tiles(B, NKV, G * QB * T)
    lse4 = lse.reshape(B, NKV, G, T)
    most = tiles[0][1].stop

    def work(items):
        qh, doh = np.empty((2, most * G * QB * HS), np.uint16)
        kh, vh = np.empty((2, most * T * HS), np.uint16)  # a block's keys and values
        q32 = np.empty(most * G * QB * HS, np.float32)  # q and k unrounded, for the scores
        k32 = np.empty(most * T * HS, np.float32)
        scores, dps = np.empty((2, most * G * QB * T), np.float32)
        p16, ds16 = np.empty((2, most * G * QB * T), np.uint16)
        dqh = np.empty(most * G * QB * HS, np.float32)
        dkv = np.empty((2, most * T * HS), np.float32)  # the tile's dk, dv, head-major
        d = np.empty(most * G * QB, np.float32)  # rowsum(dout * out) of a block's rows
        for item in items:
            b, ks = tiles[item]
            nk = ks.stop - ks.start
            heads = slice(ks.start * G, ks.stop * G)
            dkt, dvt = (dkv[j, : nk * T * HS].reshape(nk, T, HS) for j in (0, 1))
            dkt[...] = 0.0
            dvt[...] = 0.0
            for i0, i1, j0, lo, hi in blocks[b]:
                TQ, W = i1 - i0, i1 - j0
                m, n = nk * G * TQ * HS, nk * G * TQ * W
                qb, db = qh[:m].reshape(nk * G, TQ, HS), doh[:m].reshape(nk * G, TQ, HS)
                db_dot = d[: nk * G * TQ].reshape(nk * G, TQ)
                qf, kf = q32[:m].reshape(nk * G, TQ, HS), k32[: nk * W * HS].reshape(nk, W, HS)
                _gather_bf16(qb, q[b], i0, heads.start, out32=qf)
                _gather_bf16(db, dout[b], i0, heads.start, db_dot, out[b])
                qb, db = qb.reshape(nk, G * TQ, HS), db.reshape(nk, G * TQ, HS)
                kb, vb = kh[: nk * W * HS].reshape(nk, W, HS), vh[: nk * W * HS].reshape(nk, W, HS)
                _gather_bf16(kb, k[b], j0, ks.start, out32=kf)
                _gather_bf16(vb, v[b], j0, ks.start)
                att, dp = scores[:n].reshape(nk, G * TQ, W), dps[:n].reshape(nk, G * TQ, W)
                pb, dsb = p16[:n].reshape(nk, G * TQ, W), ds16[:n].reshape(nk, G * TQ, W)
                bf16.batched(att, qf.reshape(nk, G * TQ, HS), kf.transpose(0, 2, 1))  # float32
                bf16.batched(dp, db, vb.transpose(0, 2, 1))
                rows = (nk * G, TQ, W)
                _softmax_backward_bf16_kernel(att.reshape(rows), dp.reshape(rows), pb.reshape(rows),
                                              dsb.reshape(rows), lse4[b, ks, :, i0:i1], db_dot, scale, lo, hi)
                dqb = dqh[:m].reshape(nk, G * TQ, HS)
                bf16.batched(dqb, dsb, kb)  # dq rows of this block are complete
                _copy_block(dqb.reshape(nk * G, TQ, HS), dq[b], i0, heads.start, True)
                # dk, dv: contracted over (G, TQ) at once (summed over the group's heads), added
                # to the tile's sums by the product itself
                bf16.batched(dkt[:, j0:i1], dsb.transpose(0, 2, 1), qb, accumulate=True)
                bf16.batched(dvt[:, j0:i1], pb.transpose(0, 2, 1), db, accumulate=True)
            _copy_block(dkt, dk[b], 0, ks.start, True)
            _copy_block(dvt, dv[b], 0, ks.start, True)

    f32._run_items(work, len(tiles))
