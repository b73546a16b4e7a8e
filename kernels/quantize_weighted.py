"""Importance-weighted quantization: what ``llama-quantize --imatrix`` runs.

With an importance matrix, llama.cpp's ``quantize_<type>(src, dst, nrow, n_per_row,
quant_weights)`` calls ``quantize_row_<type>_impl`` (ggml/src/ggml-quants.c) instead
of the ``_ref`` code ported in quantize.py. ``quant_weights`` holds one importance
per input column (imatrix: the mean of x^2 over real data, the same for every row)
and enters every type's block fit as

    weight_i = qw_i * sqrt(sigma2 + x_i^2)        (Q6_K: weight_i = qw_i)

with sigma2 the mean x^2 of the row (legacy types) or 2x / 1x that of the 256-value
super-block (Q3_K, Q4_K, Q5_K / Q2_K). These are numba ports of those ``_impl``
functions and their helpers ``make_qx_quants`` (with weights), ``make_qkx3_quants``
and ``make_qp_quants``, with the float32 operations in C order as in quantize.py
(byte-identical to that C code built without FMA contraction; tests keep digests).
Q8_0 has no weighted variant in llama.cpp (it ignores quant_weights); so here.

One addition for error-compensating quantization (kernels/compensate.py), which
quantizes a row in column groups: ``row_sigma2`` may give the legacy types' per-row
sigma2 instead of computing it from the (partial) row passed in.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from .quantize import (GROUP_MAX_EPS, QK_K, _fp16, _k45_levels, _make_qkx2_quants, _nearest_int, _pack_q45_k,
                       _pack_scale_min_k4, _put_f16, _put_q3_k_scale, _q2_k_levels, _q3_k_levels, _q6_k_block, _qk_fit,
                       _qk_start, _qk_stats, checked_rows, quantize)
from .quantize_iq4 import IQ4_WEIGHTED_KERNELS

__all__ = ["WEIGHTED", "quantize_weighted"]

f32 = np.float32


# ---------------------------------------------------------- ggml-quants.c helpers
@njit(cache=True, inline="always")
def _rint(fval):
    """float32(_nearest_int(fval)) in float arithmetic alone, for |fval| <= 2^22
    (adding and taking away 1.5*2^23 rounds half to even, exactly): numba widens integer
    arithmetic to 64 bits, so the trial loops vectorize only this way (8 float lanes)."""
    return f32(f32(f32(fval) + f32(12582912.0)) - f32(12582912.0))


_QX_TRIALS = 19                 # make_qx_quants: -nmax/max, then 18 steps


@njit(cache=True, inline="always")
def _qx_scratch():
    """_make_qx_quants_w's scratch: trial scales and two sums per trial."""
    return np.empty(_QX_TRIALS, np.float32), np.empty(_QX_TRIALS, np.float32), np.empty(_QX_TRIALS, np.float32)


