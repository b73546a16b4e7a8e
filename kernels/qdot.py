"""Numba CPU products of float activations with quantized weight rows, as llama.cpp's
CPU backend computes them: y (G, N) = x (G, K) W^T with W's N rows left in their GGUF
blocks (no dequantized copy).

Each row of x is quantized once per call to the activation blocks the weight type's
dot takes (ggml-cpu's `vec_dot_type`): q8_0 for Q4_0/Q5_0/Q8_0, q8_1 for Q4_1/Q5_1,
q8_K for the K-quants (`quantize_row_q8_0_ref`, `quantize_row_q8_1_ref`,
`quantize_row_q8_K_ref` in ggml-quants.c); each output is then one dot of a row of x
with a row of W: for the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in the float
order of ggml's x86 kernels (`ggml_vec_dot_<type>_q8_<x>` in ggml-cpu/arch/x86/quants.c,
AVX2), for the K-quants in the order of `ggml_vec_dot_<type>_q8_K_generic`
(ggml-cpu/quants.c). kernels/qdot_ref.py holds the numpy references; the kernels here
give their bits.

Exactness. A dot is an integer part and a float part. The integer part is exact in any
order: the 32-value types' lanes of four products (int32); the K-quants' sums of int8 x
small-int products times the 4- to 8-bit sub-block scales, and the q8_K bsums times the
mins, computed in float32 on integer values, every product and partial sum an integer
below 2^24 in magnitude (the largest, Q6_K's lane sums, is at most 32 x 128 x 127 x 32 =
16,646,144 < 16,777,216), so those loops may regroup and fuse (`fastmath`) to vectorize.
The float part runs in the reference's order with no fused multiply-add: for a
32-value type, eight float lanes acc[l] += (d_x*d_y) * lane[l] block after block, lane l
the int32 sum of values 4l..4l+3 (vpdpbusd's lanes), then ggml's hsum_float_8 (Q4_1 and
Q5_1 add the blocks' m_x*s_y summed in order); for a K-quant, the generic C's eight
float lanes `sums[l] += d * aux32[l]` and their final sum. The result equals the
reference bit for bit. llama.cpp itself fuses the x86 kernels' multiply-adds and rounds
q8_0 activations to nearest even rather than away from zero, so it differs from these
in the last bits.

Layout: one kernel per family (`_dot_legacy`: 32-value blocks, `_dot_k`: 256-value
super-blocks); a `prange` over chunks of output rows, each chunk with its own scratch
(the wrapper's: the kernels never allocate). The integer sums are LLVM vector IR
emitted by intrinsics (`_legacy_rows`, `_lanes256`): written as loops, numba's
32-value sums were unrolled to scalar code (0.42 against 0.06 ns a product). A 32-value
type's row dot is one intrinsic per type (`_legacy_rows`), its loop over blocks in the
IR with the float lanes in registers: each block unpacked in registers to 32 unsigned
bytes (the type's bias taken out by the lanes' start, `_lane_offsets`), multiplied with
one activation row or eight (vpdpbusd where the CPU has VNNI). With one activation row
(a decode step), a Q4_K/Q5_K/Q6_K row's dot is one intrinsic too (`_k_row`): each
super-block unpacked in registers, the activation's chunks permuted once per call so
that 8-bit products (vpmaddubsw) and their scaled pairs (vpmaddwd) land in the generic
order's eight aux32 lanes. Otherwise K-quant rows are unpacked once into int8 scratch
with their scales, then multiplied with each activation row (`_lanes256`).
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


def _int8_arrays(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.int8 for a in arrays)


def _host_has(feature: str) -> bool:
    """Whether numba compiles for its own host (no CPU override) and the host has
    `feature` (an LLVM name: avx512bw, f16c): the x86 instructions used where present."""
    from llvmlite import binding
    from numba.core import config
    if config.CPU_NAME or config.CPU_FEATURES:
        return False
    return bool(binding.get_host_cpu_features().get(feature))


_PMADDWD = _host_has("avx512bw")   # `_pairs` calls vpmaddwd (LLVM does not make it of the portable form)
_F16C = _host_has("f16c")          # `_half` converts with vcvtph2ps (else integer steps)


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


_VNNI = (_host_has("avx512vnni") and _host_has("avx512vl")) or _host_has("avxvnni")   # `_lanes8`: vpdpbusd


def _splat(builder, value, vtype):
    one = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vtype, None), ir.Constant(ir.VectorType(_I32, vtype.count),
                                                                              [0] * vtype.count))


def _idx(values):
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


def _at(builder, ptr, off, ty):
    """A pointer to a `ty` at element offset `off` of the array data pointer `ptr`."""
    return builder.bitcast(cgutils.gep(builder, ptr, off), ty.as_pointer())


def _half(builder, bits):
    """The IEEE half with bits `bits` (i16) as float32, exact: vcvtph2ps where the CPU has
    F16C, else integer steps (without F16C LLVM calls a runtime function numba does not
    link): the magnitude's bits moved to a float's place and scaled by 2^112 (exact for
    normals and subnormals), an inf/NaN's exponent set, the sign or'ed in."""
    f32 = ir.FloatType()
    if _F16C:
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), f32)
    c = lambda v: ir.Constant(_I32, v)
    u = builder.zext(bits, _I32)
    f = builder.fmul(builder.bitcast(builder.shl(builder.and_(u, c(0x7FFF)), c(13)), f32), ir.Constant(f32, 2.0 ** 112))
    fb = builder.bitcast(f, _I32)
    infnan = builder.icmp_unsigned("==", builder.and_(u, c(0x7C00)), c(0x7C00))
    fb = builder.select(infnan, builder.or_(fb, c(0x7F800000)), fb)
    return builder.bitcast(builder.or_(fb, builder.shl(builder.and_(u, c(0x8000)), c(16))), f32)


def _lanes8(builder, init, w, x):
    """<8 x i32>: init + the sums of four consecutive products w_i x_i, lane l of values
    4l..4l+3 (w <32 x i8> read unsigned, x <32 x i8> signed): vpdpbusd where the CPU has
    VNNI, else `_pairs` and adjacent pairs added. Exact (|w x| <= 255 x 128)."""
    v8 = ir.VectorType(_I32, 8)
    if _VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [init, builder.bitcast(w, v8), builder.bitcast(x, v8)])
    i16x32 = ir.VectorType(ir.IntType(16), 32)
    p = _pairs(builder, builder.zext(w, i16x32), builder.sext(x, i16x32))
    four = builder.add(builder.shuffle_vector(p, p, _idx(range(0, 16, 2))),
                       builder.shuffle_vector(p, p, _idx(range(1, 16, 2))))
    return builder.add(init, four)


def _block_values(builder, row, o, size: int, qs: int, qh: int):
    """The 32 values of the legacy block at byte offset o of weight row `row` (i8*) as
    <32 x i8> read unsigned, before the type's bias (`_LEGACY`): Q8_0's quants + 128 (xor
    0x80), else the low nibbles of its 16 quant bytes then the high ones, value i's fifth
    bit (bit i of the uint32 at byte qh) adding 16."""
    i8x16, i8x32 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
    at = lambda k: builder.add(o, ir.Constant(o.type, k))
    if size == 34:
        w = builder.load(_at(builder, row, at(qs), i8x32), align=1)
        return builder.xor(w, ir.Constant(i8x32, [0x80] * 32))
    q = builder.load(_at(builder, row, at(qs), i8x16), align=1)
    lo = builder.and_(q, ir.Constant(i8x16, [15] * 16))
    hi = builder.lshr(q, ir.Constant(i8x16, [4] * 16))
    w = builder.shuffle_vector(lo, hi, _idx(range(32)))
    if qh < 0:
        return w
    bits = builder.bitcast(builder.load(_at(builder, row, at(qh), _I32), align=1), ir.VectorType(ir.IntType(1), 32))
    return builder.or_(w, builder.select(bits, ir.Constant(i8x32, [16] * 32), ir.Constant(i8x32, [0] * 32)))


_PREFETCH = 2048   # bytes: the weight rows are read from memory this far ahead (`_prefetch`)


def _prefetch(builder, ptr):
    """Ask for the cache line at ptr (i8*), for reading, kept in all levels: a decode
    step's weights stream from memory, which the hardware's prefetcher alone left at half
    speed (Q5_0 4864 x 896, 60 matrices in turn, one thread: 141 -> 80 ps a weight)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32,
                                                                                       _I32]), "llvm.prefetch.p0")
    builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


