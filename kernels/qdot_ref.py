"""numpy references of kernels/qdot.py: activation rows quantized per block and their
dot products with quantized weight rows, in the float order of llama.cpp's x86 kernels
(32-value types) or of its generic C (K-quants).

Mirrors, statement for statement where floats are involved:
    quantize_row_q8_0_ref, quantize_row_q8_1_ref, quantize_row_q8_K_ref   (ggml-quants.c)
    ggml_vec_dot_<type>_q8_<x> (AVX2, no fused multiply-add) for Q4_0, Q4_1, Q5_0, Q5_1,
        Q8_0                                                 (ggml-cpu/arch/x86/quants.c)
    ggml_vec_dot_<type>_q8_K_generic for Q2_K..Q6_K                  (ggml-cpu/quants.c)
The integer parts of a dot (sums of int8 x small-int products, times 6-bit scales) are
exact, so they are computed here in int64 in any order; every float operation (the
block scales' products, the 32-value types' eight float lanes across blocks and their
sum, the K-quants' eight float lanes `sums[l] += d * aux32[l]` and their final sum) is
done in float32, one numpy op per C operation, in the C order, with no fused
multiply-add: the oracle the numba kernels are compared with bit for bit. (ggml's C compiler may contract `a*b + c`
into an FMA; kernels/dequant.py's docstring says the same of its oracle.)

Quantized activations are returned as `QuantizedRows` of plain arrays rather than
llama.cpp's interleaved block bytes: qs (G, K) int8, d (G, K/bs) float32 (the f16
scale's value for q8_0/q8_1, the float scale of q8_K), s (G, K/32) float32 (q8_1's
f16 `s` = sum(qs) * d) and bsums (G, K/16) int32 (q8_K's sums of 16 values).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

F32 = np.float32
QK_K = 256

# the activation quantization each weight type's dot takes (ggml-cpu's type_traits_cpu vec_dot_type)
ACTIVATION = {int(t): a for t, a in {
    T.Q4_0: "q8_0", T.Q5_0: "q8_0", T.Q8_0: "q8_0", T.Q4_1: "q8_1", T.Q5_1: "q8_1",
    T.Q2_K: "q8_K", T.Q3_K: "q8_K", T.Q4_K: "q8_K", T.Q5_K: "q8_K", T.Q6_K: "q8_K"}.items()}
BLOCK = {"q8_0": 32, "q8_1": 32, "q8_K": QK_K}


class QuantizedRows(NamedTuple):
    qs: np.ndarray      # (G, K) int8 quants (numba: their values as float32)
    d: np.ndarray       # (G, K / block) float32 scales
    s: np.ndarray       # (G, K / 32) float32: q8_1's f16(sum(qs) * d); (G, 0) otherwise
    bsums: np.ndarray   # (G, K / 16) int32: q8_K's sums of 16 quants; (G, 0) otherwise


def _f16_round(v: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 then back: round to nearest even f16, as float32."""
    return np.asarray(v, F32).astype(np.float16).astype(F32)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf (halves away from zero), exact in float32 (gguf-py's np_roundf)."""
    a = np.abs(v)
    fl = np.floor(a)
    return np.sign(v) * (fl + np.floor(2 * (a - fl)))


def quantize_rows_ref(x: np.ndarray, kind: str) -> QuantizedRows:
    """x (G, K) float32 -> its rows quantized as llama.cpp's quantize_row_<kind>_ref."""
    x = np.asarray(x, F32)
    G, K = x.shape
    bs = BLOCK[kind]
    xb = x.reshape(G, K // bs, bs)
    none = np.zeros((G, 0), F32)
    if kind in ("q8_0", "q8_1"):
        d = np.max(np.abs(xb), axis=-1) / F32(127)                       # amax / ((1 << 7) - 1)
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)        # id = d ? 1.0f/d : 0.0f
        qs = _roundf(xb * inv[..., None]).astype(np.int8)
        s = none
        if kind == "q8_1":
            s = _f16_round(qs.astype(np.int64).sum(-1).astype(F32) * d)  # GGML_FP32_TO_FP16(sum*d)
        return QuantizedRows(qs.reshape(G, K), _f16_round(d), s, np.zeros((G, 0), np.int32))
    # q8_K: the first value of largest magnitude sets iscale = -127 / max
    idx = np.argmax(np.abs(xb), axis=-1)
    mx = np.take_along_axis(xb, idx[..., None], -1)[..., 0]
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, F32(1), F32(-127) / np.where(zero, F32(1), mx)).astype(F32)
    q = np.minimum(np.rint(iscale[..., None] * xb), 127)                 # MIN(127, nearest_int(iscale*x))
    qs = np.where(zero[..., None], 0, q).astype(np.int8)
    d = np.where(zero, F32(0), F32(1) / iscale).astype(F32)
    bsums = qs.reshape(G, K // 16, 16).astype(np.int32).sum(-1, dtype=np.int32)
    return QuantizedRows(qs.reshape(G, K), d, none, bsums)


# ------------------------------------------------------------ weight unpacking
def _blocks(data: np.ndarray, qtype: int) -> np.ndarray:
    bs, ts = GGML_QUANT_SIZES[T(qtype)]
    return np.ascontiguousarray(data).reshape(data.shape[0], -1, ts)


def _f16(b: np.ndarray, o: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., o:o + 2]).view(np.float16)[..., 0].astype(F32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    q = qs.astype(np.int64)
    return np.concatenate([q & 0xF, q >> 4], axis=-1)


def _high_bits(b: np.ndarray, o: int) -> np.ndarray:
    """Q5_0/Q5_1's qh (uint32 LE at byte o): bit j is the 5th bit of value j -> (..., 32)."""
    qh = np.ascontiguousarray(b[..., o:o + 4]).view("<u4")[..., 0].astype(np.int64)
    return (qh[..., None] >> np.arange(32)) & 1


def unpack_legacy(data: np.ndarray, qtype: int):
    """32-value blocks -> (w (N, nb, 32) int64 as the dot multiplies them, d, m or None)."""
    b = _blocks(data, qtype)
    qtype = T(qtype)
    if qtype == T.Q8_0:
        return b[..., 2:34].view(np.int8).astype(np.int64), _f16(b, 0), None
    if qtype == T.Q4_0:
        return _nibbles(b[..., 2:18]) - 8, _f16(b, 0), None
    if qtype == T.Q4_1:
        return _nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2)
    if qtype == T.Q5_0:
        return (_nibbles(b[..., 6:22]) | (_high_bits(b, 2) << 4)) - 16, _f16(b, 0), None
    if qtype == T.Q5_1:
        return _nibbles(b[..., 8:24]) | (_high_bits(b, 4) << 4), _f16(b, 0), _f16(b, 2)
    raise ValueError(f"not a 32-value block type: {qtype.name}")