@njit(cache=True)
def _make_qx_quants_w(nmax, x, L, qw, iscales, sumlx, suml2):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw): symmetric levels -nmax..nmax-1
    stored as L+nmax; the qw-weighted best of 19 trial scales.

    C sums each trial over the block in index order, one trial after another: a chain
    of dependent float32 adds (4 cycles each). The trials are independent (each from
    the block's max), so here they run side by side: one pass over the block updates
    every trial's sums, each still in index order (the same bits); then the best is
    picked in C's order. The levels are rounded and clamped in float arithmetic (_rint),
    so the trial loop runs in SIMD lanes; iscales, sumlx, suml2 are the caller's float32
    scratch of _QX_TRIALS (allocated per block they cost as much as the trials). Q5_0
    with weights: 0.27 us a block, against 0.35 with integer levels and 1.06 one trial
    after another."""
    n = x.shape[0]
    amax = f32(0)
    mx = f32(0)
    for i in range(n):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        L[:n] = 0
        return f32(0)
    iscales[0] = f32(-nmax) / mx
    t = 1
    for step in range(-9, 10):
        if step != 0:
            iscales[t] = -(f32(nmax) + f32(0.1) * f32(step)) / mx
            t += 1
    sumlx[:] = 0
    suml2[:] = 0
    lo = f32(-nmax)
    hi = f32(nmax - 1)
    for i in range(n):
        wx = qw[i] * x[i]
        for t in range(_QX_TRIALS):
            fl = min(hi, max(lo, _rint(iscales[t] * x[i])))
            sumlx[t] += wx * fl
            suml2[t] += qw[i] * fl * fl
    scale = sumlx[0] / suml2[0] if suml2[0] != 0 else f32(0)
    best = scale * sumlx[0]
    chosen = 0
    for t in range(1, _QX_TRIALS):
        if suml2[t] > 0 and sumlx[t] * sumlx[t] > best * suml2[t]:
            chosen = t
            scale = sumlx[t] / suml2[t]
            best = scale * sumlx[t]
    for i in range(n):
        L[i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(iscales[chosen] * x[i])))
    return scale


@njit(cache=True, inline="always")
def _make_qkx3_quants(nmax, x, w, L, Laux, rmin, rdelta, nstep):
    """make_qkx3_quants with weights and use_mad=false: asymmetric levels 0..nmax,
    x ~ scale*L - the_min, nstep+1 trial scales each refit by weighted least squares.
    Returns (scale, the_min); L filled. With weights it is make_qkx2_quants (C tests
    max <= min where that tests max == min: the same, as min <= max or either is NaN)."""
    return _make_qkx2_quants(nmax, x, w, L, Laux, rmin, rdelta, nstep, False)


@njit(cache=True)
def _make_qkx3_quants_2(nmax, xa, wa, La, xb, wb, Lb, Lt, Laux, rmin, rdelta, nstep):
    """_make_qkx3_quants of two blocks (a, b) at once: (scale_a, min_a, scale_b, min_b).

    Each trial's sums are chains of dependent float32 adds, and a trial starts from the
    min the last improving trial chose, so one block's trials cannot overlap; two
    blocks' chains can. Every sum is still taken in index order in a scalar of its own
    (lanes in arrays stay in memory under numba, and were no faster): the same bits as
    two calls. The trials' levels are computed in float arithmetic (_rint), kept in Lt
    (float32, 2n); Laux is for a flat block's fallback. Q4_K with weights, 896
    super-blocks on 2 cores: 18.7 ms, against 23.6 one block at a time with integer
    levels."""
    n = xa.shape[0]
    mna, mxa, sum_wa, sum_xa = _qk_stats(xa, wa)
    mnb, mxb, sum_wb, sum_xb = _qk_stats(xb, wb)
    if mxa <= mna or mxb <= mnb:               # a flat block: C returns early; one at a time
        sa, ma = _make_qkx3_quants(nmax, xa, wa, La, Laux, rmin, rdelta, nstep)
        sb, mb = _make_qkx3_quants(nmax, xb, wb, Lb, Laux, rmin, rdelta, nstep)
        return sa, ma, sb, mb
    fnmax = f32(nmax)
    scale_a, best_a = _qk_start(nmax, xa, wa, La, mna, mxa, False)
    scale_b, best_b = _qk_start(nmax, xb, wb, Lb, mnb, mxb, False)
    for step in range(nstep + 1):
        iscale_a = (rmin + rdelta * f32(step) + fnmax) / (mxa - mna)
        iscale_b = (rmin + rdelta * f32(step) + fnmax) / (mxb - mnb)
        sla = f32(0)
        sl2a = f32(0)
        sxla = f32(0)
        slb = f32(0)
        sl2b = f32(0)
        sxlb = f32(0)
        for i in range(n):
            fl = max(f32(0), min(fnmax, _rint(iscale_a * (xa[i] - mna))))
            Lt[i] = fl
            sla += wa[i] * fl
            sl2a += wa[i] * fl * fl
            sxla += wa[i] * fl * xa[i]
            fl = max(f32(0), min(fnmax, _rint(iscale_b * (xb[i] - mnb))))
            Lt[n + i] = fl
            slb += wb[i] * fl
            sl2b += wb[i] * fl * fl
            sxlb += wb[i] * fl * xb[i]
        Da, this_scale_a, this_min_a = _qk_fit(sum_wa, sum_xa, sla, sl2a, sxla)
        Db, this_scale_b, this_min_b = _qk_fit(sum_wb, sum_xb, slb, sl2b, sxlb)
        mad_a = f32(0)
        mad_b = f32(0)
        for i in range(n):
            diff = this_scale_a * Lt[i] + this_min_a - xa[i]
            mad_a += wa[i] * (diff * diff)
            diff = this_scale_b * Lt[n + i] + this_min_b - xb[i]
            mad_b += wb[i] * (diff * diff)
        if Da > 0 and mad_a < best_a:
            for i in range(n):
                La[i] = np.int64(Lt[i])
            best_a = mad_a
            scale_a = this_scale_a
            mna = this_min_a
        if Db > 0 and mad_b < best_b:
            for i in range(n):
                Lb[i] = np.int64(Lt[n + i])
            best_b = mad_b
            scale_b = this_scale_b
            mnb = this_min_b
    return scale_a, -mna, scale_b, -mnb


@njit(cache=True)
def _make_qp_quants(nmax, x, L, qw):
    """make_qp_quants: non-negative levels 0..nmax for the sub-block scales or mins
    of a K-quant super-block, weighted by qw; 9 trial scales, then up to 5 sweeps
    of per-element level changes. L is C's uint8_t (stored & 0xFF)."""
    n = x.shape[0]
    mx = f32(0)
    for i in range(n):
        mx = max(mx, x[i])
    if mx < GROUP_MAX_EPS:
        L[:n] = 0
        return f32(0)
    fnmax = f32(nmax)
    iscale = fnmax / mx
    for i in range(n):
        L[i] = _nearest_int(iscale * x[i]) & 0xFF
    scale = f32(1) / iscale
    best_mse = f32(0)
    for i in range(n):
        diff = x[i] - scale * f32(L[i])
        best_mse += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (f32(0.1) * f32(step) + fnmax) / mx
        scale_is = f32(1) / iscale_is
        mse = f32(0)
        for i in range(n):
            l = min(nmax, _nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * f32(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = f32(0)
    suml2 = f32(0)
    for i in range(n):
        l = min(nmax, _nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        fl = f32(L[i])
        sumlx += qw[i] * x[i] * fl
        suml2 += qw[i] * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = qw[i]
            li = f32(L[i])
            slx = sumlx - w * x[i] * li
            sl2 = suml2 - w * li * li
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, _nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w * x[i] * f32(new_l)
                    sl2 += w * f32(new_l) * f32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else f32(0)


@njit(cache=True, inline="always")
def _sum_sq(x):
    s = f32(0)
    for i in range(x.shape[0]):
        s += x[i] * x[i]
    return s


@njit(cache=True, inline="always")
def _row_sigma2(x, r, row_sigma2):
    """sum_x2/n_per_row over row r (legacy types), unless row_sigma2[r] >= 0 gives it."""
    if row_sigma2[r] >= 0:
        return row_sigma2[r]
    return _sum_sq(x[r]) / f32(x.shape[1])


@njit(cache=True, inline="always")
def _imatrix_weights(weight, qw, sigma2, x):
    # weight_i = qw_i * sqrt(sigma2 + x_i^2): llama.cpp's weights for every type but Q6_K
    for i in range(x.shape[0]):
        weight[i] = qw[i] * f32(np.sqrt(sigma2 + x[i] * x[i]))


@njit(cache=True, inline="always")
def _k_weights(weights, sw, qwb, xb, sigma2, n_sub):
    """A K-quant super-block's weights (QK_K,) from its importances qwb, and their
    sums over each of its n_sub sub-blocks (sw), in index order."""
    _imatrix_weights(weights, qwb, sigma2, xb)
    size = QK_K // n_sub
    for j in range(n_sub):
        s = f32(0)
        for l in range(size):
            s += weights[size * j + l]
        sw[j] = s


@njit(cache=True, inline="always")
def _k_scratch(n_sub):
    """A row's scratch for a K-quant of n_sub sub-blocks: levels L (QK_K,), Laux (one
    sub-block), Lt (two sub-blocks, float32), the sub-block scales' and mins' levels Ls, Lm,
    the weights (QK_K,) and their sub-block sums sw, the sub-block scales and mins."""
    size = QK_K // n_sub
    return (np.empty(QK_K, np.int64), np.empty(size, np.int64), np.empty(2 * size, np.float32),
            np.empty(n_sub, np.int64), np.empty(n_sub, np.int64), np.empty(QK_K, np.float32),
            np.empty(n_sub, np.float32), np.empty(n_sub, np.float32), np.empty(n_sub, np.float32))


# ------------------------------------------------------------------ legacy types
@njit(cache=True, inline="always")
def _pack_legacy(L, y, o, five_bit):
    # Q5_0 / Q5_1 (five_bit): qh (u32 little-endian at y[o:o+4], bit 4 of value j at
    # bit j), then qs[16]; Q4_0 / Q4_1: qs[16] at y[o:]. qs: the low 4 bits of value j
    # in the low nibble of byte j, of value j+16 in its high nibble
    if five_bit:
        qh = np.int64(0)
        for j in range(32):
            qh |= ((L[j] & 0x10) >> 4) << j
        for k in range(4):
            y[o + k] = (qh >> (8 * k)) & 0xFF
        o += 4
    for j in range(16):
        y[o + j] = (L[j] & 0xF) | ((L[j + 16] & 0xF) << 4)


@njit(cache=True, parallel=True)
def _quantize_legacy_w(x, qw, row_sigma2, out, nmax, with_min):
    # quantize_row_q4_0_impl (nmax 8, block 18 B: d (f16), qs[16]), q4_1_impl (nmax 15,
    # 20 B: d, m (f16), qs[16]; y = d*q + m), q5_0_impl (nmax 16, 22 B: d, qh[4], qs[16]),
    # q5_1_impl (nmax 31, 24 B: d, m, qh[4], qs[16]); the types with a min fit it by
    # make_qkx3_quants, the others by make_qx_quants
    type_size = out.shape[1] // (x.shape[1] // 32)
    for r in prange(x.shape[0]):
        t0, t1, t2 = _qx_scratch()
        L, Laux, weight = np.empty(32, np.int64), np.empty(32, np.int64), np.empty(32, np.float32)
        sigma2 = _row_sigma2(x, r, row_sigma2)
        for b in range(x.shape[1] // 32):
            xb = x[r, 32 * b:32 * b + 32]
            y = out[r, type_size * b:type_size * (b + 1)]
            _imatrix_weights(weight, qw[32 * b:32 * b + 32], sigma2, xb)
            if with_min:
                d, the_min = _make_qkx3_quants(nmax, xb, weight, L, Laux, f32(-0.9), f32(0.05), 36)
                _put_f16(y, 2, _fp16(-the_min)[0])
            else:
                d = _make_qx_quants_w(nmax, xb, L, weight, t0, t1, t2)
            _put_f16(y, 0, _fp16(d)[0])
            _pack_legacy(L, y, 4 if with_min else 2, nmax >= 16)


# ------------------------------------------------------------------------ K-quants
@njit(cache=True, parallel=True)
def _quantize_q2_k_w(x, qw, row_sigma2, out):
    # quantize_row_q2_K_impl; block layout as quantize._quantize_q2_k
    for r in prange(x.shape[0]):
        L, Laux, Lt, Ls, Lm, weights, sw, scales, mins = _k_scratch(16)
        for b in range(x.shape[1] // QK_K):
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            y = out[r, b * 84:(b + 1) * 84]
            _k_weights(weights, sw, qw[b * QK_K:(b + 1) * QK_K], xb, _sum_sq(xb) / f32(QK_K), 16)
            for j in range(16):
                a = 16 * j
                scales[j], mins[j] = _make_qkx3_quants(
                    3, xb[a:a + 16], weights[a:a + 16], L[a:a + 16], Laux, f32(-0.9), f32(0.05), 36)
            hd, dm = _fp16(_make_qp_quants(15, scales, Ls, sw))
            hm, mm = _fp16(_make_qp_quants(15, mins, Lm, sw))
            for j in range(16):
                y[j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
            _q2_k_levels(xb, y, L, hd, dm, hm, mm)


@njit(cache=True, parallel=True)
def _quantize_q3_k_w(x, qw, row_sigma2, out):
    # quantize_row_q3_K_impl; block layout as quantize._quantize_q3_k
    for r in prange(x.shape[0]):
        t0, t1, t2 = _qx_scratch()
        L, Laux, Lt, Ls, Lm, weights, sw, scales, mins = _k_scratch(16)
        for b in range(x.shape[1] // QK_K):
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            y = out[r, b * 110:(b + 1) * 110]
            _k_weights(weights, sw, qw[b * QK_K:(b + 1) * QK_K], xb, f32(2) * _sum_sq(xb) / f32(QK_K), 16)
            for j in range(16):
                a = 16 * j
                scales[j] = _make_qx_quants_w(4, xb[a:a + 16], L[a:a + 16], weights[a:a + 16], t0, t1, t2)
            y[96:108] = 0
            d_block = _make_qx_quants_w(32, scales, Ls, sw, t0, t1, t2)
            for j in range(16):
                _put_q3_k_scale(y, j, Ls[j])
            hd, d_all = _fp16(d_block)
            _q3_k_levels(xb, y, L, hd, d_all)


@njit(cache=True, inline="always")
def _qkx3_block_45(xb, qwb, y, L, Laux, Lt, Ls, Lm, weights, sw, scales, mins, nmax):
    """Front half of quantize_row_q4_K_impl / q5_K_impl: per 32-value sub-block
    make_qkx3_quants with weights qw*sqrt(sigma2 + x^2), 6-bit scales and mins by
    make_qp_quants packed at y[4:16], d/dmin at y[0:4], then L requantized."""
    _k_weights(weights, sw, qwb, xb, f32(2) * _sum_sq(xb) / f32(QK_K), 8)
    for j in range(0, 8, 2):
        a, b, c = 32 * j, 32 * j + 32, 32 * j + 64
        scales[j], mins[j], scales[j + 1], mins[j + 1] = _make_qkx3_quants_2(
            nmax, xb[a:b], weights[a:b], L[a:b], xb[b:c], weights[b:c], L[b:c], Lt, Laux, f32(-0.9), f32(0.05), 36)
    d_block = _make_qp_quants(63, scales, Ls, sw)
    m_block = _make_qp_quants(63, mins, Lm, sw)
    y[4:16] = 0
    for j in range(8):
        ls = Ls[j]
        lm = Lm[j]
        if nmax == 31:            # q5_K clamps; q4_K stores the uint8 as it is
            ls = min(63, ls)
            lm = min(63, lm)
        _pack_scale_min_k4(j, ls, lm, y, 4)
    hd, d = _fp16(d_block)
    hm, dmin = _fp16(m_block)
    _k45_levels(xb, y, L, nmax, hd, d, hm, dmin)


@njit(cache=True, parallel=True)
def _quantize_q45_k_w(x, qw, row_sigma2, out, nmax):
    # quantize_row_q4_K_impl (nmax 15) / q5_K_impl (nmax 31); block layouts as
    # quantize._quantize_q45_k
    type_size = 144 if nmax == 15 else 176
    for r in prange(x.shape[0]):
        L, Laux, Lt, Ls, Lm, weights, sw, scales, mins = _k_scratch(8)
        for b in range(x.shape[1] // QK_K):
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            y = out[r, b * type_size:(b + 1) * type_size]
            _qkx3_block_45(xb, qw[b * QK_K:(b + 1) * QK_K], y, L, Laux, Lt, Ls, Lm, weights, sw, scales, mins, nmax)
            _pack_q45_k(L, y, nmax)


@njit(cache=True, parallel=True)
def _quantize_q6_k_w(x, qw, row_sigma2, out):
    # quantize_row_q6_K_impl (weights = qw as they are); block layout as quantize._quantize_q6_k
    for r in prange(x.shape[0]):
        t0, t1, t2 = _qx_scratch()
        L, scales = np.empty(QK_K, np.int64), np.empty(16, np.float32)
        for b in range(x.shape[1] // QK_K):
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            y = out[r, b * 210:(b + 1) * 210]
            for j in range(16):
                a = b * QK_K + 16 * j
                scales[j] = _make_qx_quants_w(32, xb[16 * j:16 * j + 16], L[16 * j:16 * j + 16], qw[a:a + 16],
                                              t0, t1, t2)
            _q6_k_block(xb, y, L, scales)


# --------------------------------------------------------------------- Python API
_KERNELS = {            # type: (kernel, its arguments after x, qw, row_sigma2 and out)
    T.Q4_0: (_quantize_legacy_w, (8, False)), T.Q4_1: (_quantize_legacy_w, (15, True)),
    T.Q5_0: (_quantize_legacy_w, (16, False)), T.Q5_1: (_quantize_legacy_w, (31, True)),
    T.Q2_K: (_quantize_q2_k_w, ()), T.Q3_K: (_quantize_q3_k_w, ()), T.Q4_K: (_quantize_q45_k_w, (15,)),
    T.Q5_K: (_quantize_q45_k_w, (31,)), T.Q6_K: (_quantize_q6_k_w, ()),
    **{t: (k, ()) for t, k in IQ4_WEIGHTED_KERNELS.items()},   # IQ4_NL, IQ4_XS: quantize_iq4.py
}
WEIGHTED: frozenset = frozenset(_KERNELS)
"""Types with an importance-weighted quantizer (all others ignore the weights, as in llama.cpp)."""


def quantize_weighted(data: np.ndarray, qtype, quant_weights: np.ndarray | None,
                      row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """quantize_<type>(data, ..., quant_weights) of ggml-quants.c.

    data (n_rows, n_cols) float32; quant_weights (n_cols,) non-negative importances
    (imatrix: mean x^2 per input column), or None for the plain quantizer
    (:func:`quantize`), which is also what Q8_0 and float types get. row_sigma2
    (n_rows,) overrides the legacy types' per-row mean x^2 (K-quants ignore it).
    Returns uint8 (n_rows, row_bytes). Raises ValueError for bad shapes/weights.
    """
    qtype = T[qtype] if isinstance(qtype, str) and qtype in T.__members__ else qtype
    if quant_weights is None or qtype not in WEIGHTED:
        return quantize(data, qtype)
    qtype = T(qtype)
    data, row_bytes = checked_rows(data, qtype)
    n_rows, n_cols = data.shape
    qw = np.ascontiguousarray(quant_weights, dtype=np.float32)
    if qw.shape != (n_cols,):
        raise ValueError(f"{qtype.name}: {qw.shape[0] if qw.ndim == 1 else qw.shape} importance "
                         f"weights for {n_cols} columns")
    if not np.all(np.isfinite(qw)) or np.any(qw < 0):
        raise ValueError(f"{qtype.name}: importance weights must be finite and non-negative")
    sig = np.full(n_rows, -1.0, np.float32) if row_sigma2 is None else \
        np.ascontiguousarray(row_sigma2, dtype=np.float32).reshape(n_rows)
    out = np.empty((n_rows, row_bytes), dtype=np.uint8)
    kernel, params = _KERNELS[qtype]
    if out.size:
        kernel(data, qw, sig, out, *params)
    return out