@intrinsic
def _prefetch_at(typingctx, src, o):
    """`_prefetch` of byte o of uint8 array src (past its end is harmless: a prefetch does
    not fault)."""
    if not (isinstance(src, types.Array) and src.dtype == types.uint8):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        _prefetch(builder, builder.bitcast(cgutils.gep(builder, a.data, args[1]), _I8.as_pointer()))
        return context.get_dummy_value()

    return types.none(src, types.intp), codegen


def _hsum8(builder, v):
    """ggml's hsum_float_8 (arch/x86/quants.c): ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))."""
    t = builder.fadd(builder.shuffle_vector(v, v, _idx(range(4))), builder.shuffle_vector(v, v, _idx(range(4, 8))))
    u = builder.fadd(builder.shuffle_vector(t, t, _idx(range(2))), builder.shuffle_vector(t, t, _idx(range(2, 4))))
    return builder.fadd(builder.extract_element(u, ir.Constant(_I32, 0)), builder.extract_element(u, ir.Constant(_I32, 1)))


# per type: block bytes, quants' byte, fifth bits' byte (-1: none), bias, whether it has a min
_LEGACY = {Q8_0: (34, 2, -1, 128, False), Q4_0: (18, 2, -1, 8, False), Q4_1: (20, 4, -1, 0, True),
           Q5_0: (22, 6, 2, 16, False), Q5_1: (24, 8, 4, 0, True)}


