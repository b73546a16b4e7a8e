"""Quantization of float32 rows into GGUF blocks, for writing tensors in the base
model's quant type.

* F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4: dispatched to ``gguf.quants.quantize``
  (gguf-py already mirrors llama.cpp's ``quantize_row_*_ref`` for these; MXFP4's was
  checked byte for byte against ``quantize_row_mxfp4_ref`` on 139264 blocks: normal,
  tiny and huge scales, zero blocks, powers of two, 1 - 2^-24).
* Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (gguf-py can only dequantize them): numba ports of
  llama.cpp's ``quantize_row_q{2,3,4,5,6}_K_ref`` and their helpers
  ``make_qkx2_quants`` / ``make_q3_quants`` / ``make_qx_quants`` (ggml/src/ggml-quants.c).
  These ``_ref`` functions are exactly what ``llama-quantize`` runs when it has no
  importance matrix: ``quantize_qX_K(src, dst, nrow, n_per_row, NULL)`` calls
  ``quantize_row_qX_K_ref`` on the whole tensor (the ``_impl`` variants with
  ``make_qkx3_quants`` / ``make_qp_quants`` are only used with an imatrix).

Exactness: every C ``float`` operation is a float32 operation here, in the C order
(``w*l*l`` is ``(w*l)*l``; ints are converted to float32 where C converts them);
``nearest_int`` is ggml's add-1.5*2^23 bit trick and ``GGML_FP32_TO_FP16`` a
bit-exact round-to-nearest-even float32 -> half. numba never fuses a*b+c into an
FMA (no fastmath), like a llama.cpp build that does not contract (``-ffp-contract=off``
or no FMA in the target ISA). Checked: byte-identical on every block to that C code
built with ``gcc -O3 -ffp-contract=off``; a ``-march=native`` GCC build (FMA
contraction) differs in 1-30 % of blocks, and llama-quantize's output for the
reference models in shared/models agrees with the non-FMA results.

Kernels are compiled lazily on first use (``cache=True``); each handles a
(n_rows, n_cols) float32 array with a ``prange`` over rows, blocks being independent.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import quantize as _gguf_quantize
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .quantize_iq4 import IQ4_KERNELS

__all__ = ["QUANTIZABLE", "quantize"]

QK_K = 256  # super-block size of the K-quants
f32 = np.float32
GROUP_MAX_EPS = f32(1e-15)  # ggml-quants.c: a group with max |x| below this is all zero


# ---------------------------------------------------------------- scalar helpers
@intrinsic
def _f32_bits(typingctx, x):
    """The 32 bits of a float32 as an int32 (no conversion)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(v, ir.IntType(32))

    return types.int32(x), codegen


@njit(cache=True, inline="always")
def _nearest_int(fval):
    """ggml's nearest_int: adding 1.5*2^23 leaves round-half-even(fval) in the low
    mantissa bits of the float32 sum (garbage outside |fval| <= 2^22, as in C)."""
    v = f32(f32(fval) + f32(12582912.0))
    return (np.int64(_f32_bits(v)) & 0x7FFFFF) - 0x400000


