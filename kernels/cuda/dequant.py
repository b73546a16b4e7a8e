"""CUDA dequantization of GGUF tensor data to float32, bit for bit like the CPU
kernels in ``llamatune.kernels.dequant`` (and so like ``gguf.quants.dequantize``).

Launch layout: one thread per output value; grid (n_rows, ceil(n_cols / 256)),
256 threads per block, so a block covers one K-quant super-block (256 values) or
eight 32-value legacy blocks of one row. Each thread reads the f16 scale(s) and
the bytes of its own value straight from global memory (the block's threads read
the same few scale bytes, served by L1) and recomputes its sub-block scale; the
float32 operations are those of the CPU kernel in the same order, and every
product goes through ``fmul`` (``__nv_fmul_rn``) so that NVVM cannot contract
``d*q + m`` or ``dl*q - ml`` into an FMA (which rounds once instead of twice).
Half floats are decoded from their bits (``_half_bits_to_f32``, as the CPU
kernel: subnormals normalised, inf and NaN payloads kept).

Each type has a device function ``_v_<type>(data, r, j)`` giving value j of
source row r; two kernels per type are built from it on first use: a plain one
(out[i] = dequant(data[i])) and a gathering one (out[i] = dequant(data[rows[i]]),
the embedding lookup).
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ._common import bits_to_f32, cdiv, check, check_ndim, cuda, fmul, is_device_array

THREADS = 256  # threads per block = values per block along a row
QK_K = 256

__all__ = ["CUDA_TYPES", "dequantize_into", "dequantize_rows_into"]


# ---------------------------------------------------------------- bit helpers
@cuda.jit(device=True)
def _b(data, r, o):
    """Byte o of row r as int64."""
    return np.int64(data[r, o])


@cuda.jit(device=True)
def _u16(data, r, o):
    return _b(data, r, o) | (_b(data, r, o + 1) << 8)


@cuda.jit(device=True)
def _i8(v):
    """int64 holding a byte -> its signed int8 value."""
    return v - ((v & 0x80) << 1)


@cuda.jit(device=True)
def _half_bits_to_f32(h):
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if exp == 0x1F:  # inf / nan
        bits = sign | 0x7F800000 | (mant << 13)
    elif exp != 0:  # normal: rebias 15 -> 127
        bits = sign | ((exp + 112) << 23) | (mant << 13)
    elif mant == 0:  # +-0
        bits = sign
    else:  # subnormal half: normalise into a normal float32
        e = np.int64(113)
        while (mant & 0x400) == 0:
            mant <<= 1
            e -= 1
        bits = sign | (e << 23) | ((mant & 0x3FF) << 13)
    return bits_to_f32(bits)


@cuda.jit(device=True)
def _f16(data, r, o):
    return _half_bits_to_f32(_u16(data, r, o))


@cuda.jit(device=True)
def _f(v):
    """Small integer -> float32 (exact)."""
    return np.float32(v)


# ------------------------------------------------------------ value functions
@cuda.jit(device=True)
def _v_f32(data, r, j):
    o = 4 * j
    return bits_to_f32(_u16(data, r, o) | (_u16(data, r, o + 2) << 16))


@cuda.jit(device=True)
def _v_f16(data, r, j):
    return _f16(data, r, 2 * j)


@cuda.jit(device=True)
def _v_bf16(data, r, j):
    return bits_to_f32(_u16(data, r, 2 * j) << 16)


@cuda.jit(device=True)
def _v_q8_0(data, r, j):
    # block_q8_0 (34 B): d(f16) qs[32](int8);  y = q * d
    o = 34 * (j >> 5)
    return fmul(_f(_i8(_b(data, r, o + 2 + (j & 31)))), _f16(data, r, o))


@cuda.jit(device=True)
def _nibble(byte, l):
    """Value l (0..31) of a 32-value block stores its 4 low bits in byte l%16:
    the low nibble for l < 16, the high one for l >= 16."""
    return (byte >> 4) if l >= 16 else (byte & 0xF)


@cuda.jit(device=True)
def _v_q4_0(data, r, j):
    # block_q4_0 (18 B): d(f16) qs[16];  y = d*(q-8)
    o = 18 * (j >> 5)
    l = j & 31
    q = _nibble(_b(data, r, o + 2 + (l & 15)), l)
    return fmul(_f16(data, r, o), _f(q - 8))


@cuda.jit(device=True)
def _v_q4_1(data, r, j):
    # block_q4_1 (20 B): d(f16) m(f16) qs[16];  y = (d*q) + m
    o = 20 * (j >> 5)
    l = j & 31
    q = _nibble(_b(data, r, o + 4 + (l & 15)), l)
    return fmul(_f16(data, r, o), _f(q)) + _f16(data, r, o + 2)


@cuda.jit(device=True)
def _q5(data, r, o_qh, o_qs, l):
    # 4 low bits from qs like Q4, 5th bit = bit l of the u32 qh
    q = _nibble(_b(data, r, o_qs + (l & 15)), l)
    return q | (((_b(data, r, o_qh + (l >> 3)) >> (l & 7)) & 1) << 4)


@cuda.jit(device=True)
def _v_q5_0(data, r, j):
    # block_q5_0 (22 B): d(f16) qh[4] qs[16];  y = d*(q-16)
    o = 22 * (j >> 5)
    q = _q5(data, r, o + 2, o + 6, j & 31)
    return fmul(_f16(data, r, o), _f(q - 16))


@cuda.jit(device=True)
def _v_q5_1(data, r, j):
    # block_q5_1 (24 B): d(f16) m(f16) qh[4] qs[16];  y = (d*q) + m
    o = 24 * (j >> 5)
    q = _q5(data, r, o + 4, o + 8, j & 31)
    return fmul(_f16(data, r, o), _f(q)) + _f16(data, r, o + 2)


@cuda.jit(device=True)
def _v_q2_k(data, r, j):
    # block_q2_K (84 B): scales[16] (lo nibble scale, hi min) qs[64] d(f16) dmin(f16).
    # y = (d*sc)*q - (dmin*m)
    o = 84 * (j >> 8)
    i = j & 255
    sb = i >> 4
    s = _b(data, r, o + sb)
    dl = fmul(_f16(data, r, o + 80), _f(s & 0xF))
    ml = fmul(_f16(data, r, o + 82), _f(s >> 4))
    qs = o + 16 + 32 * (sb >> 3) + 16 * (sb & 1) + (i & 15)
    q = (_b(data, r, qs) >> (2 * ((sb >> 1) & 3))) & 3
    return fmul(dl, _f(q)) - ml


@cuda.jit(device=True)
def _v_q3_k(data, r, j):
    # block_q3_K (110 B): hmask[32] qs[64] scales[12] d(f16).  y = (d*sc)*q
    o = 110 * (j >> 8)
    i = j & 255
    sb = i >> 4
    sc = o + 96
    lo = _b(data, r, sc + (sb & 7))
    lo = (lo & 0xF) if sb < 8 else (lo >> 4)
    hi = (_b(data, r, sc + 8 + (sb & 3)) >> (2 * (sb >> 2))) & 3
    dl = fmul(_f16(data, r, o + 108), _f((lo | (hi << 4)) - 32))
    l = 16 * (sb & 1) + (i & 15)  # == i & 31
    q = (_b(data, r, o + 32 + 32 * (sb >> 3) + l) >> (2 * ((sb >> 1) & 3))) & 3
    h = (_b(data, r, o + l) >> (sb >> 1)) & 1
    return fmul(dl, _f(q - 4 * (1 - h)))


@cuda.jit(device=True)
def _scale_min_k4(data, r, sc, sb):
    """6-bit (scale, min) pair sb of the 12-byte K4/K5 scales at byte offset sc."""
    if sb < 4:
        s = _b(data, r, sc + sb) & 0x3F
        m = _b(data, r, sc + 4 + sb) & 0x3F
    else:
        md = _b(data, r, sc + 4 + sb)
        s = (md & 0xF) | ((_b(data, r, sc + sb - 4) >> 2) & 0x30)
        m = (md >> 4) | ((_b(data, r, sc + sb) >> 2) & 0x30)
    return s, m


@cuda.jit(device=True)
def _v_q4_k(data, r, j):
    # block_q4_K (144 B): d(f16) dmin(f16) scales[12] qs[128].  y = (d*sc)*q - (dmin*m)
    o = 144 * (j >> 8)
    i = j & 255
    sb = i >> 5
    s, m = _scale_min_k4(data, r, o + 4, sb)
    dl = fmul(_f16(data, r, o), _f(s))
    ml = fmul(_f16(data, r, o + 2), _f(m))
    q = (_b(data, r, o + 16 + 32 * (sb >> 1) + (i & 31)) >> (4 * (sb & 1))) & 0xF
    return fmul(dl, _f(q)) - ml


@cuda.jit(device=True)
def _v_q5_k(data, r, j):
    # block_q5_K (176 B): d(f16) dmin(f16) scales[12] qh[32] qs[128].
    o = 176 * (j >> 8)
    i = j & 255
    sb = i >> 5
    l = i & 31
    s, m = _scale_min_k4(data, r, o + 4, sb)
    dl = fmul(_f16(data, r, o), _f(s))
    ml = fmul(_f16(data, r, o + 2), _f(m))
    q = (_b(data, r, o + 48 + 32 * (sb >> 1) + l) >> (4 * (sb & 1))) & 0xF
    q |= ((_b(data, r, o + 16 + l) >> sb) & 1) << 4
    return fmul(dl, _f(q)) - ml


@cuda.jit(device=True)
def _v_q6_k(data, r, j):
    # block_q6_K (210 B): ql[128] qh[64] scales[16](int8) d(f16).  y = (d*sc)*q
    o = 210 * (j >> 8)
    i = j & 255
    dl = fmul(_f16(data, r, o + 208), _f(_i8(_b(data, r, o + 192 + (i >> 4)))))
    h = i >> 7
    rr = i & 127
    q = (_b(data, r, o + 64 * h + (rr & 63)) >> (4 * (rr >> 6))) & 0xF
    q |= ((_b(data, r, o + 128 + 32 * h + (rr & 31)) >> (2 * (rr >> 5))) & 3) << 4
    return fmul(dl, _f(q - 32))


_VALUE_FNS = {int(t): f for t, f in {
    T.F32: _v_f32, T.F16: _v_f16, T.BF16: _v_bf16,
    T.Q8_0: _v_q8_0, T.Q4_0: _v_q4_0, T.Q4_1: _v_q4_1,
    T.Q5_0: _v_q5_0, T.Q5_1: _v_q5_1,
    T.Q2_K: _v_q2_k, T.Q3_K: _v_q3_k, T.Q4_K: _v_q4_k,
    T.Q5_K: _v_q5_k, T.Q6_K: _v_q6_k,
}.items()}

CUDA_TYPES: frozenset[int] = frozenset(_VALUE_FNS)
"""GGML type ids with a CUDA dequantization kernel (the same set as the CPU's NUMBA_TYPES)."""


# ------------------------------------------------------------------- kernels
def _make_kernels(value):
    @cuda.jit
    def plain(data, out):
        # grid (n_rows, ceil(n_cols / THREADS)); out (n_rows, n_cols)
        i = cuda.blockIdx.x
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if j < out.shape[1]:
            out[i, j] = value(data, i, j)

    @cuda.jit
    def gather(data, rows, out):
        # out (n_out, n_cols); rows (n_out,) int64: out[i] = dequant(data[rows[i]])
        i = cuda.blockIdx.x
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if j < out.shape[1]:
            out[i, j] = value(data, rows[i], j)

    return plain, gather


_KERNELS: dict[int, tuple] = {}


def _kernels(qtype: int):
    k = _KERNELS.get(qtype)
    if k is None:
        k = _KERNELS[qtype] = _make_kernels(_VALUE_FNS[qtype])
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
    out_shape = check_ndim("dequant", "out", out, 2, np.float32)
    check("dequant", "out", out, out_shape, np.float32)
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
    return (n_rows, cdiv(n_cols, THREADS)), THREADS


def dequantize_into(data, qtype: int, out) -> None:
    """out[i] = dequant(data[i]) for all rows, on the device.

    data: C-contiguous uint8 device array (n_rows, row_bytes) of whole rows;
    out: C-contiguous float32 device array (n_rows, n_cols)."""
    n_rows = data.shape[0] if is_device_array(data) and len(data.shape) == 2 else -1
    qtype = _check(data, qtype, out, n_rows)
    if out.shape[0] == 0 or out.shape[1] == 0:
        return
    grid, block = _grid(out)
    _kernels(qtype)[0][grid, block](data, out)


def dequantize_rows_into(data, qtype: int, rows, out) -> None:
    """Gather + dequantize on the device: out[i] = dequant(data[rows[i]]).

    rows: int64 device array (n_out,), every entry in [0, n_rows) (not checked on
    the device: an index out of range reads out of bounds); out (n_out, n_cols)."""
    check_ndim("dequant", "rows", rows, 1, np.int64)
    qtype = _check(data, qtype, out, rows.shape[0])
    if out.shape[0] == 0 or out.shape[1] == 0:
        return
    grid, block = _grid(out)
    _kernels(qtype)[1][grid, block](data, rows, out)