def _legacy_rows(code: int, rows: int):
    """An intrinsic f(src, nb, xq, xo, K, xoff, xd, xs, g0, Gp, res): res[g] = the dot of
    weight row src (nb blocks of type `code`) with activation row g0 + g, g < rows, in
    ggml's x86 order (the module docstring): xq (Gp, K) int8 (row g0 at flat offset xo),
    xoff (Gp, 8 nb) int32 each lane's four activations times -bias, xd, xs (nb, Gp)
    float32 the rows' q8 scales and q8_1 sums. The loop over blocks is in the IR, the
    accumulators in registers."""
    size, qs, qh, bias, has_min = _LEGACY[code]

    def typer(typingctx, src, nb, xq, xo, K, xoff, xd, xs, g0, Gp, res):
        if not (isinstance(src, types.Array) and src.dtype == types.uint8 and _int8_arrays(xq)):
            return None

        def codegen(context, builder, sig, args):
            src_, nb_, xq_, xo_, K_, xoff_, xd_, xs_, g0_, Gp_, res_ = args
            data = lambda i: context.make_array(sig.args[i])(context, builder, args[i]).data
            row, xq_p, xoff_p, xd_p, xs_p, res_p = (data(i) for i in (0, 2, 5, 6, 7, 10))
            row = builder.bitcast(row, _I8.as_pointer())
            f32, i64 = ir.FloatType(), ir.IntType(64)
            f8, v8 = ir.VectorType(f32, 8), ir.VectorType(_I32, 8)
            c64 = lambda v: ir.Constant(i64, v)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(f8, [0.0] * 8)) for _ in range(rows)]
            summs = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(rows if has_min else 0)]
            with cgutils.for_range(builder, nb_) as loop:
                b = loop.index
                o = builder.mul(b, c64(size))
                w = _block_values(builder, row, o, size, qs, qh)
                _prefetch(builder, cgutils.gep(builder, row, builder.add(o, c64(_PREFETCH))))
                dx = _half(builder, builder.load(_at(builder, row, o, ir.IntType(16)), align=1))
                m = _half(builder, builder.load(_at(builder, row, builder.add(o, c64(2)), ir.IntType(16)),
                                                align=1)) if has_min else None
                yo = builder.add(builder.mul(b, Gp_), g0_)
                for g in range(rows):
                    gx = builder.add(builder.add(xo_, builder.mul(K_, c64(g))), builder.mul(b, c64(32)))
                    x = builder.load(_at(builder, xq_p, gx, ir.VectorType(_I8, 32)), align=1)
                    init = ir.Constant(v8, [0] * 8)
                    if bias:
                        lo = builder.add(builder.mul(builder.add(g0_, c64(g)), builder.mul(nb_, c64(8))),
                                         builder.mul(b, c64(8)))
                        init = builder.load(_at(builder, xoff_p, lo, v8), align=4)
                    lanes = builder.sitofp(_lanes8(builder, init, w, x), f8)
                    yg = builder.add(yo, c64(g))
                    d = builder.fmul(dx, builder.load(cgutils.gep(builder, xd_p, yg)))
                    builder.store(builder.fadd(builder.load(accs[g]), builder.fmul(_splat(builder, d, f8), lanes)),
                                  accs[g])
                    if has_min:
                        ms = builder.fmul(m, builder.load(cgutils.gep(builder, xs_p, yg)))
                        builder.store(builder.fadd(builder.load(summs[g]), ms), summs[g])
            for g in range(rows):
                r = _hsum8(builder, builder.load(accs[g]))
                if has_min:
                    r = builder.fadd(r, builder.load(summs[g]))
                builder.store(r, cgutils.gep(builder, res_p, c64(g)))
            return context.get_dummy_value()

        i = types.intp
        return types.none(src, i, xq, i, i, xoff, xd, xs, i, i, res), codegen
    return intrinsic(typer)