@njit(cache=True, inline="always")
def _half_value(h):
    """float32 value of IEEE half bits h (exact)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        v = f32(np.inf) if m == 0 else f32(np.nan)
    elif e == 0:
        v = f32(m) * f32(2.0 ** -24)
    else:
        v = f32(m + 1024) * f32(2.0 ** (e - 25))
    return -v if h & 0x8000 else v


@njit(cache=True, inline="always")
def _fp16(x):
    """GGML_FP32_TO_FP16 (round to nearest, ties to even; NaN quietened), returned
    as (half bits, float32 value of that half = GGML_FP16_TO_FP32 of it)."""
    b = np.int64(_f32_bits(f32(x))) & 0xFFFFFFFF
    sign = (b >> 16) & 0x8000
    exp = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    e = exp - 112  # half exponent field if normal
    if exp == 0xFF:
        h = 0x7C00 | ((0x200 | (mant >> 13)) if mant else 0)
    elif e >= 31:
        h = 0x7C00
    elif e <= 0:  # half subnormal (or zero): 24-bit significand shifted right
        if e < -10:
            h = 0
        else:
            m = mant | 0x800000
            shift = 14 - e
            h = m >> shift
            rem = m & ((1 << shift) - 1)
            half = 1 << (shift - 1)
            if rem > half or (rem == half and (h & 1)):
                h += 1
    else:
        h = (e << 10) | (mant >> 13)
        rem = mant & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1)):
            h += 1  # a carry into the exponent is right (up to inf)
    h |= sign
    return h, _half_value(h)


@njit(cache=True, inline="always")
def _put_f16(y, o, h):
    y[o] = h & 0xFF
    y[o + 1] = (h >> 8) & 0xFF


@njit(cache=True, inline="always")
def _pack_2bit(L, y, o):
    # Q2_K / Q3_K qs: byte o+j/4+l of each 128-chunk j holds L[j+l+32k] at bits 2k
    for j in range(0, QK_K, 128):
        for l in range(32):
            y[o + j // 4 + l] = (L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4)
                                 | (L[j + l + 96] << 6))


# ---------------------------------------------------------- ggml-quants.c helpers
@njit(cache=True, inline="always")
def _qk_stats(x, w):
    """make_qkx2/qkx3_quants' first pass: (min clamped to at most 0, max, sum w, sum w x),
    each in index order."""
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, x.shape[0]):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = f32(0)
    return mn, mx, sum_w, sum_x


@njit(cache=True, inline="always")
def _qk_fit(sum_w, sum_x, sum_l, sum_l2, sum_xl):
    """One trial's weighted least-squares refit: (D, scale, min), min at most 0;
    scale and min are 0 where D <= 0 (the trial is then skipped)."""
    D = sum_w * sum_l2 - sum_l * sum_l
    this_scale = f32(0)
    this_min = f32(0)
    if D > 0:
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        if this_min > 0:
            this_min = f32(0)
            this_scale = sum_xl / sum_l2
    return D, this_scale, this_min


@njit(cache=True, inline="always")
def _qk_start(nmax, x, w, L, mn, mx, use_mad):
    """The levels 0..nmax of the block's own range [mn, mx]: (scale, their weighted
    error, sum w |diff| with use_mad, else sum w diff^2, in index order); L filled."""
    iscale = f32(nmax) / (mx - mn)
    scale = f32(1) / iscale
    err = f32(0)
    for i in range(x.shape[0]):
        l = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
        L[i] = l
        diff = scale * f32(l) + mn - x[i]
        err += w[i] * (abs(diff) if use_mad else diff * diff)
    return scale, err


@njit(cache=True)
def _make_qkx2_quants(nmax, x, w, L, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants: asymmetric levels 0..nmax, x ~ scale*L - the_min; a scan
    over nstep+1 trial inverse scales with a weighted least-squares (scale, min)
    fit each. Returns (scale, the_min); L filled. With use_mad false it is also
    make_qkx3_quants with weights (quantize_weighted)."""
    n = x.shape[0]
    mn, mx, sum_w, sum_x = _qk_stats(x, w)
    if mx == mn:
        L[:n] = 0
        return f32(0), -mn
    fnmax = f32(nmax)
    scale, best_error = _qk_start(nmax, x, w, L, mn, mx, use_mad)
    if nstep < 1:
        return scale, -mn
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * f32(step) + fnmax) / (mx - mn)
        sum_l = f32(0)
        sum_l2 = f32(0)
        sum_xl = f32(0)
        for i in range(n):
            l = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
            Laux[i] = l
            fl = f32(l)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D, this_scale, this_min = _qk_fit(sum_w, sum_x, sum_l, sum_l2, sum_xl)
        if D > 0:
            cur_error = f32(0)
            for i in range(n):
                diff = this_scale * f32(Laux[i]) + this_min - x[i]
                cur_error += w[i] * (abs(diff) if use_mad else diff * diff)
            if cur_error < best_error:
                L[:n] = Laux[:n]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(cache=True, inline="always")
def _abs_max(x):
    """(max |x|, the x attaining it first)."""
    amax = f32(0)
    mx = f32(0)
    for i in range(x.shape[0]):
        if abs(x[i]) > amax:
            amax = abs(x[i])
            mx = x[i]
    return amax, mx


