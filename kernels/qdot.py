"""Numba CPU products of float activations with quantized weight rows, as llama.cpp's
CPU backend computes them: y (G, N) = x (G, K) W^T with W's N rows left in their GGUF
blocks (no dequantized copy).

Each row of x is quantized once per call to the activation blocks the weight type's
dot takes (ggml-cpu's `vec_dot_type`): q8_0 for Q4_0/Q5_0/Q8_0, q8_1 for Q4_1/Q5_1,
q8_K for the K-quants (`quantize_row_q8_0_ref`, `quantize_row_q8_1_ref`,
`quantize_row_q8_K_ref` in ggml-quants.c); each output is then one
`ggml_vec_dot_<type>_q8_<x>_generic` (ggml-cpu/quants.c) of a row of x with a row of
W. kernels/qdot_ref.py holds the numpy references; the kernels here give their bits.

Exactness. A dot is an integer part and a float part. The integer part (the block's
sums of int8 x small-int products, times the 4- to 8-bit sub-block scales, and the
q8_K bsums times the mins) is computed here in float32 on integer values: every
product and partial sum is an integer below 2^24 in magnitude (the largest, Q6_K's
lane sums, is at most 32 x 128 x 127 x 32 = 16,646,144 < 16,777,216), so float32 holds
it exactly in any order, and those loops may regroup and fuse (`fastmath`) to
vectorize. The float part (the scales' products, `sumf += ...` per block, the
K-quants' eight float lanes `sums[l] += d * aux32[l]` and their final sum) runs in
the generic C order with no fused multiply-add, as the reference. The result equals
the reference bit for bit; llama.cpp's own x86 kernels (AVX2/AVX512) regroup these
float sums and round q8_0 activations to nearest even rather than away from zero, so
they differ from the generic order in the last bits.

Layout: one kernel per family (`_dot_legacy`: 32-value blocks, `_dot_k`: 256-value
super-blocks) switching on the GGML type id per block; a `prange` over chunks of
output rows, each chunk with its own scratch (the wrapper's: the kernels never
allocate). The integer sums are LLVM vector IR emitted by intrinsics (`_dot32`,
`_dot_nibbles`, `_lanes256`): written as loops, numba's 32-value sums were unrolled to
scalar code (0.42 against 0.06 ns a product). Legacy blocks are unpacked in registers;
with one activation row (a decode step), eight consecutive blocks of a weight row have
their integer sums reduced together (`_block_sums8`, one shuffle tree instead of eight
reductions) and their float steps then run in order, the scales read where they lie
(the CPU's f16 conversion); with several activation rows, each block is multiplied with
eight rows at a time whose sums are reduced together and whose float steps run side by
side (`_dot32_x8`). K-quant rows are unpacked once into int8 scratch with their scales,
then multiplied with each row.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .dequant import _U, _bits_to_f32, _f16, _field, _i8, _scale_min_k4
from .qdot_ref import ACTIVATION, BLOCK, QuantizedRows

__all__ = ["QDOT_TYPES", "quantize_rows", "qdot_into"]

QK_K = 256
F32 = np.float32
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (int(t) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (int(t) for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K))

QDOT_TYPES: frozenset[int] = frozenset(ACTIVATION)
"""GGML type ids with a quantized dot product here."""


# ------------------------------------------------------------ activation blocks
@intrinsic
def _f32_bits(typingctx, v):
    """The bits of a float32 as uint32 (no conversion)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(v), codegen