_x1_q8_0, _x1_q4_0, _x1_q4_1, _x1_q5_0, _x1_q5_1 = (_legacy_rows(c, 1) for c in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1))
_x8_q8_0, _x8_q4_0, _x8_q4_1, _x8_q5_0, _x8_q5_1 = (_legacy_rows(c, 8) for c in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1))


@njit(cache=True, inline="always")
def _legacy_dot1(code, src, nb, xq, xoff, xd, xs, Gp, res):
    """res[0] = the dot of weight row src with activation row 0 (`_legacy_rows`)."""
    if code == Q8_0:
        _x1_q8_0(src, nb, xq, 0, 0, xoff, xd, xs, 0, Gp, res)
    elif code == Q5_0:
        _x1_q5_0(src, nb, xq, 0, 0, xoff, xd, xs, 0, Gp, res)
    elif code == Q4_0:
        _x1_q4_0(src, nb, xq, 0, 0, xoff, xd, xs, 0, Gp, res)
    elif code == Q4_1:
        _x1_q4_1(src, nb, xq, 0, 0, xoff, xd, xs, 0, Gp, res)
    else:
        _x1_q5_1(src, nb, xq, 0, 0, xoff, xd, xs, 0, Gp, res)


@njit(cache=True, inline="always")
def _legacy_dot8(code, src, nb, xq, K, xoff, xd, xs, g0, Gp, res):
    """res[:8] = the dots of weight row src with activation rows g0..g0+7 (`_legacy_rows`)."""
    xo = g0 * K
    if code == Q8_0:
        _x8_q8_0(src, nb, xq, xo, K, xoff, xd, xs, g0, Gp, res)
    elif code == Q5_0:
        _x8_q5_0(src, nb, xq, xo, K, xoff, xd, xs, g0, Gp, res)
    elif code == Q4_0:
        _x8_q4_0(src, nb, xq, xo, K, xoff, xd, xs, g0, Gp, res)
    elif code == Q4_1:
        _x8_q4_1(src, nb, xq, xo, K, xoff, xd, xs, g0, Gp, res)
    else:
        _x8_q5_1(src, nb, xq, xo, K, xoff, xd, xs, g0, Gp, res)