@njit(cache=True)
def _make_qx_quants(nmax, x, L):
    """make_qx_quants with rmse_type=1, qw=NULL (weights x^2): symmetric levels
    -nmax..nmax-1 stored as L+nmax; 19 trial scales, keeps the best weighted fit."""
    n = x.shape[0]
    amax, mx = _abs_max(x)
    if amax < GROUP_MAX_EPS:
        L[:n] = 0
        return f32(0)
    fnmax = f32(nmax)
    iscale = -fnmax / mx
    sumlx = f32(0)
    suml2 = f32(0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = x[i] * x[i]
        fl = f32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != 0 else f32(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + f32(0.1) * f32(step)) / mx
        sumlx = f32(0)
        suml2 = f32(0)
        for i in range(n):
            fl = f32(max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i]))))
            w = x[i] * x[i]
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True)
def _make_q3_quants(nmax, x, L):
    """make_q3_quants with do_rmse=true: symmetric levels, then up to 5 sweeps of
    per-element level changes that improve the x^2-weighted fit; L+nmax stored."""
    n = x.shape[0]
    amax, mx = _abs_max(x)
    if amax < GROUP_MAX_EPS:
        L[:n] = 0
        return f32(0)
    iscale = -f32(nmax) / mx
    sumlx = f32(0)
    suml2 = f32(0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * f32(l)
        suml2 += w * f32(l) * f32(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            li = f32(L[i])
            slx = sumlx - w * x[i] * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, _nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * f32(new_l)
                    sl2 += w * f32(new_l) * f32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else f32(0)


@njit(cache=True, inline="always")
def _scale_min_k4(j, y, o):
    """get_scale_min_k4: 6-bit (scale, min) of sub-block j from the 12 bytes at y[o:]."""
    a, b, c = np.int64(y[o + j - 4]), np.int64(y[o + j]), np.int64(y[o + j + 4])
    if j < 4:
        return b & 63, c & 63
    return (c & 0xF) | ((a >> 6) << 4), (c >> 4) | ((b >> 6) << 4)


@njit(cache=True, inline="always")
def _pack_scale_min_k4(j, ls, lm, y, o):
    # 12 bytes: sub-blocks 0-3 keep 6-bit scale/min in bytes j/j+4; 4-7 put their
    # low nibbles in byte j+4 and their top 2 bits in the top bits of bytes j-4/j
    if j < 4:
        y[o + j] = ls
        y[o + j + 4] = lm
    else:
        y[o + j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
        y[o + j - 4] |= (ls >> 4) << 6
        y[o + j] |= (lm >> 4) << 6


# ------------------------------------------------- block tails (shared with quantize_weighted)
@njit(cache=True, inline="always")
def _q2_k_levels(xb, y, L, hd, d, hm, dmin):
    """The end of a Q2_K block once its 4-bit scales (low nibbles) and mins (high) are
    in y[0:16]: d, dmin (half bits hd, hm; values d, dmin) at y[80:84], the levels 0..3
    requantized with the rounded scales and packed into qs at y[16:80]."""
    _put_f16(y, 80, hd)
    _put_f16(y, 82, hm)
    for j in range(16):
        dl = d * f32(y[j] & 0xF)
        if dl == 0:
            continue
        ml = dmin * f32(y[j] >> 4)
        for i in range(16):
            L[16 * j + i] = max(0, min(3, _nearest_int((xb[16 * j + i] + ml) / dl)))
    _pack_2bit(L, y, 16)


@njit(cache=True, inline="always")
def _put_q3_k_scale(y, j, l):
    # 6-bit scale l (0..63) of sub-block j: low nibble in byte 96+j (j < 8, else the high
    # nibble of byte 96+j-8), top 2 bits in byte 104 + j%4 at bits 2*(j//4); y[96:108] zeroed first
    if j < 8:
        y[96 + j] = l & 0xF
    else:
        y[96 + j - 8] |= (l & 0xF) << 4
    y[104 + j % 4] |= (l >> 4) << (2 * (j // 4))


@njit(cache=True, inline="always")
def _q3_k_levels(xb, y, L, hd, d_all):
    """The end of a Q3_K block once its 6-bit scales are in y[96:108]: d at y[108:110],
    the levels -4..3 requantized with the rounded scales, their bit 2 into hmask
    (y[0:32]) and the low 2 bits into qs (y[32:96])."""
    _put_f16(y, 108, hd)
    for j in range(16):
        sc = (np.int64(y[96 + j]) & 0xF) if j < 8 else (np.int64(y[96 + j - 8]) >> 4)
        sc = (sc | (((np.int64(y[104 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        dl = d_all * f32(sc)
        if dl == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, _nearest_int(xb[16 * j + i] / dl))) + 4
    y[:32] = 0
    for j in range(QK_K):
        if L[j] > 3:
            y[j % 32] |= 1 << (j // 32)
            L[j] -= 4
    _pack_2bit(L, y, 32)


@njit(cache=True, inline="always")
def _k45_levels(xb, y, L, nmax, hd, d, hm, dmin):
    """The end of a Q4_K / Q5_K block's front half once its 6-bit scales and mins are
    at y[4:16]: d, dmin at y[0:4], the levels 0..nmax requantized with the rounded ones."""
    _put_f16(y, 0, hd)
    _put_f16(y, 2, hm)
    for j in range(8):
        sc, m = _scale_min_k4(j, y, 4)
        dl = d * f32(sc)
        if dl == 0:
            continue
        ml = dmin * f32(m)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, _nearest_int((xb[32 * j + i] + ml) / dl)))


@njit(cache=True, inline="always")
def _pack_q45_k(L, y, nmax):
    # Q4_K (nmax 15): qs[128] at y[16:], 64-value chunk c has L[64c..64c+31] in the low
    # nibbles and L[64c+32..64c+63] in the high nibbles of bytes 32c..32c+31.
    # Q5_K (nmax 31): qh[32] at y[16:48] (bit 4 of value 64c+l at bit 2c of byte l, of
    # 64c+32+l at bit 2c+1), then the low 4 bits as Q4_K's qs at y[48:]
    o = 16
    if nmax == 31:
        o = 48
        y[16:48] = 0
        for c in range(4):
            for l in range(32):
                y[16 + l] |= ((L[64 * c + l] >> 4) << (2 * c)) | ((L[64 * c + l + 32] >> 4) << (2 * c + 1))
    for c in range(4):
        for l in range(32):
            y[o + 32 * c + l] = (L[64 * c + l] & 0xF) | ((L[64 * c + l + 32] & 0xF) << 4)


# ------------------------------------------------------------------ K-quant rows
@njit(cache=True, parallel=True)
def _quantize_q2_k(x, out):
    # block_q2_K (84 B): scales[16] (low nibble scale, high nibble min, 4 bits each),
    # qs[64] (2-bit quants), d (f16), dmin (f16);  y = d*sc*q - dmin*m
    for r in prange(x.shape[0]):
        L = np.empty(QK_K, np.int64)
        Laux = np.empty(16, np.int64)
        weights = np.empty(16, np.float32)
        mins = np.empty(16, np.float32)
        scales = np.empty(16, np.float32)
        for b in range(x.shape[1] // QK_K):
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            y = out[r, b * 84:(b + 1) * 84]
            max_scale = f32(0)
            max_min = f32(0)
            for j in range(16):
                xs = xb[16 * j:16 * j + 16]
                for l in range(16):
                    weights[l] = abs(xs[l])
                scales[j], mins[j] = _make_qkx2_quants(
                    3, xs, weights, L[16 * j:16 * j + 16], Laux, f32(-0.5), f32(0.1), 15, True)
                if scales[j] > max_scale:
                    max_scale = scales[j]
                if mins[j] > max_min:
                    max_min = mins[j]
            if max_scale > 0:
                iscale = f32(15) / max_scale
                for j in range(16):
                    y[j] = _nearest_int(iscale * scales[j]) & 0xFF
                hd, d = _fp16(max_scale / f32(15))
            else:
                y[:16] = 0
                hd, d = _fp16(f32(0))
            if max_min > 0:
                iscale = f32(15) / max_min
                for j in range(16):
                    y[j] |= (_nearest_int(iscale * mins[j]) << 4) & 0xFF
                hm, dmin = _fp16(max_min / f32(15))
            else:
                hm, dmin = _fp16(f32(0))
            _q2_k_levels(xb, y, L, hd, d, hm, dmin)


@njit(cache=True, inline="always")
def _q3_k_block(xb, y, L, scales):
    # block_q3_K (110 B): hmask[32] (bit 2 of each quant: value j in byte j%32,
    # bit j//32), qs[64] (low 2 bits), scales[12] (16 6-bit scales+32: low nibbles in
    # bytes 0-7, top 2 bits in bytes 8-11), d (f16);  y = d*(sc-32)*(q-4)
    for j in range(16):
        scales[j] = _make_q3_quants(4, xb[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
    max_scale = _abs_max(scales)[1]
    y[96:108] = 0
    if max_scale != 0:
        iscale = f32(-32) / max_scale
        for j in range(16):
            # C stores nearest_int into an int8_t before clamping
            l = np.int64(np.int8(_nearest_int(iscale * scales[j]) & 0xFF))
            _put_q3_k_scale(y, j, max(-32, min(31, l)) + 32)
        hd, d_all = _fp16(f32(1) / iscale)
    else:
        hd, d_all = _fp16(f32(0))
    _q3_k_levels(xb, y, L, hd, d_all)


@njit(cache=True, parallel=True)
def _quantize_q3_k(x, out):
    for r in prange(x.shape[0]):
        L, scales = np.empty(QK_K, np.int64), np.empty(16, np.float32)
        for b in range(x.shape[1] // QK_K):
            _q3_k_block(x[r, b * QK_K:(b + 1) * QK_K], out[r, b * 110:(b + 1) * 110], L, scales)


@njit(cache=True, inline="always")
def _qkx_block_45(xb, y, L, Laux, weights, scales, mins, nmax, rmin, nstep):
    """Shared front half of quantize_row_q4_K_ref / q5_K_ref: per 32-value sub-block
    make_qkx2_quants with weights av_x + |x|, 6-bit scales/mins packed at y[4:16],
    d/dmin at y[0:4], then requantize L (0..nmax) with the rounded scales."""
    max_scale = f32(0)
    max_min = f32(0)
    for j in range(8):
        xs = xb[32 * j:32 * j + 32]
        sum_x2 = f32(0)
        for l in range(32):
            sum_x2 += xs[l] * xs[l]
        av_x = f32(np.sqrt(sum_x2 / f32(32)))
        for l in range(32):
            weights[l] = av_x + abs(xs[l])
        scales[j], mins[j] = _make_qkx2_quants(
            nmax, xs, weights, L[32 * j:32 * j + 32], Laux, rmin, f32(0.1), nstep, False)
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = f32(63) / max_scale if max_scale > 0 else f32(0)
    inv_min = f32(63) / max_min if max_min > 0 else f32(0)
    for j in range(8):
        ls = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)  # C: uint8_t, then MIN
        lm = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
        _pack_scale_min_k4(j, ls, lm, y, 4)
    hd, d = _fp16(max_scale / f32(63))
    hm, dmin = _fp16(max_min / f32(63))
    _k45_levels(xb, y, L, nmax, hd, d, hm, dmin)


@njit(cache=True, parallel=True)
def _quantize_q45_k(x, out, nmax, rmin, nstep):
    # block_q4_K (nmax 15, 144 B): d, dmin (f16), scales[12] (8 6-bit scale/min pairs,
    # get_scale_min_k4 packing), qs[128] (_pack_q4_k); block_q5_K (nmax 31, 176 B): the
    # same, qh[32] between scales and qs (_pack_q5_k)
    type_size = 144 if nmax == 15 else 176
    for r in prange(x.shape[0]):
        L, Laux = np.empty(QK_K, np.int64), np.empty(32, np.int64)
        weights, scales, mins = np.empty(32, np.float32), np.empty(8, np.float32), np.empty(8, np.float32)
        for b in range(x.shape[1] // QK_K):
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            y = out[r, b * type_size:(b + 1) * type_size]
            _qkx_block_45(xb, y, L, Laux, weights, scales, mins, nmax, rmin, nstep)
            _pack_q45_k(L, y, nmax)


@njit(cache=True, inline="always")
def _q6_k_block(xb, y, L, scales):
    # the rest of a Q6_K block once its 16 sub-block scales are chosen (shared with
    # quantize_weighted): the int8 scales, the 6-bit values, their layout (see _quantize_q6_k);
    # all zero where the largest |scale| is below GROUP_MAX_EPS
    max_abs_scale, max_scale = _abs_max(scales)
    if max_abs_scale < GROUP_MAX_EPS:
        y[:] = 0
        return
    iscale = f32(-128) / max_scale
    hd, d = _fp16(f32(1) / iscale)
    _put_f16(y, 208, hd)
    for j in range(16):
        y[192 + j] = min(127, _nearest_int(iscale * scales[j])) & 0xFF
    for j in range(16):
        sc = np.int64(np.int8(y[192 + j]))
        dl = d * f32(sc)
        if dl == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, _nearest_int(xb[16 * j + i] / dl))) + 32
    for h in range(2):
        for l in range(32):
            q1 = L[128 * h + l]
            q2 = L[128 * h + l + 32]
            q3 = L[128 * h + l + 64]
            q4 = L[128 * h + l + 96]
            y[64 * h + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            y[64 * h + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            y[128 + 32 * h + l] = ((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4)
                                   | ((q4 >> 4) << 6))


@njit(cache=True, parallel=True)
def _quantize_q6_k(x, out):
    # block_q6_K (210 B): ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16]
    # (int8), d (f16);  y = d*sc*(q-32). In 128-value half h, value 32k+l (k<4) has
    # its low nibble in ql[64h + l + 32*(k&1)] (high nibble if k>=2) and its top
    # bits in qh[32h + l] at bit 2k.
    for r in prange(x.shape[0]):
        L, scales = np.empty(QK_K, np.int64), np.empty(16, np.float32)
        for b in range(x.shape[1] // QK_K):
            xb = x[r, b * QK_K:(b + 1) * QK_K]
            y = out[r, b * 210:(b + 1) * 210]
            for j in range(16):
                scales[j] = _make_qx_quants(32, xb[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
            _q6_k_block(xb, y, L, scales)


# --------------------------------------------------------------------- Python API
_K_KERNELS = {          # type: (kernel, its arguments after x and out)
    T.Q2_K: (_quantize_q2_k, ()),
    T.Q3_K: (_quantize_q3_k, ()),
    T.Q4_K: (_quantize_q45_k, (15, f32(-1.0), 20)),
    T.Q5_K: (_quantize_q45_k, (31, f32(-0.5), 15)),
    T.Q6_K: (_quantize_q6_k, ()),
    **{t: (k, ()) for t, k in IQ4_KERNELS.items()},   # IQ4_NL, IQ4_XS: quantize_iq4.py
}
_GGUF_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4})

QUANTIZABLE: frozenset = frozenset(_K_KERNELS) | _GGUF_TYPES
"""GGML types :func:`quantize` can produce (GGMLQuantizationType members, int-equal)."""


def _type_name(qtype) -> str:
    try:
        return T(qtype).name
    except ValueError:
        return f"type {qtype!r}"


def quantize(data: np.ndarray, qtype) -> np.ndarray:
    """Quantize float32 rows into GGUF blocks of ``qtype``.

    data: (n_rows, n_cols), converted to float32; n_cols a multiple of the block
    size (256 for K-quants, 32 for the legacy quants, 1 for float types).
    Returns uint8 (n_rows, row_bytes) in the GGUF block layout. Raises ValueError,
    naming the type, for a type outside :data:`QUANTIZABLE` or a bad shape.
    """
    if isinstance(qtype, str):
        qtype = T[qtype] if qtype in T.__members__ else qtype
    if qtype not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {_type_name(qtype)}: supported types are "
                         + ", ".join(sorted(t.name for t in QUANTIZABLE)))
    qtype = T(qtype)
    data, row_bytes = checked_rows(data, qtype)
    if qtype in _K_KERNELS:
        out = np.empty((data.shape[0], row_bytes), dtype=np.uint8)
        kernel, params = _K_KERNELS[qtype]
        if out.size:
            kernel(data, out, *params)
        return out
    q = np.ascontiguousarray(_gguf_quantize(data, qtype))
    return q.view(np.uint8).reshape(data.shape[0], row_bytes)


def checked_rows(data: np.ndarray, qtype: T) -> tuple[np.ndarray, int]:
    """(data as C-contiguous float32 rows, the bytes of one quantized row); raises
    ValueError, naming the type, unless data is 2-D with rows a whole number of blocks."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.ndim != 2:
        raise ValueError(f"{qtype.name}: expected a 2-D (n_rows, n_cols) array, got shape {data.shape}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if data.shape[1] % block_size:
        raise ValueError(f"{qtype.name}: row length {data.shape[1]} is not a multiple of {block_size}")
    return data, data.shape[1] // block_size * type_size
