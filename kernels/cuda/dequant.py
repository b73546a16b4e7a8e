"""CUDA dequantization of GGUF tensor data to float32, bit for bit like the CPU
kernels in ``llamatune.kernels.dequant`` (and so like ``gguf.quants.dequantize``).

Launch layout. A row is cut into units of 256 values: one K-quant (or IQ4_XS) super-block,
eight 32-value legacy (or IQ4_NL, MXFP4) blocks, or 256 plain floats. One warp dequantizes one unit;
a thread block of ``WARPS`` warps (128 threads) covers ``WARPS`` consecutive units
of one row: grid (n_rows, ceil(ceil(n_cols / 256) / WARPS)). Lane t of a warp
computes values t, t+32, ..., t+224 of its unit, so at each of its eight stores
the warp writes 32 consecutive floats (128 bytes). Its byte loads are coalesced
too: in every quant type the low bits of a value's index pick its byte within a
run of 16, 32 or 64 bytes (Q4_K: byte l of a 32-byte run holds value l of two
sub-blocks), so at each load lane t reads byte t (or t mod 16) of a run; a float
type's lanes read consecutive 2- or 4-byte values.

Scales are decoded once per (sub-)block, not once per value: first each thread
of the block decodes at most one entry of a scale table in shared memory, the
(a, b) pair of one sub-block (Q4_K, Q5_K: 32 values, d*sc and dmin*m; Q6_K, Q2_K,
Q3_K: 16 values) or of one legacy block (d, and m for Q4_1/Q5_1), WARPS * 8 or
WARPS * 16 entries; then, after a barrier, every value reads its pair from the
table. The float types have no table. A warp whose unit lies wholly inside the
row (every unit of a K-quant row) loads and computes its eight values before
storing any, so the bytes shared by several of its values (a Q4_K byte holds
two, a Q5_K high-bit byte eight) are loaded once; the row's last, partial unit
(legacy blocks, floats) checks each value against n_cols.

The float32 operations are those of the CPU kernel in the same order, and every
product goes through ``fmul`` (``__nv_fmul_rn``) so that NVVM cannot contract
``d*q + m`` or ``dl*q - ml`` into an FMA (which rounds once instead of twice).
Half floats are decoded from their bits without branches (``_half_bits_to_f32``,
as the CPU kernel: subnormals normalised, inf and NaN payloads kept). Bytes are
read as int32 and bit fields converted to float from 32 bits; numba types integer
arithmetic as int64, and NVVM narrows most of it (the bit fields) to 32 bits.
Array indices are unsigned, so no negative-index wraparound code is emitted.

Each type has a value function ``_v_<type>(src, o, i, a, b)`` giving value i
(0..255) of the unit at byte offset o of the row's bytes src, from the (a, b) pair
of its sub-block, and, except the floats, a scale function ``_s_<type>(src, o, e)``
giving the pair of sub-block e of that unit. Two kernels per type are built from
them on first use: a plain one (out[i] = dequant(data[i])) and a gathering one
(out[i] = dequant(data[rows[i]]), the embedding lookup).
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from numba import float32

from ._common import SIM, bf16_bits, bits_to_f32, cdiv, check, check_ndim, cuda, fmul, is_device_array

QK_K = 256  # values per unit (a K-quant super-block)
WARPS = 4  # units (warps) per thread block
THREADS = 32 * WARPS

__all__ = ["CUDA_TYPES", "dequantize_into", "dequantize_rows_into"]


# ---------------------------------------------------------------- bit helpers
if SIM:
    @cuda.jit(device=True)
    def _f32_bits(x):
        return np.float32(x).view(np.uint32)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _f32_bits(x):
        return libdevice.float_as_int(x)


@cuda.jit(device=True)
def _b(src, o):
    """Byte o (>= 0) of a row as int32 (an unsigned index: no wraparound code)."""
    return np.int32(src[np.uint64(o)])


@cuda.jit(device=True)
def _u16(src, o):
    return _b(src, o) | (_b(src, o + 1) << 8)


@cuda.jit(device=True)
def _i8(v):
    """int32 holding a byte -> its signed int8 value."""
    return np.int32(v - ((v & 0x80) << 1))


@cuda.jit(device=True)
def _f(v):
    """Small integer -> float32 (exact), converted from 32 bits."""
    return np.float32(np.int32(v))


@cuda.jit(device=True)
def _half_bits_to_f32(h):
    """IEEE half (its 16 bits, int32) -> float32, exactly as numpy's cast, without
    branches. With x = the half's bits without the sign (exponent and mantissa):
        normal:     sign | (x << 13) + (112 << 23)     (rebias the exponent 15 -> 127)
        inf / NaN:  sign | (x << 13) + (224 << 23)     (exponent 31 -> 255, payload kept)
        subnormal:  sign | bits(x * 2^-24)             (exact in float32; 0 -> +-0)"""
    x = h & 0x7FFF
    big = (x << 13) + ((224 << 23) if x >= 0x7C00 else (112 << 23))
    bits = _f32_bits(_f(x) * np.float32(2.0 ** -24)) if x < 0x400 else big
    return bits_to_f32((np.uint32(h & 0x8000) << 16) | np.uint32(bits))  # uint32: the
    #                                          simulator's numpy int32 would overflow


@cuda.jit(device=True)
def _f16(src, o):
    return _half_bits_to_f32(_u16(src, o))


@cuda.jit(device=True)
def _nibble(byte, l):
    """Value l (0..31) of a 32-value block stores its 4 low bits in byte l%16:
    the low nibble for l < 16, the high one for l >= 16."""
    return (byte >> 4) if l >= 16 else (byte & 0xF)


# ----------------------------------------------------------- float types
# unit: 256 values; no scales (a, b unused)
@cuda.jit(device=True)
def _v_f32(src, o, i, a, b):
    p = o + 4 * i
    return bits_to_f32(np.uint32(_u16(src, p)) | (np.uint32(_u16(src, p + 2)) << 16))


@cuda.jit(device=True)
def _v_f16(src, o, i, a, b):
    return _f16(src, o + 2 * i)


@cuda.jit(device=True)
def _v_bf16(src, o, i, a, b):
    return bits_to_f32(np.uint32(_u16(src, o + 2 * i)) << 16)


# ------------------------------------------------ 32-value legacy blocks
# unit: 8 blocks; scale entry e = block e of the unit: (d, 0) or (d, m)
@cuda.jit(device=True)
def _s_q8_0(src, o, e):
    # block_q8_0 (34 B): d(f16) qs[32](int8)
    return _f16(src, o + 34 * e), np.float32(0)


@cuda.jit(device=True)
def _v_q8_0(src, o, i, a, b):
    # y = q * d
    return fmul(_f(_i8(_b(src, o + 34 * (i >> 5) + 2 + (i & 31)))), a)


@cuda.jit(device=True)
def _s_q4_0(src, o, e):
    # block_q4_0 (18 B): d(f16) qs[16]
    return _f16(src, o + 18 * e), np.float32(0)


@cuda.jit(device=True)
def _v_q4_0(src, o, i, a, b):
    # y = d*(q-8)
    l = i & 31
    q = _nibble(_b(src, o + 18 * (i >> 5) + 2 + (l & 15)), l)
    return fmul(a, _f(q - 8))


@cuda.jit(device=True)
def _s_q4_1(src, o, e):
    # block_q4_1 (20 B): d(f16) m(f16) qs[16]
    p = o + 20 * e
    return _f16(src, p), _f16(src, p + 2)


@cuda.jit(device=True)
def _v_q4_1(src, o, i, a, b):
    # y = (d*q) + m
    l = i & 31
    q = _nibble(_b(src, o + 20 * (i >> 5) + 4 + (l & 15)), l)
    return fmul(a, _f(q)) + b


@cuda.jit(device=True)
def _q5(src, o_qh, o_qs, l):
    # 4 low bits from qs like Q4, 5th bit = bit l of the u32 qh
    q = _nibble(_b(src, o_qs + (l & 15)), l)
    return q | (((_b(src, o_qh + (l >> 3)) >> (l & 7)) & 1) << 4)


@cuda.jit(device=True)
def _s_q5_0(src, o, e):
    # block_q5_0 (22 B): d(f16) qh[4] qs[16]
    return _f16(src, o + 22 * e), np.float32(0)


@cuda.jit(device=True)
def _v_q5_0(src, o, i, a, b):
    # y = d*(q-16)
    p = o + 22 * (i >> 5)
    return fmul(a, _f(_q5(src, p + 2, p + 6, i & 31) - 16))


@cuda.jit(device=True)
def _s_q5_1(src, o, e):
    # block_q5_1 (24 B): d(f16) m(f16) qh[4] qs[16]
    p = o + 24 * e
    return _f16(src, p), _f16(src, p + 2)


@cuda.jit(device=True)
def _v_q5_1(src, o, i, a, b):
    # y = (d*q) + m
    p = o + 24 * (i >> 5)
    return fmul(a, _f(_q5(src, p + 4, p + 8, i & 31))) + b


# ------------------------------------------------------ 256-value K-quants
# unit: 1 super-block; scale entry e = sub-block e: (d*sc, dmin*m) or (d*sc, 0)
@cuda.jit(device=True)
def _s_q2_k(src, o, e):
    # block_q2_K (84 B): scales[16] (lo nibble scale, hi min) qs[64] d(f16) dmin(f16)
    s = _b(src, o + e)
    return fmul(_f16(src, o + 80), _f(s & 0xF)), fmul(_f16(src, o + 82), _f(s >> 4))


@cuda.jit(device=True)
def _v_q2_k(src, o, i, a, b):
    # y = (d*sc)*q - (dmin*m)
    sb = i >> 4
    q = (_b(src, o + 16 + 32 * (sb >> 3) + (i & 31)) >> (2 * ((sb >> 1) & 3))) & 3
    return fmul(a, _f(q)) - b


@cuda.jit(device=True)
def _s_q3_k(src, o, e):
    # block_q3_K (110 B): hmask[32] qs[64] scales[12] d(f16)
    lo = _b(src, o + 96 + (e & 7))
    lo = (lo & 0xF) if e < 8 else (lo >> 4)
    hi = (_b(src, o + 104 + (e & 3)) >> (2 * (e >> 2))) & 3
    return fmul(_f16(src, o + 108), _f((lo | (hi << 4)) - 32)), np.float32(0)


@cuda.jit(device=True)
def _v_q3_k(src, o, i, a, b):
    # y = (d*sc)*q
    sb = i >> 4
    l = i & 31
    q = (_b(src, o + 32 + 32 * (sb >> 3) + l) >> (2 * ((sb >> 1) & 3))) & 3
    h = (_b(src, o + l) >> (sb >> 1)) & 1
    return fmul(a, _f(q - 4 * (1 - h)))


@cuda.jit(device=True)
def _s_q4_k(src, o, e):
    """Q4_K and Q5_K: (d*sc, dmin*m) of sub-block e from the 6-bit pair e of the
    12 scale bytes at o + 4."""
    sc = o + 4
    if e < 4:
        s = _b(src, sc + e) & 0x3F
        m = _b(src, sc + 4 + e) & 0x3F
    else:
        md = _b(src, sc + 4 + e)
        s = (md & 0xF) | ((_b(src, sc + e - 4) >> 2) & 0x30)
        m = (md >> 4) | ((_b(src, sc + e) >> 2) & 0x30)
    return fmul(_f16(src, o), _f(s)), fmul(_f16(src, o + 2), _f(m))


@cuda.jit(device=True)
def _v_q4_k(src, o, i, a, b):
    # block_q4_K (144 B): d(f16) dmin(f16) scales[12] qs[128].  y = (d*sc)*q - (dmin*m)
    sb = i >> 5
    q = (_b(src, o + 16 + 32 * (sb >> 1) + (i & 31)) >> (4 * (sb & 1))) & 0xF
    return fmul(a, _f(q)) - b


@cuda.jit(device=True)
def _v_q5_k(src, o, i, a, b):
    # block_q5_K (176 B): d(f16) dmin(f16) scales[12] qh[32] qs[128]
    sb = i >> 5
    l = i & 31
    q = (_b(src, o + 48 + 32 * (sb >> 1) + l) >> (4 * (sb & 1))) & 0xF
    q |= ((_b(src, o + 16 + l) >> sb) & 1) << 4
    return fmul(a, _f(q)) - b


@cuda.jit(device=True)
def _s_q6_k(src, o, e):
    # block_q6_K (210 B): ql[128] qh[64] scales[16](int8) d(f16)
    return fmul(_f16(src, o + 208), _f(_i8(_b(src, o + 192 + e)))), np.float32(0)


@cuda.jit(device=True)
def _v_q6_k(src, o, i, a, b):
    # y = (d*sc)*q
    h = i >> 7
    r = i & 127
    q = (_b(src, o + 64 * h + (r & 63)) >> (4 * (r >> 6))) & 0xF
    q |= ((_b(src, o + 128 + 32 * h + (r & 31)) >> (2 * (r >> 5))) & 3) << 4
    return fmul(a, _f(q - 32))


# ------------------------------------------------- 4-bit codebook types
# y = kv[q] * d: a 4-bit code picks one of 16 integers (kept as float32, exact; a
# global array, so a constant of the kernel), times its block's or sub-block's scale.
from ..dequant import _KV_IQ4NL, _KV_MXFP4   # noqa: E402  (the CPU kernels' tables: e2m1 doubled, iq4_nl)


@cuda.jit(device=True)
def _s_mxfp4(src, o, e):
    # block_mxfp4 (17 B): e(E8M0) qs[16];  d = 2^(e-128) by its bits (ggml_e8m0_to_fp32_half)
    x = np.uint32(_b(src, o + 17 * e))
    bits = (np.uint32(0x00200000) << x) if x < 2 else ((x - np.uint32(1)) << np.uint32(23))
    return bits_to_f32(np.uint32(bits)), np.float32(0)


@cuda.jit(device=True)
def _v_mxfp4(src, o, i, a, b):
    # y = kv[q] * d
    l = i & 31
    q = _nibble(_b(src, o + 17 * (i >> 5) + 1 + (l & 15)), l)
    return fmul(_KV_MXFP4[np.uint32(q)], a)


@cuda.jit(device=True)
def _s_iq4_nl(src, o, e):
    # block_iq4_nl (18 B): d(f16) qs[16]
    return _f16(src, o + 18 * e), np.float32(0)


@cuda.jit(device=True)
def _v_iq4_nl(src, o, i, a, b):
    # y = d * kv[q]
    l = i & 31
    q = _nibble(_b(src, o + 18 * (i >> 5) + 2 + (l & 15)), l)
    return fmul(a, _KV_IQ4NL[np.uint32(q)])


@cuda.jit(device=True)
def _s_iq4_xs(src, o, e):
    # block_iq4_xs (136 B): d(f16) scales_h(u16) scales_l[4] qs[128]; sub-block e's 6-bit
    # scale: low 4 bits from scales_l[e/2] (nibble e%2), high 2 from bits 2e of scales_h
    ls = ((_b(src, o + 4 + (e >> 1)) >> (4 * (e & 1))) & 0xF) | (((_u16(src, o + 2) >> (2 * e)) & 3) << 4)
    return fmul(_f16(src, o), _f(ls - 32)), np.float32(0)


@cuda.jit(device=True)
def _v_iq4_xs(src, o, i, a, b):
    # y = (d*(ls-32)) * kv[q];  sub-block i/32's codes at qs[16 (i/32)], as IQ4_NL
    l = i & 31
    q = _nibble(_b(src, o + 8 + 16 * (i >> 5) + (l & 15)), l)
    return fmul(a, _KV_IQ4NL[np.uint32(q)])


# qtype -> (value function, scale function, values per scale entry)
_FNS = {int(t): f for t, f in {
    T.F32: (_v_f32, None, 32), T.F16: (_v_f16, None, 32), T.BF16: (_v_bf16, None, 32),
    T.Q8_0: (_v_q8_0, _s_q8_0, 32), T.Q4_0: (_v_q4_0, _s_q4_0, 32),
    T.Q4_1: (_v_q4_1, _s_q4_1, 32), T.Q5_0: (_v_q5_0, _s_q5_0, 32),
    T.Q5_1: (_v_q5_1, _s_q5_1, 32),
    T.Q2_K: (_v_q2_k, _s_q2_k, 16), T.Q3_K: (_v_q3_k, _s_q3_k, 16),
    T.Q4_K: (_v_q4_k, _s_q4_k, 32), T.Q5_K: (_v_q5_k, _s_q4_k, 32),
    T.Q6_K: (_v_q6_k, _s_q6_k, 16),
    T.MXFP4: (_v_mxfp4, _s_mxfp4, 32), T.IQ4_NL: (_v_iq4_nl, _s_iq4_nl, 32),
    T.IQ4_XS: (_v_iq4_xs, _s_iq4_xs, 32),
}.items()}

CUDA_TYPES: frozenset[int] = frozenset(_FNS)
"""GGML type ids with a CUDA dequantization kernel (the same set as the CPU's NUMBA_TYPES)."""


# ------------------------------------------------------------------- kernels
def _make_kernels(qtype: int, bf16: bool = False):
    """(plain, gather) kernels of a type, writing float32 values or (bf16) their bf16 bits."""
    value, scale, sub = _FNS[qtype]
    block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    unit_bytes = QK_K // block_size * type_size
    scaled = scale is not None  # floats: the table stays unfilled, their value
    scale = scale or _s_q8_0  # functions ignore (a, b); this scale is never called
    sub_shift = sub.bit_length() - 1  # log2(values per scale entry): 5 or 4
    n_sub_shift = 8 - sub_shift
    n_sub = 1 << n_sub_shift  # scale entries per unit: 8 or 16
    n_tab = WARPS * n_sub  # per thread block: <= THREADS

    @cuda.jit(device=True)
    def row(src, dst):
        # src: the row's bytes; dst: its n values. This thread block: units
        # blockIdx.y * WARPS + w, warp w; lane t: values t + 32k, k = 0..7.
        n = dst.shape[0]
        tid = np.int32(cuda.threadIdx.x)
        u0 = np.int32(cuda.blockIdx.y) * WARPS
        tab_a = cuda.shared.array(n_tab, float32)
        tab_b = cuda.shared.array(n_tab, float32)
        if scaled:  # thread tid: entry tid = sub-block tid % n_sub of unit tid // n_sub
            if tid < n_tab:
                u = u0 + (tid >> n_sub_shift)
                e = tid & (n_sub - 1)
                if QK_K * u + (e << sub_shift) < n:
                    a, b = scale(src, unit_bytes * u, e)
                    tab_a[np.uint64(tid)] = a
                    tab_b[np.uint64(tid)] = b
            cuda.syncthreads()
        w = tid >> 5
        lane = tid & 31
        u = u0 + w
        o = unit_bytes * u
        j = QK_K * u + lane
        t0 = n_sub * w + (lane >> sub_shift)  # its table entry at k = 0
        if QK_K * u + QK_K <= n:  # whole unit: compute all eight, then store
            v = cuda.local.array(8, float32)
            for k in range(8):
                i = 32 * k + lane
                t = np.uint64(t0 + (k << (5 - sub_shift)))  # entry of i
                v[k] = value(src, o, i, tab_a[t], tab_b[t])
            for k in range(8):
                if bf16:
                    dst[np.uint64(j + 32 * k)] = bf16_bits(v[k])
                else:
                    dst[np.uint64(j + 32 * k)] = v[k]
        else:  # the row's last, partial unit (legacy blocks, floats)
            for k in range(8):
                if j + 32 * k < n:
                    i = 32 * k + lane
                    t = np.uint64(t0 + (k << (5 - sub_shift)))  # entry of i
                    x = value(src, o, i, tab_a[t], tab_b[t])
                    if bf16:
                        dst[np.uint64(j + 32 * k)] = bf16_bits(x)
                    else:
                        dst[np.uint64(j + 32 * k)] = x

    @cuda.jit
    def plain(data, out):
        # grid (n_rows, ceil(n_units / WARPS)), THREADS threads; out (n_rows, n_cols)
        r = np.uint32(cuda.blockIdx.x)
        row(data[r], out[r])

    @cuda.jit
    def gather(data, rows, out):
        # out (n_out, n_cols); rows (n_out,) int64: out[i] = dequant(data[rows[i]])
        i = np.uint32(cuda.blockIdx.x)
        row(data[np.uint64(rows[i])], out[i])

    return plain, gather


_KERNELS: dict[tuple[int, bool], tuple] = {}


def _kernels(qtype: int, bf16: bool = False):
    k = _KERNELS.get((qtype, bf16))
    if k is None:
        k = _KERNELS[qtype, bf16] = _make_kernels(qtype, bf16)
    return k


# ---------------------------------------------------------------- Python API
def _check(data, qtype, out, n_rows: int) -> int:
    try:
        name = T(qtype).name
    except ValueError:
        raise ValueError(f"unknown GGML tensor type id {qtype!r}") from None
    if int(qtype) not in CUDA_TYPES:
        raise ValueError(f"no CUDA dequantization kernel for GGML type {name}")
    shape = check_ndim("dequant", "data", data, 2, np.uint8)
    check("dequant", "data", data, shape, np.uint8)
    out_dtype = np.uint16 if is_device_array(out) and np.dtype(out.dtype) == np.uint16 else np.float32
    out_shape = check_ndim("dequant", "out", out, 2, out_dtype)
    check("dequant", "out", out, out_shape, out_dtype)
    block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    n_cols = out_shape[1]
    if n_cols % block_size != 0:
        raise ValueError(f"{name}: n_cols {n_cols} is not a multiple of block size {block_size}")
    if shape[1] != n_cols // block_size * type_size:
        raise ValueError(f"{name}: row of {n_cols} values takes "
                         f"{n_cols // block_size * type_size} bytes, data rows have {shape[1]}")
    if out_shape[0] != n_rows:
        raise ValueError(f"out has {out_shape[0]} rows, expected {n_rows}")
    return int(qtype)


def _grid(out):
    n_rows, n_cols = out.shape
    return (n_rows, cdiv(cdiv(n_cols, QK_K), WARPS)), THREADS


def dequantize_into(data, qtype: int, out) -> None:
    """out[i] = dequant(data[i]) for all rows, on the device.

    data: C-contiguous uint8 device array (n_rows, row_bytes) of whole rows;
    out: C-contiguous float32 device array (n_rows, n_cols), or uint16 for the values'
    bf16 bits (each float32 value rounded to nearest even: the GPU's bf16 products)."""
    n_rows = data.shape[0] if is_device_array(data) and len(data.shape) == 2 else -1
    qtype = _check(data, qtype, out, n_rows)
    if out.shape[0] == 0 or out.shape[1] == 0:
        return
    grid, block = _grid(out)
    _kernels(qtype, np.dtype(out.dtype) == np.uint16)[0][grid, block](data, out)


def dequantize_rows_into(data, qtype: int, rows, out) -> None:
    """Gather + dequantize on the device: out[i] = dequant(data[rows[i]]).

    rows: int64 device array (n_out,), every entry in [0, n_rows) (not checked on
    the device: an index out of range reads out of bounds); out (n_out, n_cols)."""
    check_ndim("dequant", "rows", rows, 1, np.int64)
    qtype = _check(data, qtype, out, rows.shape[0])
    if out.shape[0] == 0 or out.shape[1] == 0:
        return
    grid, block = _grid(out)
    _kernels(qtype, np.dtype(out.dtype) == np.uint16)[1][grid, block](data, rows, out)