@njit(cache=True, inline="always")
def _lane_offsets(xq, bias, xoff):
    """xoff[g, l] = -bias x (the sum of activations 4l..4l+3 of row g): the lanes' start,
    so that a block's unsigned values (`_block_values`) give the biased ones' dots."""
    for g in range(xoff.shape[0]):
        for i in range(xoff.shape[1]):
            t = np.int32(xq[g, 4 * i]) + np.int32(xq[g, 4 * i + 1]) + np.int32(xq[g, 4 * i + 2]) \
                + np.int32(xq[g, 4 * i + 3])
            xoff[g, i] = -bias * t


@njit(cache=True, parallel=True)
def _dot_legacy(data, code, bias, xq, xoff, xd, xs, out, res):
    """out[g, n] = vec_dot(W row n, x row g) for a 32-value type in ggml's x86 order
    (`_legacy_rows`; xq padded to a multiple of 8 rows when there are several; xd, xs
    transposed: (K/32, rows)). Scratch: xoff (rows, K/8) int32 (filled here, `_lane_offsets`),
    res (chunks, 8) float32 each chunk's dots of one weight row."""
    N, K, G, Gp = data.shape[0], xq.shape[1], out.shape[0], xq.shape[0]
    nb = K // 32
    if bias:
        _lane_offsets(xq, bias, xoff)
    chunks = res.shape[0]
    per = (N + chunks - 1) // chunks
    for c in prange(chunks):
        rc = res[c]
        for n in range(c * per, min(N, c * per + per)):
            src = data[n]
            if G == 1:
                _legacy_dot1(code, src, nb, xq, xoff, xd, xs, Gp, rc)
                out[0, n] = rc[0]
                continue
            for g0 in range(0, Gp, 8):
                _legacy_dot8(code, src, nb, xq, K, xoff, xd, xs, g0, Gp, rc)
                for g in range(min(8, G - g0)):
                    out[g0 + g, n] = rc[g]



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
            for o in range(0, src.shape[0], 64):
                _prefetch_at(src, o + _PREFETCH)
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


# ------------------------------------------------------------ K-quant rows, one activation row
_AVX2 = _host_has("avx2")          # `_madd_ubs`, `_madd_wd`: vpmaddubsw, vpmaddwd


def _perm_index(p: int) -> int:
    """`_PERM`: the value of a 32-value chunk at byte p of its permuted order, so that
    vpmaddubsw's pairs hold two values of one 16-value group (one scale) whose indices
    agree mod 8, and vpmaddwd's pairs then the two groups' pairs of that residue: lane
    r of the int32 result is the generic dot's aux32[r] share of the chunk."""
    lane, k = divmod(p, 16)
    return 16 * ((k // 2) % 2) + 8 * (k % 2) + 4 * lane + k // 4


_PERM = [_perm_index(p) for p in range(32)]
_PERM_NP = np.array(_PERM, np.int64)


def _madd_ubs(builder, a, b):
    """<16 x i16>: a_2i b_2i + a_2i+1 b_2i+1, a <32 x i8> unsigned, b signed (vpmaddubsw;
    its saturation is never reached here: |sum| <= 2 x 63 x 128)."""
    i16x16 = ir.VectorType(ir.IntType(16), 16)
    if _AVX2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16x16, [a.type, b.type]),
                                            "llvm.x86.avx2.pmadd.ub.sw")
        return builder.call(fn, [a, b])
    p = builder.mul(builder.zext(a, ir.VectorType(ir.IntType(16), 32)), builder.sext(b, ir.VectorType(ir.IntType(16), 32)))
    return builder.add(builder.shuffle_vector(p, p, _idx(range(0, 32, 2))), builder.shuffle_vector(p, p, _idx(range(1, 32, 2))))


