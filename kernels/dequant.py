"""Numba CPU dequantization of GGUF tensor data to float32.

Mirrors ``gguf.quants.dequantize`` (gguf-py ``quants.py``: ``dequantize_blocks``
of each quant class, plus the F32/F16 views) bit for bit, which in turn follows
llama.cpp's ``dequantize_row_*`` in ``ggml-quants.c``. Every float operation is
done in float32 in the same order as gguf-py, e.g. for the K-quants the
per-sub-block products ``d * sc`` and ``dmin * m`` are rounded to f32 first, then
``y = (d*sc) * q - (dmin*m)``.

gguf-py vs ggml-quants.c: the operation order is the same for every type here
(ggml: ``x*d`` for Q8_0, ``x*d + m`` for Q4_1/Q5_1, ``d1*q - m1`` for the
K-quants, ``d*sc*q`` = ``(d*sc)*q`` for Q6_K). The one way ggml can differ is
when its C compiler contracts ``a*b + c`` into an FMA (GCC's default
``-ffp-contract=fast`` on FMA-capable builds); numpy and these kernels never
fuse (no ``fastmath``), so the oracle here is gguf-py.

Layout: kernels are plain loops compiled lazily (``cache=True``, no eager
signatures, nothing compiled at import) and never allocate; the Python
wrappers check arguments and the caller owns the output buffer. Each type has
one kernel ``_deq_<type>(data, rows, gather, out)``: a ``prange`` loop over
output rows (source row ``rows[i]`` when gathering, else ``i``) around a plain
loop over the row's blocks. (One kernel per type rather than a generic driver
closing over a row function: numba's on-disk cache misses closures over
dispatchers in every new process.) What several types decode alike is one helper
inlined into each kernel (numba's `inline="always"`, before LLVM sees the loop): a
block's leading f16 scale (`_d_block`), Q5_0/Q5_1's 5-bit pairs (`_q5_pair`), Q4_K/Q5_K's
scale pairs (`_k4_pair_scales`), where Q2_K/Q3_K's 2-bit quants lie (`_q2_place`), the
codebook types' 16-byte loop (`_put_codes`). The inner loops index with unsigned integers
and take the bytes' bit fields in int32, which lets LLVM vectorize them: Q4_K
went from 0.57 to 0.06 ns a weight on two threads. Q5_K and Q6_K walk their
sub-blocks as ggml does (constant shifts over 32 bytes), Q8_0 reads its bytes as
int8: 1.2x, 3.5x and 1.9x faster than one shift pair per sub-block and a
hand-made sign extension. The 16-value loops (Q4_0, Q4_1, Q2_K, Q3_K) count to a
16 the compiler cannot see (`_n16`), so they are vectorized instead of unrolled:
2-3x faster; Q8_0's 32-value loop likewise (`_n32`).

numba computes integer arithmetic in int64 whatever the operands' width, and AVX2
has no int64 -> float conversion of a vector: loops whose bit fields stayed int64
converted lane by lane. So the bit fields are taken by `_field` ((v >> s) & mask
in int32) and turned into floats by `_small_int_to_f32` (from the low 32 bits),
and F16 halves are decoded by an int32 intrinsic: every vector loop here runs in
8-lane int32. `python bench/dequant.py --threads 1` (Zen 3, Gweights/s before ->
after): F16 1.07 -> 3.4, Q8_0 2.1 -> 7.4, Q4_0 5.5 -> 7.5, Q4_1 4.7 -> 5.8, Q5_0 3.8
-> 7.1, Q5_1 3.4 -> 5.7, Q2_K 3.8 -> 5.1, Q3_K 2.1 -> 2.8, Q4_K 4.7 -> 6.3, Q5_K 3.2
-> 5.3, Q6_K 3.7 -> 6.0 (BF16, 11, has no bit fields). Results are bit for bit the same.

MXFP4, IQ4_NL and IQ4_XS (the types of many mixture-of-experts files) map each 4-bit
code through a 16-entry table (`_KV_MXFP4`, `_KV_IQ4NL`: ggml's kvalues as float32)
times a scale: MXFP4's is a power of two from one byte (`_e8m0_half`), the others' an
f16 (IQ4_XS: times a 6-bit sub-block scale). Their loops are the 16-value ones of
Q4_0 with a table read in place of the subtraction: on a shared Sapphire Rapids VM,
one thread, Q4_K 3.9, Q4_0 3.7, MXFP4 3.2, IQ4_NL 3.1, IQ4_XS 2.8 Gweights/s
(`python bench/dequant.py --threads 1 --types Q4_K,Q4_0,MXFP4,IQ4_NL,IQ4_XS`).
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as _gguf_dequantize
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

QK_K = 256  # super-block size of the K-quants
_U = np.uint64  # inner-loop indices: unsigned, so numba emits no negative-index wraparound
#                 and LLVM vectorizes the loops (int32 lanes for the bytes' bit fields)

__all__ = ["NUMBA_TYPES", "dequantize_into", "dequantize_rows_into", "dequantize"]


# ---------------------------------------------------------------- bit helpers
@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (no conversion)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        u32 = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(u32, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_bf16(typingctx, v):
    """bf16 bits (uint16) of a float32: round to nearest even, a NaN kept with its sign
    and top payload and made quiet, as kernels/bf16.py's `to_bf16`. In 32-bit lanes (the
    carry of the rounding can overflow only for NaN bits, which the select drops)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        c = lambda n: ir.Constant(i32, n)
        b = builder.bitcast(args[0], i32)
        hi = builder.lshr(b, c(16))
        rounded = builder.lshr(builder.add(builder.add(b, c(0x7FFF)), builder.and_(hi, c(1))), c(16))
        nan = builder.icmp_unsigned(">", builder.and_(b, c(0x7FFFFFFF)), c(0x7F800000))
        return builder.trunc(builder.select(nan, builder.or_(hi, c(0x40)), rounded), ir.IntType(16))

    return types.uint16(v), codegen