@njit(cache=True, inline="always")
def _round_f16(v):
    """GGML_FP32_TO_FP16 and back: v rounded to the nearest even f16, as float32
    (numpy's float32 -> float16 cast: overflow to inf, subnormal halves, inf/NaN kept)."""
    b = np.uint32(_f32_bits(v))
    sign = b & np.uint32(0x80000000)
    a = b & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):                  # inf, NaN
        return v
    if a >= np.uint32(0x477FF000):                  # >= 65520: rounds to inf
        return _bits_to_f32(sign | np.uint32(0x7F800000))
    if a < np.uint32(0x38800000):                   # below 2^-14: a multiple of 2^-24
        r = np.rint(abs(v) * F32(16777216.0)) * F32(5.9604644775390625e-08)
        return -r if sign else r
    r = (a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return _bits_to_f32(sign | r)


@njit(cache=True, inline="always")
def _roundf(v):
    """C roundf (halves away from zero) of a float32, exact."""
    t = np.trunc(v)
    if abs(v - t) >= F32(0.5):
        t += F32(1) if v > 0 else F32(-1)
    return t


@njit(cache=True)
def _quantize_q8_0(x, qs, d, s, with_sum):
    """quantize_row_q8_0_ref (and q8_1_ref with with_sum) of each row of x (G, K):
    int8 quants into qs, the f16 scale's value into d (G, K/32), q8_1's f16(sum(qs) * d)
    into s."""
    for g in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            o = 32 * b
            amax = F32(0)
            for j in range(32):
                av = abs(x[g, o + j])
                if not amax > av:                   # MAX(amax, fabsf(v))
                    amax = av
            db = amax / F32(127)
            inv = F32(1) / db if db != 0 else F32(0)
            total = 0
            for j in range(32):
                q = np.int64(_roundf(x[g, o + j] * inv))
                qs[g, o + j] = q
                total += q
            d[g, b] = _round_f16(db)
            if with_sum:
                s[g, b] = _round_f16(F32(total) * db)


@njit(cache=True)
def _quantize_q8_k(x, qs, d, bsums):
    """quantize_row_q8_K_ref of each row of x (G, K): iscale = -127 / (the first value
    of largest magnitude), q = MIN(127, nearest_int(iscale * x)), d = 1 / iscale."""
    for g in range(x.shape[0]):
        for b in range(x.shape[1] // QK_K):
            o = QK_K * b
            amax, mx = F32(0), F32(0)
            for j in range(QK_K):
                ax = abs(x[g, o + j])
                if ax > amax:
                    amax, mx = ax, x[g, o + j]
            if amax == 0:
                d[g, b] = 0
                qs[g, o:o + QK_K] = 0
                bsums[g, 16 * b:16 * b + 16] = 0
                continue
            iscale = F32(-127) / mx
            for j in range(16):
                t = 0
                for i in range(16):
                    q = np.int64(min(np.rint(iscale * x[g, o + 16 * j + i]), F32(127)))
                    qs[g, o + 16 * j + i] = q
                    t += q
                bsums[g, 16 * b + j] = t
            d[g, b] = F32(1) / iscale


def quantize_rows(x: np.ndarray, kind: str) -> QuantizedRows:
    """x (G, K) float32 -> its rows quantized to `kind` (q8_0, q8_1, q8_K) blocks, the
    same arrays as qdot_ref.quantize_rows_ref."""
    if kind not in BLOCK:
        raise ValueError(f"activation blocks {kind!r}: q8_0, q8_1 or q8_K")
    x = np.ascontiguousarray(x, F32)
    if x.ndim != 2 or x.shape[1] % BLOCK[kind]:
        raise ValueError(f"{kind}: x must be 2-D with rows a multiple of {BLOCK[kind]} values, got {x.shape}")
    G, K = x.shape
    qs, d = np.empty((G, K), np.int8), np.empty((G, K // BLOCK[kind]), F32)
    s = np.empty((G, K // 32 if kind == "q8_1" else 0), F32)
    bsums = np.empty((G, K // 16 if kind == "q8_K" else 0), np.int32)
    if kind == "q8_K":
        _quantize_q8_k(x, qs, d, bsums)
    else:
        _quantize_q8_0(x, qs, d, s, kind == "q8_1")
    return QuantizedRows(qs, d, s, bsums)


# ------------------------------------------------------------ integer dot products
_I8, _I32 = ir.IntType(8), ir.IntType(32)


def _reduce_add(builder, v, n: int):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [ir.VectorType(_I32, n)]),
                                        f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(fn, [v])


def _int8_arrays(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.int8 for a in arrays)


def _load_i16(context, builder, aty, arr, off):
    """32 int8 values at flat offset `off` of C-contiguous array `arr`, sign-extended to
    <32 x i16> (one unaligned load)."""
    a = context.make_array(aty)(context, builder, arr)
    ptr = builder.bitcast(cgutils.gep(builder, a.data, off), ir.VectorType(_I8, 32).as_pointer())
    return builder.sext(builder.load(ptr, align=1), ir.VectorType(ir.IntType(16), 32))


def _host_has(feature: str) -> bool:
    """Whether numba compiles for its own host (no CPU override) and the host has
    `feature` (an LLVM name: avx512bw, f16c): the x86 instructions used where present."""
    from llvmlite import binding
    from numba.core import config
    if config.CPU_NAME or config.CPU_FEATURES:
        return False
    return bool(binding.get_host_cpu_features().get(feature))


_PMADDWD = _host_has("avx512bw")   # `_pairs` calls vpmaddwd (LLVM does not make it of the portable form)
_F16C = _host_has("f16c")          # `_f16_at` converts with vcvtph2ps (else dequant._f16's integer steps)


def _pairs(builder, a, b):
    """<16 x i32> of a_2i b_2i + a_2i+1 b_2i+1 for two <32 x i16> vectors: x86's
    vpmaddwd where the CPU has it (`_PMADDWD`), else the products in 32-bit lanes and
    pairs added. Exact (the products of int8 or 5-bit values with int8 activations, |p| <=
    2^14; two of them fit 32 bits in any case)."""
    v16 = ir.VectorType(_I32, 16)
    if _PMADDWD:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [a.type, b.type]),
                                            "llvm.x86.avx512.pmaddw.d.512")
        return builder.call(fn, [a, b])
    idx = lambda v_: ir.Constant(ir.VectorType(_I32, len(v_)), v_)
    p = builder.mul(builder.sext(a, ir.VectorType(_I32, 32)), builder.sext(b, ir.VectorType(_I32, 32)))
    return builder.add(builder.shuffle_vector(p, p, idx(list(range(0, 32, 2)))),
                       builder.shuffle_vector(p, p, idx(list(range(1, 32, 2)))))


def _madd_sum(builder, a, b):
    """sum_i a_i b_i in int32 of two <32 x i16> vectors (`_pairs`, then one 16-lane
    reduction). Exact."""
    return _reduce_add(builder, _pairs(builder, a, b), 16)


@intrinsic
def _dot32(typingctx, w, wo, x, xo):
    """sum_{i<32} w[wo + i] x[xo + i] in int32 (w, x int8, C-contiguous, flat offsets):
    one 32-value block's integer dot in vector registers, the `sumi` of ggml's legacy
    dots (LLVM's vectorizer leaves the loop form as scalar code once it is unrolled)."""
    if not _int8_arrays(w, x):
        return None

    def codegen(context, builder, sig, args):
        return _madd_sum(builder, _load_i16(context, builder, sig.args[0], args[0], args[1]),
                         _load_i16(context, builder, sig.args[2], args[2], args[3]))

    return types.int32(w, wo, x, xo), codegen


@intrinsic
def _f16_hw(typingctx, src, o):
    """The IEEE half at byte offset o of uint8 array src, as float32 (exact): F16C's
    vcvtph2ps (without F16C LLVM calls a runtime function numba does not link)."""
    if not (isinstance(src, types.Array) and src.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(cgutils.gep(builder, a.data, args[1]), ir.HalfType().as_pointer())
        return builder.fpext(builder.load(ptr, align=1), ir.FloatType())

    return types.float32(src, o), codegen


_f16_at = _f16_hw if _F16C else _f16


@intrinsic
def _u32_at(typingctx, src, o):
    """The little-endian uint32 at byte offset o of uint8 array src, as int64 (a Q5
    block's fifth bits: one unaligned load)."""
    if not (isinstance(src, types.Array) and src.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(cgutils.gep(builder, a.data, args[1]), _I32.as_pointer())
        return builder.zext(builder.load(ptr, align=1), ir.IntType(64))

    return types.int64(src, o), codegen


def _splat(builder, value, vtype):
    one = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vtype, None), ir.Constant(ir.VectorType(_I32, vtype.count),
                                                                              [0] * vtype.count))


def _nibble_values(context, builder, sig, args):
    """The 32 values of a Q4_0/Q4_1/Q5_0/Q5_1 block as <32 x i16> (in 16-bit lanes, 32 to
    a 512-bit register): args[0] the row (uint8), args[1] the quants' offset, args[2] the
    32 fifth bits (0 for the 4-bit types), args[3] the bias."""
    i16 = ir.IntType(16)
    v16, v32 = ir.VectorType(i16, 16), ir.VectorType(i16, 32)
    a = context.make_array(sig.args[0])(context, builder, args[0])
    ptr = builder.bitcast(cgutils.gep(builder, a.data, args[1]), ir.VectorType(_I8, 16).as_pointer())
    q = builder.zext(builder.load(ptr, align=1), v16)
    lo = builder.and_(q, ir.Constant(v16, [15] * 16))
    hi = builder.lshr(q, ir.Constant(v16, [4] * 16))
    v = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    qh = builder.trunc(args[2], _I32)
    pair = builder.insert_element(ir.Constant(ir.VectorType(i16, 2), None), builder.trunc(qh, i16),
                                  ir.Constant(_I32, 0))
    pair = builder.insert_element(pair, builder.trunc(builder.lshr(qh, ir.Constant(_I32, 16)), i16),
                                  ir.Constant(_I32, 1))
    halves = builder.shuffle_vector(pair, ir.Constant(ir.VectorType(i16, 2), None),
                                    ir.Constant(ir.VectorType(_I32, 32), [0] * 16 + [1] * 16))
    bit = builder.and_(halves, ir.Constant(v32, [1 << (i % 16) for i in range(32)]))
    h = builder.select(builder.icmp_unsigned("!=", bit, ir.Constant(v32, [0] * 32)),
                       ir.Constant(v32, [16] * 32), ir.Constant(v32, [0] * 32))
    return builder.sub(builder.or_(v, h), _splat(builder, builder.trunc(args[3], i16), v32))


def _sums_x8(context, builder, v, xty, x, xo, K, sty, sums):
    """sums[g] = sum_i v_i x[xo + g K + i], g < 8: one block's values v (<32 x i16>) with
    eight activation rows; the eight sums reduced together (`_merge8`). Exact."""
    parts = [_pairs(builder, v, _load_i16(context, builder, xty, x,
                                          builder.add(xo, builder.mul(K, ir.Constant(K.type, g)))))
             for g in range(8)]
    _merge8(context, builder, parts, sty, sums)


def _merge8(context, builder, parts, sty, sums):
    """sums[j] = the sum of the 16 lanes of parts[j] (eight <16 x i32>), j < 8: pairs of
    vectors merged level by level (15 shuffles of pairs instead of 8 full reductions),
    stored as one <8 x i32>. Exact."""
    idx = lambda v_: ir.Constant(ir.VectorType(_I32, len(v_)), v_)
    width = 16                     # lanes each row's partial sums fill in a merged vector
    while len(parts) > 1:
        merged = []
        for a_, b_ in zip(parts[::2], parts[1::2]):
            h = width // 2         # each row: its lanes' first half + second half
            lo = [i for blk in range(0, 16, width) for i in range(blk, blk + h)]
            hi = [i + h for i in lo]
            first = builder.shuffle_vector(a_, b_, idx(lo + [16 + i for i in lo]))
            second = builder.shuffle_vector(a_, b_, idx(hi + [16 + i for i in hi]))
            merged.append(builder.add(first, second))
        parts, width = merged, width // 2
    out = context.make_array(sty)(context, builder, sums)
    total = builder.add(builder.shuffle_vector(parts[0], parts[0], idx(list(range(0, 16, 2)))),
                        builder.shuffle_vector(parts[0], parts[0], idx(list(range(1, 16, 2)))))
    builder.store(total, builder.bitcast(out.data, ir.VectorType(_I32, 8).as_pointer()), align=4)


def _block_sums8(size: int, qs: int, qh: int, bias: int):
    """An intrinsic f(src, o, x, xo, sums): sums[j] = the integer dot of the 32-value block
    at byte offset o + j size of weight row src with x[xo + 32 j:], j < 8: eight
    consecutive blocks of one row, reduced together (`_merge8`). The block layout: quants
    at byte qs of each block (bias subtracted; qs past 2 with qh < 0 and bias 0: Q8_0's
    int8 quants), its 32 fifth bits at byte qh (qh < 0: none)."""
    def typer(typingctx, src, o, x, xo, sums):
        if not (isinstance(src, types.Array) and src.dtype == types.uint8 and _int8_arrays(x)):
            return None

        def codegen(context, builder, sig, args):
            parts = []
            for j in range(8):
                off = builder.add(args[1], ir.Constant(args[1].type, size * j))
                at = lambda k: builder.add(off, ir.Constant(off.type, k))
                if size == 34:                        # Q8_0: the int8 quants as they lie
                    w = _load_i16(context, builder, sig.args[0], args[0], at(qs))
                else:
                    if qh >= 0:
                        a = context.make_array(sig.args[0])(context, builder, args[0])
                        ptr = builder.bitcast(cgutils.gep(builder, a.data, at(qh)), _I32.as_pointer())
                        bits = builder.zext(builder.load(ptr, align=1), ir.IntType(64))
                    else:
                        bits = ir.Constant(ir.IntType(64), 0)
                    w = _nibble_values(context, builder, sig, [args[0], at(qs), bits, ir.Constant(ir.IntType(64), bias)])
                xoff = builder.add(args[3], ir.Constant(args[3].type, 32 * j))
                parts.append(_pairs(builder, w, _load_i16(context, builder, sig.args[2], args[2], xoff)))
            _merge8(context, builder, parts, sig.args[4], args[4])
            return context.get_dummy_value()

        return types.none(src, o, x, xo, sums), codegen
    return intrinsic(typer)


_sums8_q8_0, _sums8_q4_0, _sums8_q4_1 = _block_sums8(34, 2, -1, 0), _block_sums8(18, 2, -1, 8), _block_sums8(20, 4, -1, 0)
_sums8_q5_0, _sums8_q5_1 = _block_sums8(22, 6, 2, 16), _block_sums8(24, 8, 4, 0)


@intrinsic
def _dot_nibbles_x8(typingctx, src, qs, qh, bias, x, xo, K, sums):
    """`_dot_nibbles` of one block with eight activation rows (x[xo + g K:], g < 8) into
    sums[:8] (int32)."""
    if not (isinstance(src, types.Array) and src.dtype == types.uint8 and _int8_arrays(x)):
        return None

    def codegen(context, builder, sig, args):
        v = _nibble_values(context, builder, sig, args)
        _sums_x8(context, builder, v, sig.args[4], args[4], args[5], args[6], sig.args[7], args[7])
        return context.get_dummy_value()

    return types.none(src, qs, qh, bias, x, xo, K, sums), codegen


@intrinsic
def _dot32_x8(typingctx, w, wo, x, xo, K, sums):
    """`_dot32` of one block with eight activation rows (x[xo + g K:], g < 8) into sums[:8]."""
    if not _int8_arrays(w, x):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(cgutils.gep(builder, a.data, args[1]), ir.VectorType(_I8, 32).as_pointer())
        v = builder.sext(builder.load(ptr, align=1), ir.VectorType(ir.IntType(16), 32))
        _sums_x8(context, builder, v, sig.args[2], args[2], args[3], args[4], sig.args[5], args[5])
        return context.get_dummy_value()

    return types.none(w, wo, x, xo, K, sums), codegen


@intrinsic
def _dot_nibbles(typingctx, src, qs, qh, bias, x, xo):
    """sum_{i<32} v_i x[xo + i] in int32 for a Q4_0/Q4_1/Q5_0/Q5_1 block unpacked in
    registers: v_i = (src[qs + i] & 15 | bit i of qh << 4) - bias for i < 16, (src[qs + i
    - 16] >> 4 | bit i of qh << 4) - bias above (qh 0 for the 4-bit types): the block's
    `sumi` with no unpacked copy."""
    if not (isinstance(src, types.Array) and src.dtype == types.uint8 and _int8_arrays(x)):
        return None

    def codegen(context, builder, sig, args):
        v = _nibble_values(context, builder, sig, args)
        return _madd_sum(builder, v, _load_i16(context, builder, sig.args[4], args[4], args[5]))

    return types.int32(src, qs, qh, bias, x, xo), codegen


def _load_ext(context, builder, aty, arr, off, n: int, src_bits: int, bits: int, signed=True):
    """n integers of `src_bits` at flat offset `off` of C-contiguous array `arr`, extended
    to a vector of n `bits`-bit integers (one unaligned load)."""
    a = context.make_array(aty)(context, builder, arr)
    ptr = builder.bitcast(cgutils.gep(builder, a.data, off), ir.VectorType(ir.IntType(src_bits), n).as_pointer())
    v = builder.load(ptr, align=1)
    if bits == src_bits:
        return v
    return (builder.sext if signed else builder.zext)(v, ir.VectorType(ir.IntType(bits), n))


@intrinsic
def _lanes256(typingctx, w, wo, x, xo, sc8, so, aux):
    """aux[l] = sum_{i < 256, i = l mod 8} sc8[so + i // 2] w[wo + i] x[xo + i], l < 8:
    ggml's eight int32 lanes aux32 of a K-quant super-block (w, x int8; sc8 int32, each
    16 values' scale 8 times; aux int32). 32 values a step in 16-bit lanes: their
    products (|w| <= 32, |x| <= 127) and the sums of lanes l and l + 8 fit in 16 bits."""
    if not (_int8_arrays(w, x) and all(isinstance(a, types.Array) and a.dtype == types.int32
                                       for a in (sc8, aux))):
        return None

    def codegen(context, builder, sig, args):
        acc = ir.Constant(ir.VectorType(_I32, 16), [0] * 16)
        idx = lambda v: ir.Constant(ir.VectorType(_I32, len(v)), v)
        for step in range(8):
            off = lambda a: builder.add(a, ir.Constant(a.type, 32 * step))
            p = builder.mul(_load_ext(context, builder, sig.args[0], args[0], off(args[1]), 32, 8, 16),
                            _load_ext(context, builder, sig.args[2], args[2], off(args[3]), 32, 8, 16))
            lo = builder.shuffle_vector(p, p, idx([*range(8), *range(16, 24)]))
            hi = builder.shuffle_vector(p, p, idx([*range(8, 16), *range(24, 32)]))
            t = builder.sext(builder.add(lo, hi), ir.VectorType(_I32, 16))
            scale = _load_ext(context, builder, sig.args[4], args[4],
                              builder.add(args[5], ir.Constant(args[5].type, 16 * step)), 16, 32, 32)
            acc = builder.add(acc, builder.mul(t, scale))
        acc8 = builder.add(builder.shuffle_vector(acc, acc, idx(list(range(8)))),
                           builder.shuffle_vector(acc, acc, idx(list(range(8, 16)))))
        out = context.make_array(sig.args[6])(context, builder, args[6])
        builder.store(acc8, builder.bitcast(out.data, ir.VectorType(_I32, 8).as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(w, wo, x, xo, sc8, so, aux), codegen


@njit(cache=True, inline="always")
def _min_sum(bsums, g, bo, mn):
    """sum_j bsums[g, bo + j] mn[bo + j] over the 16 sums of a super-block, int."""
    s = 0
    for j in range(16):
        s += np.int64(bsums[g, bo + j]) * np.int64(mn[bo + j])
    return s


# ------------------------------------------------------------ weight blocks
@njit(cache=True, inline="always")
def _hidden(w, n):
    """n, as a number LLVM cannot see (w holds at least n values): a loop of a constant
    trip count is unrolled to scalar code before the vectorizer runs (dequant's _n16)."""
    return _U(min(n, w.shape[0]))


@njit(cache=True, inline="always")
def _legacy_block(code, src, b):
    """Block b of a 32-value type: (d, m, offset of its quants, its 5th bits qh, bias)
    (m 0 where the type has none; qh 0 for the 4-bit types)."""
    if code == Q8_0:
        return _f16(src, 34 * b), F32(0), 34 * b + 2, 0, 0
    if code == Q4_0:
        return _f16(src, 18 * b), F32(0), 18 * b + 2, 0, 8
    if code == Q4_1:
        return _f16(src, 20 * b), _f16(src, 20 * b + 2), 20 * b + 4, 0, 0
    size, off, bias = (22, 2, 16) if code == Q5_0 else (24, 4, 0)
    o = size * b
    qh = np.int64(src[o + off]) | (np.int64(src[o + off + 1]) << 8) \
        | (np.int64(src[o + off + 2]) << 16) | (np.int64(src[o + off + 3]) << 24)
    return _f16(src, o), (_f16(src, o + 2) if code == Q5_1 else F32(0)), o + off + 4, qh, bias


@njit(cache=True, inline="always")
def _unpack_q2_q3(code, src, b, w, sc, mn):
    """Q2_K / Q3_K super-block b: values into w[256 b:256 b + 256] (int8), each 16
    values' scale into sc[16 b + j] (Q2_K: 4 bits; Q3_K: 6 bits - 32), Q2_K's 4-bit
    mins into mn; returns (d, dmin)."""
    n16 = _hidden(w, 16)
    if code == Q2_K:
        o = 84 * b
        for sb in range(16):
            s = np.int32(src[o + sb])
            sc[16 * b + sb] = _field(s, 0, 0xF)
            mn[16 * b + sb] = _field(s, 4, 0xF)
            qs = _U(o + 16 + 32 * (sb >> 3) + 16 * (sb & 1))
            shift = np.int32(2 * ((sb >> 1) & 3))
            y = _U(QK_K * b + 16 * sb)
            for k in range(n16):
                w[y + k] = _field(src[qs + k], shift, 3)
        return _f16(src, o + 80), _f16(src, o + 82)
    o = 110 * b
    scb = o + 96
    for sb in range(16):
        lo = np.int64(src[scb + (sb & 7)])
        lo = (lo & 0xF) if sb < 8 else (lo >> 4)
        hi = (np.int64(src[scb + 8 + (sb & 3)]) >> (2 * (sb >> 2))) & 3
        sc[16 * b + sb] = (lo | (hi << 4)) - 32
        l0 = 16 * (sb & 1)
        qs = _U(o + 32 + 32 * (sb >> 3) + l0)
        hm = _U(o + l0)
        shift = np.int32(2 * ((sb >> 1) & 3))
        hbit = np.int32(sb >> 1)
        y = _U(QK_K * b + 16 * sb)
        for k in range(n16):
            w[y + k] = _field(src[qs + k], shift, 3) - 4 * (1 - _field(src[hm + k], hbit, 1))
    return _f16(src, o + 108), F32(0)


@njit(cache=True, inline="always")
def _unpack_q4_q5(code, src, b, w, sc, mn):
    """Q4_K / Q5_K super-block b: values into w[256 b:256 b + 256] (int8), the 6-bit
    scale and min of each 16 values into sc[16 b + j], mn[16 b + j]; returns (d, dmin)."""
    o = (144 if code == Q4_K else 176) * b
    qh = _U(o + 16)
    n32 = _hidden(w, 32)
    for pair in range(4):
        s0, m0 = _scale_min_k4(src, o + 4, 2 * pair)
        s1, m1 = _scale_min_k4(src, o + 4, 2 * pair + 1)
        m = 16 * b + 4 * pair
        sc[m], sc[m + 1], sc[m + 2], sc[m + 3] = s0, s0, s1, s1
        mn[m], mn[m + 1], mn[m + 2], mn[m + 3] = m0, m0, m1, m1
        h0, h1 = np.int32(2 * pair), np.int32(2 * pair + 1)
        qs = _U(o + (16 if code == Q4_K else 48) + 32 * pair)
        y = _U(QK_K * b + 64 * pair)
        if code == Q4_K:
            for l in range(n32):
                q = np.int32(src[qs + l])
                w[y + l] = _field(q, 0, 0xF)
                w[y + _U(32) + l] = _field(q, 4, 0xF)
        else:
            for l in range(n32):
                q = np.int32(src[qs + l])
                h = np.int32(src[qh + l])
                w[y + l] = _field(q, 0, 0xF) | (_field(h, h0, 1) << 4)
                w[y + _U(32) + l] = _field(q, 4, 0xF) | (_field(h, h1, 1) << 4)
    return _f16(src, o), _f16(src, o + 2)


@njit(cache=True, inline="always")
def _unpack_q6(src, b, w, sc):
    """Q6_K super-block b: values (6 bits - 32) into w[256 b:256 b + 256] (int8), the
    int8 scale of each 16 values into sc[16 b + j]; returns (d, 0). Value order as
    kernels/dequant.py's _deq_q6_k."""
    o = 210 * b
    for j in range(16):
        sc[16 * b + j] = _i8(src[o + 192 + j])
    n32 = _hidden(w, 32)
    for h in range(2):
        ql, qh = _U(o + 64 * h), _U(o + 128 + 32 * h)
        y = _U(QK_K * b + 128 * h)
        for l in range(n32):
            a = np.int32(src[ql + l])
            a2 = np.int32(src[ql + _U(32) + l])
            hb = np.int32(src[qh + l])
            w[y + l] = (_field(a, 0, 0xF) | (_field(hb, 0, 3) << 4)) - 32
            w[y + _U(32) + l] = (_field(a2, 0, 0xF) | (_field(hb, 2, 3) << 4)) - 32
            w[y + _U(64) + l] = (_field(a, 4, 0xF) | (_field(hb, 4, 3) << 4)) - 32
            w[y + _U(96) + l] = (_field(a2, 4, 0xF) | (_field(hb, 6, 3) << 4)) - 32
    return _f16(src, o + 208), F32(0)


# ------------------------------------------------------------ products
@njit(cache=True, inline="always")
def _legacy_step(code, sumf, sumi, dx, yd, mx, sy):
    """sumf after one block of ggml_vec_dot_<type>_q8_0/q8_1 (generic order)."""
    si = F32(sumi)                                    # exact: |sumi| < 2^19
    if code == Q4_0:
        return sumf + (si * dx) * yd                  # sumi*d_x*d_y
    if code == Q8_0:
        return sumf + si * (dx * yd)                  # sumi*(d_x*d_y)
    if code == Q5_0:
        return sumf + (dx * yd) * si                  # (d_x*d_y)*sumi
    return sumf + ((dx * yd) * si + mx * sy)          # Q4_1, Q5_1: + m_x*s_y


def _float_steps8(order: str):
    """An intrinsic f(ac, g0, sums, dx, mx, yd, ys, yo): `_legacy_step` of eight activation
    rows side by side, ac[g0 + i] = that row's sumf after the block, i < 8, as one
    <8 x float> (each lane its own row's generic order; no fused multiply-add): sums
    the block's eight int32 dots, dx, mx its scale and min, yd, ys the rows' q8 scales
    and sums (flat offset yo). order: q4_0 (sumi*d_x)*d_y, q8_0 sumi*(d_x*d_y), q5_0
    (d_x*d_y)*sumi, _1 (d_x*d_y)*sumi + m_x*s_y."""
    def typer(typingctx, ac, g0, sums, dx, mx, yd, ys, yo):
        def codegen(context, builder, sig, args):
            f8 = ir.VectorType(ir.FloatType(), 8)

            def vec(aty, arr, off, ty):
                a = context.make_array(aty)(context, builder, arr)
                return builder.bitcast(cgutils.gep(builder, a.data, off), ty.as_pointer())
            acc_ptr = vec(sig.args[0], args[0], args[1], f8)
            si = builder.sitofp(builder.load(vec(sig.args[2], args[2], ir.Constant(ir.IntType(64), 0),
                                                 ir.VectorType(_I32, 8)), align=4), f8)
            d = _splat(builder, args[3], f8)
            y = builder.load(vec(sig.args[5], args[5], args[7], f8), align=4)
            if order == "q4_0":
                step = builder.fmul(builder.fmul(si, d), y)
            elif order == "q8_0":
                step = builder.fmul(si, builder.fmul(d, y))
            else:
                step = builder.fmul(builder.fmul(d, y), si)
            if order == "_1":
                m = _splat(builder, args[4], f8)
                step = builder.fadd(step, builder.fmul(m, builder.load(vec(sig.args[6], args[6], args[7], f8),
                                                                      align=4)))
            builder.store(builder.fadd(builder.load(acc_ptr, align=4), step), acc_ptr, align=4)
            return context.get_dummy_value()

        return types.none(ac, g0, sums, dx, mx, yd, ys, yo), codegen
    return intrinsic(typer)


_steps8_q4_0, _steps8_q8_0, _steps8_q5_0, _steps8_q_1 = (_float_steps8(o) for o in ("q4_0", "q8_0", "q5_0", "_1"))


@njit(cache=True, inline="always")
def _block_sums(code, src, b, xq, sums):
    """sums[:8] = the integer dots of blocks b..b+7 of weight row src with activation row 0."""
    if code == Q8_0:
        _sums8_q8_0(src, 34 * b, xq, 32 * b, sums)
    elif code == Q5_0:
        _sums8_q5_0(src, 22 * b, xq, 32 * b, sums)
    elif code == Q4_0:
        _sums8_q4_0(src, 18 * b, xq, 32 * b, sums)
    elif code == Q4_1:
        _sums8_q4_1(src, 20 * b, xq, 32 * b, sums)
    else:
        _sums8_q5_1(src, 24 * b, xq, 32 * b, sums)


@njit(cache=True, inline="always")
def _legacy_sum_step(code, sumf, sumi, src, b, xd, xs):
    """sumf after block b of weight row src with activation row 0, its integer dot sumi
    given: the block's scales read where they lie, then `_legacy_step`."""
    size = 34 if code == Q8_0 else 18 if code == Q4_0 else 22 if code == Q5_0 else 20 if code == Q4_1 else 24
    o = size * b
    if code == Q4_1 or code == Q5_1:
        return _legacy_step(code, sumf, sumi, _f16_at(src, o), xd[b, 0], _f16_at(src, o + 2), xs[b, 0])
    return _legacy_step(code, sumf, sumi, _f16_at(src, o), xd[b, 0], F32(0), F32(0))


@njit(cache=True, inline="always")
def _legacy_block_step(code, sumf, src, s8, b, xq, xd, xs):
    """sumf after block b of weight row src (s8: its int8 view) with activation row 0:
    the block's scales and fifth bits read where they lie (no scratch), then
    `_legacy_step`."""
    sy, m, qh = F32(0), F32(0), 0
    if code == Q8_0:
        o = 34 * b
        return _legacy_step(code, sumf, _dot32(s8, o + 2, xq, 32 * b), _f16_at(src, o), xd[b, 0], m, sy)
    if code == Q4_0:
        o, qs, bias = 18 * b, 18 * b + 2, 8
    elif code == Q5_0:
        o, qs, bias = 22 * b, 22 * b + 6, 16
        qh = _u32_at(src, o + 2)
    elif code == Q4_1:
        o, qs, bias = 20 * b, 20 * b + 4, 0
        m, sy = _f16_at(src, o + 2), xs[b, 0]
    else:                                             # Q5_1
        o, qs, bias = 24 * b, 24 * b + 8, 0
        m, sy = _f16_at(src, o + 2), xs[b, 0]
        qh = _u32_at(src, o + 4)
    sumi = _dot_nibbles(src, qs, qh, bias, xq, 32 * b)
    return _legacy_step(code, sumf, sumi, _f16_at(src, o), xd[b, 0], m, sy)


@njit(cache=True, parallel=True)
def _dot_legacy(data, code, xq, xd, xs, out, dm, blocks, acc, sums):
    """out[g, n] = vec_dot(W row n, x row g) for a 32-value type: sumf += per block in
    the generic order of ggml_vec_dot_<type>_q8_0/q8_1. The blocks' quants are
    multiplied where they lie (Q8_0) or unpacked in registers (`_dot_nibbles`); with
    several rows of x, eight at a time (xq padded to a multiple of 8 rows; xd, xs
    transposed: (K/32, rows), so that the eight rows' float steps are one vector). Scratch per
    chunk of rows: dm (K/32, 2) float32 each block's d and m, blocks (K/32, 3) int64 its
    quants' offset, 5th bits and bias, acc (G padded) float32, sums (8) int32."""
    N, K, G = data.shape[0], xq.shape[1], out.shape[0]
    nb = K // 32
    chunks = blocks.shape[0]
    per = (N + chunks - 1) // chunks
    for c in prange(chunks):
        dmc, bc, ac, sc = dm[c], blocks[c], acc[c], sums[c]
        for n in range(c * per, min(N, c * per + per)):
            src = data[n]
            s8 = src.view(np.int8)
            if G == 1:
                sumf = F32(0)
                b = 0
                while b + 8 <= nb:                    # eight blocks' integer sums at once
                    _block_sums(code, src, b, xq, sc)
                    for j in range(8):
                        sumf = _legacy_sum_step(code, sumf, sc[j], src, b + j, xd, xs)
                    b += 8
                while b < nb:
                    sumf = _legacy_block_step(code, sumf, src, s8, b, xq, xd, xs)
                    b += 1
                out[0, n] = sumf
                continue
            for b in range(nb):
                dmc[b, 0], dmc[b, 1], bc[b, 0], bc[b, 1], bc[b, 2] = _legacy_block(code, src, b)
            ac[:] = 0
            for b in range(nb):
                dx, mx = dmc[b, 0], dmc[b, 1]
                for g0 in range(0, ac.shape[0], 8):
                    if code == Q8_0:
                        _dot32_x8(s8, bc[b, 0], xq, g0 * K + 32 * b, K, sc)
                    else:
                        _dot_nibbles_x8(src, bc[b, 0], bc[b, 1], bc[b, 2], xq, g0 * K + 32 * b, K, sc)
                    # the eight rows' steps side by side (each row's own order), one branch per block
                    if code == Q4_0:
                        _steps8_q4_0(ac, g0, sc, dx, mx, xd, xs, b * xd.shape[1] + g0)
                    elif code == Q8_0:
                        _steps8_q8_0(ac, g0, sc, dx, mx, xd, xs, b * xd.shape[1] + g0)
                    elif code == Q5_0:
                        _steps8_q5_0(ac, g0, sc, dx, mx, xd, xs, b * xd.shape[1] + g0)
                    else:
                        _steps8_q_1(ac, g0, sc, dx, mx, xd, xs, b * xd.shape[1] + g0)
            for g in range(G):
                out[g, n] = ac[g]


@njit(cache=True, parallel=True)
def _dot_k(data, code, xq, xd, xbs, out, w, dw, mw, sc, sc8, mn, aux, lanes):
    """out[g, n] = vec_dot(W row n, x row g) for a K-quant, in the generic order of
    ggml_vec_dot_<type>_q8_K: per super-block the eight float lanes sums[l] += d *
    aux32[l] (Q2_K: sumf += dall*isum - dmin*summs), Q4_K/Q5_K's sumf -= dmin * sumi,
    then sumf += sums[0..7]. Scratch per chunk of rows: w (K) int8 the row's values, dw,
    mw (K/256) its d and dmin, sc, mn (K/16) int32 its scales and mins, sc8 (K/2) the
    scales repeated 8 times (`_lanes256`), aux (8) int32, lanes (8) float32."""
    N, G, K = data.shape[0], xq.shape[0], xq.shape[1]
    nb = K // QK_K
    chunks = w.shape[0]
    per = (N + chunks - 1) // chunks
    has_mins = code == Q4_K or code == Q5_K
    for c in prange(chunks):
        wc, dc, mc, scc, s8c, mnc, xc, lc = w[c], dw[c], mw[c], sc[c], sc8[c], mn[c], aux[c], lanes[c]
        for n in range(c * per, min(N, c * per + per)):
            src = data[n]
            for b in range(nb):
                if code == Q6_K:
                    dc[b], mc[b] = _unpack_q6(src, b, wc, scc)
                elif code == Q4_K or code == Q5_K:
                    dc[b], mc[b] = _unpack_q4_q5(code, src, b, wc, scc, mnc)
                else:
                    dc[b], mc[b] = _unpack_q2_q3(code, src, b, wc, scc, mnc)
            for j in range(K // 16):
                for l in range(8):
                    s8c[8 * j + l] = scc[j]
            for g in range(G):
                lc[:] = 0
                sumf = F32(0)
                for b in range(nb):
                    yd = xd[g, b]
                    _lanes256(wc, QK_K * b, xq, g * K + QK_K * b, s8c, 128 * b, xc)
                    if code == Q2_K:
                        isum = F32(xc[0] + xc[1] + xc[2] + xc[3] + xc[4] + xc[5] + xc[6] + xc[7])
                        sumf += (yd * dc[b]) * isum - (yd * mc[b]) * F32(_min_sum(xbs, g, 16 * b, mnc))
                        continue
                    d = dc[b] * yd
                    for l in range(8):
                        lc[l] += d * F32(xc[l])
                    if has_mins:
                        sumf -= (mc[b] * yd) * F32(_min_sum(xbs, g, 16 * b, mnc))
                if code != Q2_K:
                    for l in range(8):
                        sumf += lc[l]
                out[g, n] = sumf


_SIZES = {q: (T(q).name, *GGML_QUANT_SIZES[T(q)]) for q in QDOT_TYPES}   # name, block size, block bytes


def _check(out: np.ndarray, x: np.ndarray, data: np.ndarray, qtype: int) -> None:
    if qtype not in _SIZES:
        try:
            name = T(qtype).name
        except ValueError:
            name = f"id {qtype!r}"
        raise ValueError(f"no quantized dot product for GGML type {name}")
    name, bs, ts = _SIZES[qtype]
    if not (isinstance(x, np.ndarray) and x.dtype == F32 and x.ndim == 2):
        raise ValueError("x must be a 2-D float32 array (G, K)")
    G, K = x.shape
    if K % bs:
        raise ValueError(f"{name}: K {K} is not a multiple of block size {bs}")
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.flags.c_contiguous and data.shape[1] == K // bs * ts):
        raise ValueError(f"{name}: data must be C-contiguous uint8 (N, {K // bs * ts}) for K {K}")
    if not (isinstance(out, np.ndarray) and out.dtype == F32 and out.shape == (G, data.shape[0])
            and out.flags.writeable):
        raise ValueError(f"out must be a writeable float32 array of shape {(G, data.shape[0])}")


def qdot_into(out: np.ndarray, x: np.ndarray, data: np.ndarray, qtype: int) -> None:
    """out (G, N) = x (G, K) W^T, W the N rows of `data` (uint8 (N, row_bytes), GGML type
    `qtype` in QDOT_TYPES), as llama.cpp's CPU backend: x quantized once to the type's
    activation blocks, each output one generic vec_dot (module docstring). `out` may
    be a column block of a wider array. Parallel over chunks of W's rows."""
    import numba
    data = np.asarray(data)                      # memmap subclass -> plain ndarray view
    qtype = int(qtype)
    _check(out, x, data, qtype)
    (G, K), N = x.shape, data.shape[0]
    chunks = max(1, min(N, 16 * numba.get_num_threads()))
    if _SIZES[qtype][1] == 32:
        padded = -(-G // 8) * 8 if G > 1 else 1          # several rows: eight at a time
        if padded != G:
            x = np.concatenate([x, np.zeros((padded - G, K), F32)])
        xq = quantize_rows(x, ACTIVATION[qtype])
        _dot_legacy(data, qtype, xq.qs, np.ascontiguousarray(xq.d.T), np.ascontiguousarray(xq.s.T), out,
                    np.empty((chunks, K // 32, 2), F32),
                    np.empty((chunks, K // 32, 3), np.int64), np.empty((chunks, padded), F32),
                    np.empty((chunks, 8), np.int32))
        return
    xq = quantize_rows(x, ACTIVATION[qtype])
    nb = K // QK_K
    _dot_k(data, qtype, xq.qs, xq.d, xq.bsums, out, np.empty((chunks, K), np.int8), np.empty((chunks, nb), F32), np.empty((chunks, nb), F32),
           np.empty((chunks, K // 16), np.int32), np.empty((chunks, K // 2), np.int32),
           np.empty((chunks, K // 16), np.int32),
           np.empty((chunks, 8), np.int32), np.empty((chunks, 8), F32))