def _scale_min_k4(sc: np.ndarray):
    """The 8 6-bit scales and mins of Q4_K/Q5_K's 12 scale bytes -> two (N, nb, 8) arrays."""
    s = sc.astype(np.int64)
    scales = np.concatenate([s[..., 0:4] & 0x3F, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([s[..., 4:8] & 0x3F, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return scales, mins


def unpack_k(data: np.ndarray, qtype: int):
    """256-value super-blocks -> (w (N, nb, 256) int64, sc16 (N, nb, 16) int64 the scale of
    each 16 values, mn16 (N, nb, 16) int64 the min each bsum multiplies or None, d, dmin
    or None), values in their natural order (value i of a block at w[..., i])."""
    b = _blocks(data, qtype)
    qtype = T(qtype)
    N, nb = b.shape[:2]
    if qtype == T.Q2_K:
        sc = b[..., 0:16].astype(np.int64)
        qs = b[..., 16:80].astype(np.int64).reshape(N, nb, 2, 1, 32)          # (half, shift, l)
        w = ((qs >> (2 * np.arange(4))[:, None]) & 3).reshape(N, nb, QK_K)
        return w, sc & 0xF, sc >> 4, _f16(b, 80), _f16(b, 82)
    if qtype == T.Q3_K:
        hm = b[..., 0:32].astype(np.int64)
        qs = b[..., 32:96].astype(np.int64).reshape(N, nb, 2, 1, 32)
        low = ((qs >> (2 * np.arange(4))[:, None]) & 3).reshape(N, nb, 8, 32)
        high = (hm[..., None, :] >> np.arange(8)[:, None]) & 1                # bit j of hmask: values 32j..
        w = (low - 4 * (1 - high)).reshape(N, nb, QK_K)
        s = b[..., 96:108].astype(np.int64)
        lo = np.concatenate([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], -1)
        hi = (s[..., 8 + np.arange(16) % 4] >> (2 * (np.arange(16) // 4))) & 3
        return w, (lo | (hi << 4)) - 32, None, _f16(b, 108), None
    if qtype in (T.Q4_K, T.Q5_K):
        scales, mins = _scale_min_k4(b[..., 4:16])
        o = 16 if qtype == T.Q4_K else 48
        qs = b[..., o:o + 128].astype(np.int64).reshape(N, nb, 4, 1, 32)
        w = ((qs >> np.array([0, 4])[:, None]) & 0xF).reshape(N, nb, 8, 32)
        if qtype == T.Q5_K:
            qh = b[..., 16:48].astype(np.int64)
            w = w | (((qh[..., None, :] >> np.arange(8)[:, None]) & 1) << 4)
        return w.reshape(N, nb, QK_K), np.repeat(scales, 2, -1), np.repeat(mins, 2, -1), _f16(b, 0), _f16(b, 2)
    if qtype == T.Q6_K:
        ql = b[..., 0:128].astype(np.int64).reshape(N, nb, 2, 64)
        qh = b[..., 128:192].astype(np.int64).reshape(N, nb, 2, 32)
        low = np.stack([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], 2)
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)              # (N, nb, 4, 2, 32)
        w = ((low | (high << 4)) - 32).transpose(0, 1, 3, 2, 4).reshape(N, nb, QK_K)
        return w, b[..., 192:208].view(np.int8).astype(np.int64), None, _f16(b, 208), None
    raise ValueError(f"not a K-quant: {qtype.name}")


# ------------------------------------------------------------ dot products
def _legacy_dot_ref(xq: QuantizedRows, data: np.ndarray, qtype: int) -> np.ndarray:
    """ggml_vec_dot_{q4_0,q5_0,q8_0}_q8_0 / {q4_1,q5_1}_q8_1 in the order of ggml's x86
    kernels (arch/x86/quants.c, AVX2), every pair of rows: each block's products summed
    four consecutive values to a lane (eight int32 lanes, `mul_sum_i8_pairs_float`), the
    lanes accumulated across blocks in eight float lanes acc[l] += (d_x*d_y) * lane[l]
    (a multiply and an add: no fused multiply-add), then hsum_float_8(acc) = ((acc0 +
    acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)); Q4_1/Q5_1 add summs, the
    blocks' m_x*s_y summed in order."""
    w, dx, mx = unpack_legacy(data, qtype)
    G, nb = xq.d.shape
    N = w.shape[0]
    lanes = np.einsum("gblj,nblj->gnbl", xq.qs.astype(np.int64).reshape(G, nb, 8, 4),
                      w.reshape(N, nb, 8, 4)).astype(F32)                         # exact
    acc = np.zeros((G, N, 8), F32)
    summs = np.zeros((G, N), F32)
    for b in range(nb):
        d = dx[None, :, b] * xq.d[:, None, b]                          # d_x*d_y
        acc += d[..., None] * lanes[:, :, b]
        if mx is not None:
            summs += mx[None, :, b] * xq.s[:, None, b]                 # summs += m_x*s_y
    t = acc[..., :4] + acc[..., 4:]
    u = t[..., :2] + t[..., 2:]
    sumf = u[..., 0] + u[..., 1]
    return sumf + summs if mx is not None else sumf


def _k_dot_ref(xq: QuantizedRows, data: np.ndarray, qtype: int) -> np.ndarray:
    """ggml_vec_dot_{q2,q3,q4,q5,q6}_K_q8_K (generic), every pair of rows."""
    w, sc16, mn16, dx, dminx = unpack_k(data, qtype)
    G, nb = xq.d.shape
    N = w.shape[0]
    x = xq.qs.astype(np.int64).reshape(G, nb, 16, 2, 8)              # value i = 16 j + 8 h + l
    wl = w.reshape(N, nb, 16, 2, 8)
    if qtype == T.Q2_K:
        isum = np.einsum("gbjhl,nbjhl,nbj->gnb", x, wl, sc16).astype(F32)
        summs = np.einsum("gbj,nbj->gnb", xq.bsums.astype(np.int64).reshape(G, nb, 16), mn16).astype(F32)
        sumf = np.zeros((G, N), F32)
        for b in range(nb):
            yd = xq.d[:, None, b]
            dall, dmin = yd * dx[None, :, b], yd * dminx[None, :, b]
            sumf += dall * isum[:, :, b] - dmin * summs[:, :, b]
        return sumf
    aux32 = np.einsum("gbjhl,nbjhl,nbj->gnbl", x, wl, sc16).astype(F32)   # exact: below 2^24
    sums = np.zeros((G, N, 8), F32)
    sumf = np.zeros((G, N), F32)
    if mn16 is not None:                                             # Q4_K, Q5_K: the mins
        sumi = np.einsum("gbj,nbj->gnb", xq.bsums.astype(np.int64).reshape(G, nb, 16), mn16).astype(F32)
    for b in range(nb):
        yd = xq.d[:, None, b]
        d = dx[None, :, b] * yd
        sums += d[..., None] * aux32[:, :, b, :]
        if mn16 is not None:
            sumf -= (dminx[None, :, b] * yd) * sumi[:, :, b]
    for l in range(8):
        sumf += sums[..., l]
    return sumf


def qdot_ref(x: np.ndarray, data: np.ndarray, qtype: int) -> np.ndarray:
    """y (G, N) = x (G, K) W^T as llama.cpp's CPU backend computes it for a quantized W
    (N rows of raw bytes): x's rows quantized to the type's activation blocks, then one
    generic vec_dot per (row of x, row of W)."""
    qtype = int(qtype)
    if qtype not in ACTIVATION:
        raise ValueError(f"no quantized dot product for GGML type {qtype}")
    xq = quantize_rows_ref(x, ACTIVATION[qtype])
    if GGML_QUANT_SIZES[T(qtype)][0] == 32:
        return _legacy_dot_ref(xq, data, qtype)
    return _k_dot_ref(xq, data, qtype)