def _put(dst, j, v):
    """dst[j] = v (a float32): stored as is in a float32 row, or as its bf16 bits in a
    uint16 row (the kernels then dequantize straight to bf16, `dequantize_into`)."""
    raise NotImplementedError("numba only")


@overload(_put, inline="always")
def _put_numba(dst, j, v):
    if dst.dtype == types.uint16:
        def store_bf16(dst, j, v):
            dst[j] = _f32_to_bf16(v)
        return store_bf16

    def store(dst, j, v):
        dst[j] = v
    return store


def _get(src, i):
    """src[i] as the kernels compute with it: a float as is, or the float32 value of bf16
    bits (a uint16 array: activations saved in bf16, train/buffers.py)."""
    raise NotImplementedError("numba only")


@overload(_get, inline="always")
def _get_numba(src, i):
    if src.dtype == types.uint16:
        def load_bf16(src, i):
            return _bits_to_f32(np.uint32(src[i]) << np.uint32(16))
        return load_bf16
    return lambda src, i: src[i]


def _kept(dst, i, v):
    """v as it is kept: with dst None v itself; else v rounded to bf16, its bits stored
    in dst[i] (uint16), and the rounded value returned, so that a kernel computes with
    exactly what it saves."""
    raise NotImplementedError("numba only")


@overload(_kept, inline="always")
def _kept_numba(dst, i, v):
    if isinstance(dst, (types.NoneType, types.Omitted)):
        return lambda dst, i, v: v

    def keep_bf16(dst, i, v):
        b = _f32_to_bf16(v)
        dst[i] = b
        return _bits_to_f32(np.uint32(b) << np.uint32(16))
    return keep_bf16