def _madd_wd(builder, a, b):
    """<8 x i32>: a_2i b_2i + a_2i+1 b_2i+1 of two <16 x i16> (vpmaddwd). Exact."""
    v8 = ir.VectorType(_I32, 8)
    if _AVX2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [a.type, b.type]),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.call(fn, [a, b])
    p = builder.mul(builder.sext(a, ir.VectorType(_I32, 16)), builder.sext(b, ir.VectorType(_I32, 16)))
    return builder.add(builder.shuffle_vector(p, p, _idx(range(0, 16, 2))), builder.shuffle_vector(p, p, _idx(range(1, 16, 2))))


# per type: super-block bytes, its d's byte, its quants' byte
_KROW = {Q4_K: (144, 0, 16), Q5_K: (176, 0, 48), Q6_K: (210, 208, 0)}


def _k_chunks(builder, row, o, code):
    """The eight 32-value chunks of the super-block at byte o of weight row `row` (i8*),
    each <32 x i8> in `_PERM`'s order: Q4_K/Q5_K's values (0..31), Q6_K's + 32 (0..63)."""
    i8x32 = ir.VectorType(_I8, 32)
    k = lambda v: ir.Constant(i8x32, [v] * 32)
    load = lambda off: builder.shuffle_vector(
        builder.load(_at(builder, row, builder.add(o, ir.Constant(o.type, off)), i8x32), align=1),
        ir.Constant(i8x32, None), _idx(_PERM))
    chunks = []
    if code == Q6_K:
        for h in range(2):
            a, b, hb = load(64 * h), load(64 * h + 32), load(128 + 32 * h)
            chunks += [builder.or_(builder.and_(a, k(15)), builder.shl(builder.and_(hb, k(3)), k(4))),
                       builder.or_(builder.and_(b, k(15)), builder.and_(builder.shl(hb, k(2)), k(0x30))),
                       builder.or_(builder.lshr(a, k(4)), builder.and_(hb, k(0x30))),
                       builder.or_(builder.lshr(b, k(4)), builder.and_(builder.lshr(hb, k(2)), k(0x30)))]
        return chunks
    qs = _KROW[code][2]
    hb = load(16) if code == Q5_K else None
    for p in range(4):
        q = load(qs + 32 * p)
        lo, hi = builder.and_(q, k(15)), builder.lshr(q, k(4))
        if hb is not None:
            lo = builder.or_(lo, builder.shl(builder.and_(builder.lshr(hb, k(2 * p)), k(1)), k(4)))
            hi = builder.or_(hi, builder.shl(builder.and_(builder.lshr(hb, k(2 * p + 1)), k(1)), k(4)))
        chunks += [lo, hi]
    return chunks


