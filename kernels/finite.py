"""Which rows of a GGUF tensor hold a non-finite value (inf or nan), without dequantizing.

A dequantized value is the product (and for Q4_1/Q5_1/K-quants the difference) of
the block's float scale fields and small integers, exactly as in
``dequantize_row_*`` of ggml-quants.c. With finite f16 scales every value is finite
(the largest magnitude, Q6_K's d * 127 * 32 = 2.7e8, is far from float32's limit),
and a non-finite scale makes every value of its block non-finite (inf * 0 = nan).
So a row is non-finite exactly when one of its float fields is: the f16 ``d`` (and
``m``/``dmin``) of each block of the quantized types, every value of F16/BF16/F32.
The kernel reads only those fields and tests their exponent bits (all ones = inf
or nan), so it touches 2-4 bytes per block instead of dequantizing 32-256 values.
MXFP4 is the exception: its scale is a power of two, 2^(e-128) for the byte e (never
inf or nan), and a value kv * 2^(e-128) (|kv| <= 12) overflows to inf exactly when
|kv| >= 2^(256-e), possible only for e >= 253; the codes of those blocks are read.

Reference: ``nonfinite_rows_ref`` dequantizes with the gguf package and applies
``np.isfinite``; the two agree row for row on every type in ``SCAN_TYPES``.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as _gguf_dequantize
from numba import njit, prange

from .dequant import _KV_MXFP4

__all__ = ["SCAN_TYPES", "nonfinite_rows_into", "nonfinite_rows", "nonfinite_rows_ref"]

_F16, _BF16, _F32 = 0, 1, 2     # how a float field is stored

# type -> (field format, byte offsets of the float fields inside one block); block sizes from ggml-common.h
_FIELDS = {
    T.F32: (_F32, (0,)), T.F16: (_F16, (0,)), T.BF16: (_BF16, (0,)),
    T.Q8_0: (_F16, (0,)),                 # d, qs[32]
    T.Q4_0: (_F16, (0,)),                 # d, qs[16]
    T.Q4_1: (_F16, (0, 2)),               # d, m, qs[16]
    T.Q5_0: (_F16, (0,)),                 # d, qh[4], qs[16]
    T.Q5_1: (_F16, (0, 2)),               # d, m, qh[4], qs[16]
    T.Q2_K: (_F16, (80, 82)),             # scales[16], qs[64], d, dmin
    T.Q3_K: (_F16, (108,)),               # hmask[32], qs[64], scales[12], d
    T.Q4_K: (_F16, (0, 2)),               # d, dmin, scales[12], qs[128]
    T.Q5_K: (_F16, (0, 2)),               # d, dmin, scales[12], qh[32], qs[128]
    T.Q6_K: (_F16, (208,)),               # ql[128], qh[64], scales[16], d
    T.IQ4_NL: (_F16, (0,)),               # d, qs[16]
    T.IQ4_XS: (_F16, (0,)),               # d, scales_h, scales_l[4], qs[128]
}
_OFFSETS = {t: np.asarray(offs, np.int64) for t, (_, offs) in _FIELDS.items()}

SCAN_TYPES: frozenset[int] = frozenset(int(t) for t in _FIELDS) | {int(T.MXFP4)}
"""GGML type ids the kernel scans; others are checked through the reference."""


@njit(cache=True, inline="always")
def _nonfinite_f16(row, p):
    """True when the little-endian f16 at byte p of row has an all-ones exponent
    (bits 14..10 = high byte 0x7C): the scale fields of every quantized type."""
    return (row[p + 1] & 0x7C) == 0x7C


@njit(cache=True, parallel=True)
def _nonfinite_float_rows(data, kind, out):
    # F16 / BF16 / F32 rows: every value is a float field. A branch-free OR over the
    # row's exponent tests, which LLVM vectorizes (memory-bound: 16 Gweights/s for
    # F16 on two Zen 3 cores, against 0.5 for the per-field loop below, whose early
    # exit kept it scalar: 12 s of start-up for a 7B F16 model).
    for i in prange(data.shape[0]):
        row = data[i]
        bad = False
        if kind == 0:                               # f16: exponent bits 14..10
            v = row.view(np.uint16)
            for j in range(v.shape[0]):
                bad |= (v[j] & np.uint16(0x7C00)) == np.uint16(0x7C00)
        elif kind == 1:                             # bf16: exponent bits 14..7
            v = row.view(np.uint16)
            for j in range(v.shape[0]):
                bad |= (v[j] & np.uint16(0x7F80)) == np.uint16(0x7F80)
        else:                                       # f32: exponent bits 30..23
            v = row.view(np.uint32)
            for j in range(v.shape[0]):
                bad |= (v[j] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
        out[i] = bad


@njit(cache=True, parallel=True)
def _nonfinite_rows(data, type_size, offsets, out):
    # quantized rows: data (n_rows, row_bytes) uint8; out (n_rows,) bool: does row i
    # hold a non-finite f16 field (at `offsets` in each block of type_size bytes)?
    for i in prange(data.shape[0]):
        row = data[i]
        bad = False
        for o in range(0, row.shape[0], type_size):
            for f in offsets:
                if _nonfinite_f16(row, o + f):
                    bad = True
                    break
            if bad:
                break
        out[i] = bad


_KV_MXFP4_ABS = _KV_MXFP4[:8].astype(np.int32)   # |kvalues_mxfp4[q]| by q & 7 (kernels/dequant.py)


@njit(cache=True, parallel=True)
def _nonfinite_mxfp4_rows(data, out):
    # block_mxfp4 (17 B): e, qs[16]; a value kv[q] * 2^(e-128) is inf exactly when
    # |kv[q]| >= 2^(256-e): 8, 4, 2 for e = 253, 254, 255, none below
    for i in prange(data.shape[0]):
        row = data[i]
        bad = False
        for o in range(0, row.shape[0], 17):
            e = np.int32(row[o])
            if e >= 253:
                limit = np.int32(1) << (256 - e)
                for j in range(o + 1, o + 17):
                    q = np.int32(row[j])
                    bad |= _KV_MXFP4_ABS[q & 7] >= limit or _KV_MXFP4_ABS[(q >> 4) & 7] >= limit
        out[i] = bad


def nonfinite_rows_into(data: np.ndarray, qtype: int, out: np.ndarray) -> None:
    """out[i] = row i of the tensor bytes `data` (C-contiguous uint8 (n_rows, row_bytes))
    holds a non-finite value once dequantized. `qtype` must be in SCAN_TYPES."""
    data = np.asarray(data)
    if int(qtype) not in SCAN_TYPES:
        raise ValueError(f"no finite-scan kernel for GGML type {T(qtype).name}")
    if not (data.dtype == np.uint8 and data.ndim == 2 and data.flags.c_contiguous):
        raise ValueError("data must be a C-contiguous 2-D uint8 array (n_rows, row_bytes)")
    type_size = GGML_QUANT_SIZES[T(qtype)][1]
    if data.shape[1] % type_size:
        raise ValueError(f"{T(qtype).name}: rows of {data.shape[1]} bytes are not whole blocks of {type_size}")
    if not (isinstance(out, np.ndarray) and out.dtype == np.bool_ and out.shape == (data.shape[0],)
            and out.flags.writeable):
        raise ValueError(f"out must be a writeable bool array of shape ({data.shape[0]},)")
    if T(qtype) == T.MXFP4:
        _nonfinite_mxfp4_rows(data, out)
    elif T(qtype) in (T.F16, T.BF16, T.F32):
        _nonfinite_float_rows(data, _FIELDS[T(qtype)][0], out)
    else:
        _nonfinite_rows(data, type_size, _OFFSETS[T(qtype)], out)


def nonfinite_rows_ref(data: np.ndarray, qtype: int, n_cols: int) -> np.ndarray:
    """Reference: dequantize with the gguf package and test every value with np.isfinite."""
    raw = np.ascontiguousarray(data).view(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):         # inf * 0 is the point here
        values = np.asarray(_gguf_dequantize(raw.reshape(raw.shape[0], -1), T(qtype)), np.float32)
    return ~np.isfinite(values.reshape(raw.shape[0], n_cols)).all(axis=1)


def nonfinite_rows(data: np.ndarray, qtype: int, n_cols: int) -> np.ndarray:
    """(n_rows,) bool for any type: the kernel where it has one, else the reference."""
    raw = np.ascontiguousarray(np.asarray(data).view(np.uint8)).reshape(np.asarray(data).shape[0], -1)
    if int(qtype) not in SCAN_TYPES:
        return nonfinite_rows_ref(raw, qtype, n_cols)
    out = np.empty(raw.shape[0], np.bool_)
    nonfinite_rows_into(raw, qtype, out)
    return out