@intrinsic
def _small_int_to_f32(typingctx, v):
    """float32 of an integer known to fit in int32 (a quant's bit field), converted
    from its low 32 bits. numba widens int32 arithmetic to int64, and a vector of
    int64 has no float conversion on AVX2: LLVM then converts lane by lane. Taking
    the low 32 bits first lets it narrow the bit-field arithmetic to int32 lanes."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.int32)
        return builder.sitofp(x, ir.FloatType())

    return types.float32(v), codegen


@intrinsic
def _field(typingctx, v, shift, mask):
    """(v >> shift) & mask in int32 lanes (v a byte or a 32-bit word, 0 <= shift < 32):
    one bit field of a quant, computed without numba's widening to int64 (see
    `_small_int_to_f32`), so the loops that take several fields of one byte vectorize
    8 to a register."""
    if not all(isinstance(a, types.Integer) for a in (v, shift, mask)):
        return None

    def codegen(context, builder, sig, args):
        x, s, m = (context.cast(builder, a, t, types.int32) for a, t in zip(args, sig.args))
        return builder.and_(builder.lshr(x, s), m)

    return types.int32(v, shift, mask), codegen


@njit(cache=True, inline="always")
def _u16(src, o):
    """Little-endian uint16 at byte offset o, as int64."""
    return np.int64(src[o]) | (np.int64(src[o + 1]) << 8)


@njit(cache=True, inline="always")
def _i8(b):
    """uint8 byte -> signed int8 value, as int64."""
    v = np.int64(b)
    return v - ((v & 0x80) << 1)


@intrinsic
def _half_bits_to_f32(typingctx, h):
    """Exact IEEE half -> float32 from the 16 low bits of an integer (same bits as
    numpy's cast: subnormals normalised, inf kept, NaN payload kept unquieted).
    Branch-free and in 32-bit lanes, so a loop of it vectorizes 8 to a register: the
    same steps written in numba run in int64 (numba widens int32 arithmetic), which
    AVX2 cannot convert to float in a vector (module docstring).
        normal:    sign | (exp + 112) << 23 | mant << 13   (exp 31: 0x7F800000, inf/NaN)
        subnormal: sign | bits(mant * 2^-24)                (exact in float32; 0 -> +-0)"""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32, f32 = ir.IntType(32), ir.FloatType()

        def c(v):
            return ir.Constant(i32, v)
        x = context.cast(builder, args[0], sig.args[0], types.uint32)
        sign = builder.shl(builder.and_(x, c(0x8000)), c(16))
        exp = builder.and_(builder.lshr(x, c(10)), c(0x1F))
        mant = builder.and_(x, c(0x3FF))
        ebits = builder.select(builder.icmp_unsigned("==", exp, c(0x1F)), c(0x7F800000),
                               builder.shl(builder.add(exp, c(112)), c(23)))
        normal = builder.or_(builder.or_(sign, ebits), builder.shl(mant, c(13)))
        sub = builder.fmul(builder.sitofp(mant, f32), ir.Constant(f32, 2.0 ** -24))
        subnormal = builder.or_(builder.bitcast(sub, i32), sign)
        bits = builder.select(builder.icmp_unsigned("==", exp, c(0)), subnormal, normal)
        return builder.bitcast(bits, f32)

    return types.float32(h), codegen


@njit(cache=True, inline="always")
def _f16(src, o):
    """float16 stored at byte offset o of src, as float32."""
    return _half_bits_to_f32(_u16(src, o))


@njit(cache=True, inline="always")
def _u32(src, o):
    """Little-endian uint32 at byte offset o, as int64."""
    return _u16(src, o) | (_u16(src, o + 2) << 16)


@njit(cache=True, inline="always")
def _d_block(src, b, size):
    """Block b of a row of 32-value blocks of `size` bytes that open with their scale
    d (f16) and go on with their quants (Q8_0, Q4_0, IQ4_NL): (d, the quants' byte
    offset, the block's first value)."""
    o = size * b
    return _f16(src, o), _U(o + 2), _U(32 * b)


@njit(cache=True, inline="always")
def _src_row(rows, gather, i):
    """Source row of output row i: rows[i] when gathering, else i."""
    return rows[i] if gather else np.int64(i)


@njit(cache=True, inline="always")
def _n32(dst):
    """32, as a number LLVM cannot see (every K-quant or Q8_0 row holds at least 32
    values): as `_n16`, so the 32-value loops are vectorized, not unrolled."""
    return _U(min(32, dst.shape[0]))


@njit(cache=True, inline="always")
def _n16(dst):
    """16, as a number LLVM cannot see (every row holds at least 32 values): a loop
    of a constant 16 trips is fully unrolled before the loop vectorizer runs, and
    the unrolled scalar code is what runs (Q4_0: 1.7 Gw/s against 5.1 vectorized)."""
    return _U(min(16, dst.shape[0]))


# ------------------------------------------------------- plain float types
@njit(cache=True, parallel=True)
def _deq_f32(data, rows, gather, out, n_cols):
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        for j in range(dst.shape[0]):
            _put(dst, j, _bits_to_f32(_u32(src, 4 * j)))  # bit copy, NaN payloads kept


@njit(cache=True, parallel=True)
def _deq_f16(data, rows, gather, out, n_cols):
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        h16 = src.view(np.uint16)  # little-endian halves (the row's bytes are 2-aligned)
        for j in range(_U(dst.shape[0])):
            _put(dst, j, _half_bits_to_f32(h16[j]))


@njit(cache=True, parallel=True)
def _deq_bf16(data, rows, gather, out, n_cols):
    # gguf-py: (int16 -> int32 << 16).view(float32) == bits << 16
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        for j in range(dst.shape[0]):
            _put(dst, j, _bits_to_f32(_u16(src, 2 * j) << 16))


# -------------------------------------------------- 32-value legacy blocks
@njit(cache=True, parallel=True)
def _deq_q8_0(data, rows, gather, out, n_cols):
    # block_q8_0 (34 B): d(f16) qs[32](int8);  y = q * d
    # (the row's bytes read as int8: a sign extension LLVM vectorizes, 1.9x faster
    # than extending the uint8 by hand)
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        s8 = src.view(np.int8)
        n32 = _n32(dst)
        for b in range(dst.shape[0] // 32):
            d, qs, y = _d_block(src, b, 34)
            for j in range(n32):
                _put(dst, y + j, np.float32(s8[qs + j]) * d)


@njit(cache=True, parallel=True)
def _deq_q4_0(data, rows, gather, out, n_cols):
    # block_q4_0 (18 B): d(f16) qs[16];  y[j] = d*((qs[j]&15)-8), y[j+16] = d*((qs[j]>>4)-8)
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        n16 = _n16(dst)
        for b in range(dst.shape[0] // 32):
            d, qs, y = _d_block(src, b, 18)
            for j in range(n16):
                q = np.int32(src[qs + j])
                _put(dst, y + j, d * _small_int_to_f32((q & 0xF) - 8))
                _put(dst, y + j + _U(16), d * _small_int_to_f32((q >> 4) - 8))


@njit(cache=True, parallel=True)
def _deq_q4_1(data, rows, gather, out, n_cols):
    # block_q4_1 (20 B): d(f16) m(f16) qs[16];  y = (d*q) + m
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        n16 = _n16(dst)
        for b in range(dst.shape[0] // 32):
            o = 20 * b
            d = _f16(src, o)
            m = _f16(src, o + 2)
            qs, y = _U(o + 4), _U(32 * b)
            for j in range(n16):
                q = np.int32(src[qs + j])
                _put(dst, y + j, d * _small_int_to_f32(q & 0xF) + m)
                _put(dst, y + j + _U(16), d * _small_int_to_f32(q >> 4) + m)


@njit(cache=True, inline="always")
def _q5_pair(src, qs, qh, j):
    """5-bit values j and j + 16 of a Q5_0 / Q5_1 block: the low and high nibble of
    byte qs + j, with bits j and j + 16 of the 32-bit qh as their 5th bits."""
    q = np.int32(src[qs + _U(j)])
    return (_field(q, 0, 0xF) | (_field(qh, j, 1) << 4),
            _field(q, 4, 0xF) | (_field(qh, j + 16, 1) << 4))


@njit(cache=True, parallel=True)
def _deq_q5_0(data, rows, gather, out, n_cols):
    # block_q5_0 (22 B): d(f16) qh[4](u32 LE, bit j = 5th bit of value j) qs[16];
    # y = d*(q-16)
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        for b in range(dst.shape[0] // 32):
            o = 22 * b
            d = _f16(src, o)
            qh, qs, y = _u32(src, o + 2), _U(o + 6), _U(32 * b)
            for j in range(16):
                q0, q1 = _q5_pair(src, qs, qh, j)
                _put(dst, y + _U(j), d * _small_int_to_f32(q0 - 16))
                _put(dst, y + _U(j + 16), d * _small_int_to_f32(q1 - 16))


@njit(cache=True, parallel=True)
def _deq_q5_1(data, rows, gather, out, n_cols):
    # block_q5_1 (24 B): d(f16) m(f16) qh[4] qs[16];  y = (d*q) + m
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        for b in range(dst.shape[0] // 32):
            o = 24 * b
            d = _f16(src, o)
            m = _f16(src, o + 2)
            qh, qs, y = _u32(src, o + 4), _U(o + 8), _U(32 * b)
            for j in range(16):
                q0, q1 = _q5_pair(src, qs, qh, j)
                _put(dst, y + _U(j), d * _small_int_to_f32(q0) + m)
                _put(dst, y + _U(j + 16), d * _small_int_to_f32(q1) + m)


# ---------------------------------------------------- 256-value K-quants
@njit(cache=True, inline="always")
def _q2_place(sb):
    """Where the 2-bit quants of 16-value sub-block sb of a Q2_K / Q3_K super-block
    lie: (byte offset in qs[64], shift). Value i = 16 sb + k is bits 2j..2j+1 of
    qs[32h + l] with h = i >> 7, j = (i >> 5) & 3, l = i & 31."""
    return 32 * (sb >> 3) + 16 * (sb & 1), np.int32(2 * ((sb >> 1) & 3))


@njit(cache=True, parallel=True)
def _deq_q2_k(data, rows, gather, out, n_cols):
    # block_q2_K (84 B): scales[16] (lo nibble: scale, hi: min) qs[64] d(f16) dmin(f16).
    # Value i: h=i>>7, j=(i>>5)&3, l=i&31 -> q = (qs[32h+l] >> 2j) & 3, sub-block i>>4.
    # y = (d*sc)*q - (dmin*m)
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        n16 = _n16(dst)
        for b in range(dst.shape[0] // QK_K):
            o = 84 * b
            d = _f16(src, o + 80)
            dmin = _f16(src, o + 82)
            for sb in range(16):
                s = np.int64(src[o + sb])
                dl = d * np.float32(s & 0xF)
                ml = dmin * np.float32(s >> 4)
                at, shift = _q2_place(sb)
                qs = _U(o + 16 + at)
                y = _U(QK_K * b + 16 * sb)
                for k in range(n16):
                    q = _field(src[qs + k], shift, 3)
                    _put(dst, y + k, dl * _small_int_to_f32(q) - ml)


@njit(cache=True, parallel=True)
def _deq_q3_k(data, rows, gather, out, n_cols):
    # block_q3_K (110 B): hmask[32] qs[64] scales[12] d(f16).
    # 16 6-bit scales: low 4 bits from scales[sb] (sb<8, lo nibble) / scales[sb-8] (hi
    # nibble), high 2 bits = (scales[8 + sb%4] >> 2*(sb//4)) & 3; scale - 32.
    # Value i: 2 low bits like Q2_K, 3rd bit = (hmask[i&31] >> (i>>5)) & 1, subtract 4
    # when that bit is 0.  y = (d*sc) * q
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        n16 = _n16(dst)
        for b in range(dst.shape[0] // QK_K):
            o = 110 * b
            d = _f16(src, o + 108)
            sc = o + 96
            for sb in range(16):
                lo = np.int64(src[sc + (sb & 7)])
                lo = (lo & 0xF) if sb < 8 else (lo >> 4)
                hi = (np.int64(src[sc + 8 + (sb & 3)]) >> (2 * (sb >> 2))) & 3
                dl = d * np.float32((lo | (hi << 4)) - 32)
                at, shift = _q2_place(sb)
                qs = _U(o + 32 + at)
                hm = _U(o + 16 * (sb & 1))
                hbit = np.int32(sb >> 1)  # == i >> 5 for the values of this sub-block
                y = _U(QK_K * b + 16 * sb)
                for k in range(n16):
                    q = _field(src[qs + k], shift, 3)
                    h = _field(src[hm + k], hbit, 1)
                    _put(dst, y + k, dl * _small_int_to_f32(q - 4 * (1 - h)))


@njit(cache=True, inline="always")
def _scale_min_k4(src, sc, j):
    """6-bit (scale, min) pair j of the 12-byte K4/K5 scales at byte offset sc:
    bytes 0-3 = scale j (j<4) + 2 high bits of j+4, bytes 4-7 = same for mins,
    bytes 8-11 = low 4 bits of scale (lo nibble) and min (hi nibble) j+4."""
    if j < 4:
        s = np.int64(src[sc + j]) & 0x3F
        m = np.int64(src[sc + 4 + j]) & 0x3F
    else:
        md = np.int64(src[sc + 4 + j])
        s = (md & 0xF) | ((np.int64(src[sc + j - 4]) >> 2) & 0x30)
        m = (md >> 4) | ((np.int64(src[sc + j]) >> 2) & 0x30)
    return s, m


@njit(cache=True, inline="always")
def _k4_pair_scales(src, sc, d, dmin, pair):
    """(d*sc, dmin*m) of sub-blocks 2 pair and 2 pair + 1 of a Q4_K / Q5_K
    super-block, whose 12 bytes of scales lie at byte offset sc; each product
    rounded to f32 as gguf-py does."""
    s0, m0 = _scale_min_k4(src, sc, 2 * pair)
    s1, m1 = _scale_min_k4(src, sc, 2 * pair + 1)
    return (d * np.float32(s0), dmin * np.float32(m0),
            d * np.float32(s1), dmin * np.float32(m1))


@njit(cache=True, parallel=True)
def _deq_q4_k(data, rows, gather, out, n_cols):
    # block_q4_K (144 B): d(f16) dmin(f16) scales[12] qs[128].
    # Sub-block sb (32 values): q = (qs[32*(sb//2) + l] >> 4*(sb%2)) & 15.
    # y = (d*sc)*q - (dmin*m)
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        for b in range(dst.shape[0] // QK_K):
            o = 144 * b
            d = _f16(src, o)
            dmin = _f16(src, o + 2)
            for pair in range(4):  # sub-blocks 2 pair (low nibbles), 2 pair + 1 (high)
                dl0, ml0, dl1, ml1 = _k4_pair_scales(src, o + 4, d, dmin, pair)
                qs = _U(o + 16 + 32 * pair)
                y = _U(QK_K * b + 64 * pair)
                for l in range(_U(32)):
                    q = np.int32(src[qs + l])
                    _put(dst, y + l, dl0 * _small_int_to_f32(q & 0xF) - ml0)
                    _put(dst, y + _U(32) + l, dl1 * _small_int_to_f32(q >> 4) - ml1)


@njit(cache=True, parallel=True)
def _deq_q5_k(data, rows, gather, out, n_cols):
    # block_q5_K (176 B): d(f16) dmin(f16) scales[12] qh[32] qs[128].
    # Like Q4_K plus 5th bit (qh[l] >> sb) & 1.  y = (d*sc)*q - (dmin*m)
    # Sub-blocks in pairs, as Q4_K: the low and high nibbles of the same 32 bytes.
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        for b in range(dst.shape[0] // QK_K):
            o = 176 * b
            d = _f16(src, o)
            dmin = _f16(src, o + 2)
            qh = _U(o + 16)
            for pair in range(4):
                dl0, ml0, dl1, ml1 = _k4_pair_scales(src, o + 4, d, dmin, pair)
                h0, h1 = np.int32(2 * pair), np.int32(2 * pair + 1)
                qs = _U(o + 48 + 32 * pair)
                y = _U(QK_K * b + 64 * pair)
                for l in range(_U(32)):
                    q = np.int32(src[qs + l])
                    h = np.int32(src[qh + l])
                    _put(dst, y + l, dl0 * _small_int_to_f32(_field(q, 0, 0xF) | (_field(h, h0, 1) << 4)) - ml0)
                    _put(dst, y + _U(32) + l, dl1 * _small_int_to_f32(_field(q, 4, 0xF) | (_field(h, h1, 1) << 4)) - ml1)


@njit(cache=True, parallel=True)
def _deq_q6_k(data, rows, gather, out, n_cols):
    # block_q6_K (210 B): ql[128] qh[64] scales[16](int8) d(f16).
    # Value i: h=i>>7, r=i&127 -> low 4 bits (ql[64h + (r&63)] >> 4*(r>>6)) & 15,
    # high 2 bits (qh[32h + (r&31)] >> 2*(r>>5)) & 3; q - 32.  y = (d*sc) * q with
    # sc = scales[i // 16]. As ggml's dequantize_row_q6_K: per half h and l < 32, the
    # bytes ql[l], ql[l+32], qh[l] give values l, l+32, l+64, l+96 with constant
    # shifts (a loop LLVM vectorizes, 3x faster than one shift pair per sub-block).
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        for b in range(dst.shape[0] // QK_K):
            o = 210 * b
            d = _f16(src, o + 208)
            for h in range(2):
                ql, qh = _U(o + 64 * h), _U(o + 128 + 32 * h)
                sc = o + 192 + 8 * h
                y = _U(QK_K * b + 128 * h)
                for half in range(2):  # l in [16 half, 16 half + 16): scales sc[half + 0, 2, 4, 6]
                    dl1 = d * np.float32(_i8(src[sc + half]))
                    dl2 = d * np.float32(_i8(src[sc + half + 2]))
                    dl3 = d * np.float32(_i8(src[sc + half + 4]))
                    dl4 = d * np.float32(_i8(src[sc + half + 6]))
                    for l in range(_U(16 * half), _U(16 * half + 16)):
                        a = np.int32(src[ql + l])
                        a2 = np.int32(src[ql + _U(32) + l])
                        hb = np.int32(src[qh + l])
                        _put(dst, y + l, dl1 * _small_int_to_f32((_field(a, 0, 0xF) | (_field(hb, 0, 3) << 4)) - 32))
                        _put(dst, y + _U(32) + l, dl2 * _small_int_to_f32((_field(a2, 0, 0xF) | (_field(hb, 2, 3) << 4)) - 32))
                        _put(dst, y + _U(64) + l, dl3 * _small_int_to_f32((_field(a, 4, 0xF) | (_field(hb, 4, 3) << 4)) - 32))
                        _put(dst, y + _U(96) + l, dl4 * _small_int_to_f32((_field(a2, 4, 0xF) | (_field(hb, 6, 3) << 4)) - 32))


# ------------------------------------------------ 4-bit codebook types
# Each 4-bit code picks one of 16 integers (kvalues_mxfp4, kvalues_iq4nl in
# ggml-common.h), times the block's (or sub-block's) scale: y = kv[q] * d. The table
# is read as float32 (the integers are exact), so the one float operation is the
# product, as in gguf-py and ggml.
_KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)  # e2m1 doubled
_KV_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


@njit(cache=True, inline="always")
def _e8m0_half(e):
    """ggml_e8m0_to_fp32_half: the E8M0 scale byte e as 2^(e - 128), i.e. half of
    2^(e - 127), by its bits (e < 2: the subnormals 2^-128, 2^-127; 255 gives 2^127,
    not a NaN)."""
    e = np.uint32(e)
    return _bits_to_f32(np.uint32(0x00200000) << e if e < 2 else (e - np.uint32(1)) << np.uint32(23))


@njit(cache=True, inline="always")
def _put_codes(dst, y, src, qs, n16, kv, d):
    """The 32 values of 16 bytes of 4-bit codes at byte offset qs, under the scale d:
    dst[y + j] = d * kv[qs[j] & 15], dst[y + j + 16] = d * kv[qs[j] >> 4] (j < n16 = 16).
    (d * kv and kv * d are the same float: MXFP4's kv * d in gguf-py.)"""
    for j in range(n16):
        q = np.uint32(src[qs + j])
        _put(dst, y + j, d * kv[q & np.uint32(0xF)])
        _put(dst, y + j + _U(16), d * kv[q >> np.uint32(4)])


@njit(cache=True, parallel=True)
def _deq_mxfp4(data, rows, gather, out, n_cols):
    # block_mxfp4 (17 B): e(E8M0) qs[16];  d = 2^(e-128),
    # y[j] = kv[qs[j] & 15] * d, y[j+16] = kv[qs[j] >> 4] * d
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        n16 = _n16(dst)
        for b in range(dst.shape[0] // 32):
            o = 17 * b
            _put_codes(dst, _U(32 * b), src, _U(o + 1), n16, _KV_MXFP4, _e8m0_half(src[o]))


@njit(cache=True, parallel=True)
def _deq_iq4_nl(data, rows, gather, out, n_cols):
    # block_iq4_nl (18 B): d(f16) qs[16];  y[j] = d * kv[qs[j] & 15], y[j+16] = d * kv[qs[j] >> 4]
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        n16 = _n16(dst)
        for b in range(dst.shape[0] // 32):
            d, qs, y = _d_block(src, b, 18)
            _put_codes(dst, y, src, qs, n16, _KV_IQ4NL, d)


@njit(cache=True, parallel=True)
def _deq_iq4_xs(data, rows, gather, out, n_cols):
    # block_iq4_xs (136 B): d(f16) scales_h(u16) scales_l[4] qs[128]; 8 sub-blocks of 32.
    # Sub-block s: 6-bit scale ls = (scales_l[s/2] >> 4*(s%2)) & 15 | ((scales_h >> 2s) & 3) << 4,
    # dl = d * (ls - 32);  y[j] = dl * kv[qs[16s+j] & 15], y[j+16] = dl * kv[qs[16s+j] >> 4]
    for i in prange(out.shape[0]):
        src, dst = data[_src_row(rows, gather, i)], out[i, :n_cols]
        n16 = _n16(dst)
        for b in range(dst.shape[0] // QK_K):
            o = 136 * b
            d = _f16(src, o)
            sh = _u16(src, o + 2)
            for s in range(8):
                ls = ((np.int64(src[o + 4 + (s >> 1)]) >> (4 * (s & 1))) & 0xF) | (((sh >> (2 * s)) & 3) << 4)
                dl = d * np.float32(ls - 32)
                _put_codes(dst, _U(QK_K * b + 32 * s), src, _U(o + 8 + 16 * s), n16, _KV_IQ4NL, dl)


# ------------------------------------------------------------ dispatch
_KERNELS = {int(t): k for t, k in {
    T.F32: _deq_f32, T.F16: _deq_f16, T.BF16: _deq_bf16,
    T.Q8_0: _deq_q8_0, T.Q4_0: _deq_q4_0, T.Q4_1: _deq_q4_1,
    T.Q5_0: _deq_q5_0, T.Q5_1: _deq_q5_1,
    T.Q2_K: _deq_q2_k, T.Q3_K: _deq_q3_k, T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k, T.Q6_K: _deq_q6_k,
    T.MXFP4: _deq_mxfp4, T.IQ4_NL: _deq_iq4_nl, T.IQ4_XS: _deq_iq4_xs,
}.items()}

NUMBA_TYPES: frozenset[int] = frozenset(_KERNELS)
"""GGML type ids (``gguf.GGMLQuantizationType`` values) with a numba kernel."""

_NO_ROWS = np.zeros(0, dtype=np.int64)


# ------------------------------------------------------------ Python API
def _type_name(qtype: int) -> str:
    try:
        return T(qtype).name
    except ValueError:
        raise ValueError(f"unknown GGML tensor type id {qtype!r}") from None


def _check(data: np.ndarray, qtype: int, out: np.ndarray, n_rows: int, n_cols: int | None = None):
    """Validate arguments; return the kernel for qtype and the row width written."""
    name = _type_name(qtype)
    kernel = _KERNELS.get(int(qtype))
    if kernel is None:
        raise ValueError(f"no numba dequantization kernel for GGML type {name}")
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.flags.c_contiguous):
        raise ValueError("data must be a C-contiguous 2-D uint8 array (n_rows, row_bytes)")
    if not (isinstance(out, np.ndarray) and out.dtype in (np.float32, np.uint16) and out.ndim == 2
            and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be a writeable C-contiguous 2-D float32 (or uint16: bf16 bits) array")
    block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    if n_cols is None:
        n_cols = out.shape[1]
    if not 0 <= n_cols <= out.shape[1]:
        raise ValueError(f"{name}: n_cols {n_cols} does not fit out's rows of {out.shape[1]}")
    if n_cols % block_size != 0:
        raise ValueError(f"{name}: n_cols {n_cols} is not a multiple of block size {block_size}")
    if data.shape[1] != n_cols // block_size * type_size:
        raise ValueError(f"{name}: row of {n_cols} values takes "
                         f"{n_cols // block_size * type_size} bytes, data rows have {data.shape[1]}")
    if out.shape[0] != n_rows:
        raise ValueError(f"out has {out.shape[0]} rows, expected {n_rows}")
    return kernel, n_cols


def dequantize_into(data: np.ndarray, qtype: int, out: np.ndarray, n_cols: int | None = None) -> None:
    """Dequantize all rows: out[i] = dequant(data[i]), or out[i, :n_cols] = dequant(data[i])
    (the other columns untouched) where out's rows are wider than the tensor's.

    data: raw bytes as a C-contiguous uint8 array of shape (n_rows, row_bytes)
    (callers pass tensor bytes viewed as uint8); out: float32 C-contiguous
    (n_rows, >= n_cols), or uint16 for the values' bf16 bits (rounded to nearest even
    as they are stored: kernels/bf16.py's dequantize_into). Parallel over rows
    (numba prange)."""
    data = np.asarray(data)  # memmap subclass -> plain ndarray view
    kernel, n_cols = _check(data, qtype, out, data.shape[0] if data.ndim == 2 else -1, n_cols)
    kernel(data, _NO_ROWS, False, out, n_cols)


def dequantize_rows_into(data: np.ndarray, qtype: int, rows: np.ndarray, out: np.ndarray) -> None:
    """Gather + dequantize: out[i] = dequant(data[rows[i]]); rows int64 1-D,
    each in [0, n_rows). Used for embedding lookup."""
    data = np.asarray(data)
    if not (isinstance(rows, np.ndarray) and rows.dtype == np.int64 and rows.ndim == 1):
        raise ValueError("rows must be a 1-D int64 array")
    kernel, n_cols = _check(data, qtype, out, rows.shape[0])
    if rows.size and (rows.min() < 0 or rows.max() >= data.shape[0]):
        raise IndexError(f"row index out of range [0, {data.shape[0]})")
    kernel(data, rows, True, out, n_cols)


def dequantize(data, qtype: int, n_cols: int) -> np.ndarray:
    """Convenience: dequantize tensor data (any dtype/shape holding whole rows of
    n_cols values) to a new float32 array of shape (n_rows, n_cols).
    Types not in NUMBA_TYPES fall back to gguf.quants.dequantize."""
    name = _type_name(qtype)
    block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    if n_cols <= 0 or n_cols % block_size != 0:
        raise ValueError(f"{name}: n_cols {n_cols} is not a positive multiple of block size {block_size}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1, n_cols // block_size * type_size)
    if int(qtype) not in NUMBA_TYPES:
        try:
            res = _gguf_dequantize(raw, T(qtype))
        except NotImplementedError:
            raise ValueError(f"dequantization of GGML type {name} is not supported") from None
        return np.ascontiguousarray(res, dtype=np.float32).reshape(-1, n_cols)
    out = np.empty((raw.shape[0], n_cols), dtype=np.float32)
    dequantize_into(raw, qtype, out)
    return out