def _k_row(code: int):
    """An intrinsic f(src, nb, xp, xd, xbs, sc, mn, res): res[0] = the dot of weight row
    src (nb super-blocks of Q4_K, Q5_K or Q6_K) with one q8_K activation row in the
    generic order of ggml_vec_dot_<type>_q8_K (as `_dot_k`): xp (K) int8 its quants in
    `_PERM`'s order chunk by chunk, xd (nb) float32 its scales, xbs (K/16) int32 its
    bsums; sc, mn (K/32) int32 the row's 6-bit scales and mins (Q4_K/Q5_K,
    `_k4_scales`). The chunks unpacked in registers, their products in 8-bit lanes
    (vpmaddubsw), times the scales and summed to the eight aux32 lanes (vpmaddwd); the
    loop over super-blocks in the IR."""
    size, d_at, _ = _KROW[code]

    def typer(typingctx, src, nb, xp, xd, xbs, sc, mn, res):
        if not (isinstance(src, types.Array) and src.dtype == types.uint8 and _int8_arrays(xp)):
            return None

        def codegen(context, builder, sig, args):
            data = lambda i: context.make_array(sig.args[i])(context, builder, args[i]).data
            row, xp_p, xd_p, xbs_p, sc_p, mn_p, res_p = (data(i) for i in (0, 2, 3, 4, 5, 6, 7))
            row = builder.bitcast(row, _I8.as_pointer())
            f32, i64, i16 = ir.FloatType(), ir.IntType(64), ir.IntType(16)
            f8, v8, i16x16 = ir.VectorType(f32, 8), ir.VectorType(_I32, 8), ir.VectorType(i16, 16)
            c64 = lambda v: ir.Constant(i64, v)
            sums = cgutils.alloca_once_value(builder, ir.Constant(f8, [0.0] * 8))
            sumf = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))
            with cgutils.for_range(builder, args[1]) as loop:
                b = loop.index
                o = builder.mul(b, c64(size))
                _prefetch(builder, cgutils.gep(builder, row, builder.add(o, c64(_PREFETCH))))
                _prefetch(builder, cgutils.gep(builder, row, builder.add(o, c64(_PREFETCH + 64))))
                _prefetch(builder, cgutils.gep(builder, row, builder.add(o, c64(_PREFETCH + 128))))
                aux = ir.Constant(v8, [0] * 8)
                for c, w in enumerate(_k_chunks(builder, row, o, code)):
                    x = builder.load(_at(builder, xp_p, builder.add(builder.mul(b, c64(256)), c64(32 * c)),
                                         ir.VectorType(_I8, 32)), align=1)
                    p = _madd_ubs(builder, w, x)
                    if code == Q6_K:              # the values' + 32 taken out: - 32 (x_a + x_b)
                        p = builder.sub(p, _madd_ubs(builder, ir.Constant(w.type, [32] * 32), x))
                        two = builder.load(_at(builder, row, builder.add(o, c64(192 + 2 * c)), ir.VectorType(_I8, 2)),
                                           align=1)
                        s = builder.shuffle_vector(builder.sext(two, ir.VectorType(i16, 2)), ir.Constant(
                            ir.VectorType(i16, 2), None), _idx([0, 1] * 8))
                    else:
                        one = builder.trunc(builder.load(cgutils.gep(builder, sc_p, builder.add(
                            builder.mul(b, c64(8)), c64(c)))), i16)
                        s = _splat(builder, one, i16x16)
                    aux = builder.add(aux, _madd_wd(builder, p, s))
                yd = builder.load(cgutils.gep(builder, xd_p, b))
                dx = _half(builder, builder.load(_at(builder, row, builder.add(o, c64(d_at)), i16), align=1))
                d = builder.fmul(dx, yd)
                builder.store(builder.fadd(builder.load(sums), builder.fmul(_splat(builder, d, f8),
                                                                             builder.sitofp(aux, f8))), sums)
                if code != Q6_K:                  # sumf -= (dmin * y.d) * sum_j bsums[j] mins[j]
                    bs = builder.load(_at(builder, xbs_p, builder.mul(b, c64(16)), ir.VectorType(_I32, 16)), align=4)
                    mins = builder.load(_at(builder, mn_p, builder.mul(b, c64(8)), v8), align=4)
                    m16 = builder.shuffle_vector(mins, ir.Constant(v8, None), _idx([j // 2 for j in range(16)]))
                    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                        _I32, [ir.VectorType(_I32, 16)]), "llvm.vector.reduce.add.v16i32")
                    sumi = builder.sitofp(builder.call(fn, [builder.mul(bs, m16)]), f32)
                    dmin = _half(builder, builder.load(_at(builder, row, builder.add(o, c64(2)), i16), align=1))
                    builder.store(builder.fsub(builder.load(sumf), builder.fmul(builder.fmul(dmin, yd), sumi)), sumf)
            r, s8 = builder.load(sumf), builder.load(sums)
            for lane in range(8):
                r = builder.fadd(r, builder.extract_element(s8, ir.Constant(_I32, lane)))
            builder.store(r, res_p)
            return context.get_dummy_value()

        return types.none(src, types.intp, xp, xd, xbs, sc, mn, res), codegen
    return intrinsic(typer)


_k1_q4_k, _k1_q5_k, _k1_q6_k = _k_row(Q4_K), _k_row(Q5_K), _k_row(Q6_K)


@njit(cache=True)
def _permute_chunks(xq, xp):
    """xp = row 0 of xq with each 32-value chunk in `_PERM`'s order."""
    perm = _PERM_NP
    for c in range(xq.shape[1] // 32):
        for p in range(32):
            xp[32 * c + p] = xq[0, 32 * c + perm[p]]


@njit(cache=True, inline="always")
def _k4_scales(src, nb, size, sc, mn):
    """sc[8 b + c], mn[8 b + c]: the 6-bit scale and min of chunk c of super-block b of a
    Q4_K/Q5_K row (`size` bytes a super-block)."""
    for b in range(nb):
        for c in range(8):
            sc[8 * b + c], mn[8 * b + c] = _scale_min_k4(src, size * b + 4, c)


@njit(cache=True, parallel=True)
def _dot_k1(data, code, xp, xd, xbs, out, sc, mn, res):
    """out[0, n] = vec_dot(W row n, x row 0) for Q4_K, Q5_K, Q6_K (`_k_row`). Scratch per
    chunk of rows: sc, mn (K/32) int32, res (1) float32."""
    N, K = data.shape[0], xp.shape[0]
    nb = K // QK_K
    chunks = res.shape[0]
    per = (N + chunks - 1) // chunks
    for c in prange(chunks):
        scc, mnc, rc = sc[c], mn[c], res[c]
        for n in range(c * per, min(N, c * per + per)):
            src = data[n]
            if code == Q6_K:
                _k1_q6_k(src, nb, xp, xd, xbs, scc, mnc, rc)
            elif code == Q4_K:
                _k4_scales(src, nb, 144, scc, mnc)
                _k1_q4_k(src, nb, xp, xd, xbs, scc, mnc, rc)
            else:
                _k4_scales(src, nb, 176, scc, mnc)
                _k1_q5_k(src, nb, xp, xd, xbs, scc, mnc, rc)
            out[0, n] = rc[0]


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
        bias = _LEGACY[qtype][3]
        _dot_legacy(data, qtype, bias, xq.qs, np.empty((padded, K // 4 if bias else 0), np.int32),
                    np.ascontiguousarray(xq.d.T), np.ascontiguousarray(xq.s.T), out, np.empty((chunks, 8), F32))
        return
    xq = quantize_rows(x, ACTIVATION[qtype])
    nb = K // QK_K
    if G == 1 and qtype in _KROW:                      # a decode step: rows unpacked in registers
        xp = np.empty(K, np.int8)
        _permute_chunks(xq.qs, xp)
        _dot_k1(data, qtype, xp, xq.d[0], xq.bsums[0], out, np.empty((chunks, K // 32), np.int32),
                np.empty((chunks, K // 32), np.int32), np.empty((chunks, 1), F32))
        return
    _dot_k(data, qtype, xq.qs, xq.d, xq.bsums, out, np.empty((chunks, K), np.int8), np.empty((chunks, nb), F32), np.empty((chunks, nb), F32),
           np.empty((chunks, K // 16), np.int32), np.empty((chunks, K // 2), np.int32),
           np.empty((chunks, K // 16), np.int32),
           np.empty((chunks, 8), np.int32), np.empty((chunks, 8), F32))
