"""IQ4_NL and IQ4_XS quantizers: llama.cpp's ``quantize_iq4_nl`` / ``quantize_iq4_xs``
and the ``quantize_row_iq4_nl_impl`` they share (ggml/src/ggml-quants.c), with and
without importance weights.

Both types store 4-bit indices into ggml's non-linear table ``kvalues_iq4nl``
(16 int8 values, -127 .. 113) times a scale:

* IQ4_NL (18 B per 32 values): d (f16), qs[16];  y_j = d * kv[q_j].
* IQ4_XS (136 B per 256 values): d (f16), scales_h (u16: the top 2 bits of each of the
  8 sub-block scales), scales_l[4] (their low 4 bits, two per byte), qs[128];
  y_j = d * (ls - 32) * kv[q_j] with ls the 6-bit scale of j's 32-value sub-block.
  qs holds value j of a 32-value sub-block in the low nibble of byte j, value j + 16
  in its high nibble (both types).

The fit of one 32-value block (``_fit_block``): weights w_j = x_j^2, or with
importances qw_j * sqrt(sigma2 + x_j^2) (sigma2 = 2 * mean x^2 over the super-block);
the scale max/kv[0] of the block's largest |x| and its nearest codes give the
weighted least-squares scale d = sum(w q x) / sum(w q^2); then, for ``ntry`` = 7,
the 15 inverse scales (kv[0] + t) / max, t = -7..7, are tried, and the one with the
largest sum(w q x)^2 / sum(w q^2) kept. IQ4_NL then stores d and the codes nearest
x / d. IQ4_XS writes d = -max_scale/32 of its 8 sub-block scales as the super-block
scale, rounds each sub-block's scale to a 6-bit multiple of it and takes the codes
nearest x / (d * l) (with the unrounded float d, as ggml does).

What llama.cpp writes: ``llama-quantize`` (``ggml_quantize_chunk``) runs
``quantize_iq4_nl`` / ``quantize_iq4_xs`` with ``ntry`` = 7, its importance matrix
or none; that is :func:`quantize_iq4` here. ``quantize_row_iq4_xs_ref`` is the same
call; ``quantize_row_iq4_nl_ref`` uses ``ntry`` = -1 (no search, codes of the first
pass; an all-zero block there keeps the previous block's codes, uninitialised memory
for the first one): ``ntry=-1`` here, with a zero block's codes all 8 (the index of
kv = 1, nearest 0), as the ``ntry`` = 7 code writes them.

Exactness: every C ``float`` operation is a float32 operation here, in the C order
(``w*q*x`` is ``(w*q)*x``, sums run in index order); ggml's nearest_int is
round-half-even; the f16 scales are rounded by numpy (round to nearest even, as
GGML_FP32_TO_FP16). Byte-identical to libggml-base (its ggml-quants.c is built
without FMA contraction) through ``ggml_quantize_chunk`` (tests/test_quantize_iq4.py).

``quantize_iq4_ref`` is the numpy reference (vectorised over blocks, the 32-step
sums in index order); the numba kernel loops over blocks with a ``prange`` over rows.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from numba import njit, prange

from .dequant import _KV_IQ4NL

__all__ = ["IQ4_KERNELS", "IQ4_WEIGHTED_KERNELS", "KVALUES_IQ4NL", "quantize_iq4", "quantize_iq4_ref"]

f32 = np.float32
GROUP_MAX_EPS = f32(1e-15)   # ggml-quants.c: a block with max |x| below this is all zero
NTRY = 7                     # quantize_iq4_nl / quantize_iq4_xs: scales tried either side
KVALUES_IQ4NL = _KV_IQ4NL.astype(np.int8)     # the dequantizer's table (kernels/dequant.py)
_KV = KVALUES_IQ4NL.astype(np.float32)
_SUPER = {T.IQ4_NL: 32, T.IQ4_XS: 256}   # values per block (super-block for IQ4_XS)


# -------------------------------------------------------------------- numba kernel
@njit(cache=True, inline="always")
def _best_index(kv, x):
    """best_index_int8: the index of the table value nearest x (binary search, ties up)."""
    if x <= kv[0]:
        return 0
    if x >= kv[15]:
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < kv[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - kv[mu - 1] < kv[mu] - x else mu


@njit(cache=True, inline="always")
def _sigma2(xs):
    """2 * mean x^2 over the super-block, summed in index order."""
    sigma2 = f32(0)
    for j in range(xs.shape[0]):
        sigma2 += xs[j] * xs[j]
    return sigma2 * (f32(2) / f32(xs.shape[0]))


@njit(cache=True, inline="always")
def _weights(xs, qw, weighted, sigma2, o, ib, w):
    """w (32,) of sub-block ib of super-block xs (qw indexed from column o)."""
    if weighted:
        for j in range(32):
            x = xs[32 * ib + j]
            w[j] = qw[o + 32 * ib + j] * f32(np.sqrt(sigma2 + x * x))
    else:
        for j in range(32):
            x = xs[32 * ib + j]
            w[j] = x * x


@njit(cache=True, inline="always")
def _sums(kv, xb, w, idd):
    """sum(w q x), sum(w q q) in index order for the codes nearest idd * x."""
    sumqx = f32(0)
    sumq2 = f32(0)
    for j in range(32):
        q = kv[_best_index(kv, idd * xb[j])]
        sumqx += w[j] * q * xb[j]
        sumq2 += w[j] * q * q
    return sumqx, sumq2


@njit(cache=True, inline="always")
def _fit_block(kv, xb, w, Lb, ntry):
    """The scale of one 32-value block (quantize_row_iq4_nl_impl's loop body); Lb gets
    the first pass's codes. Returns (d, False) for an all-zero block."""
    amax = f32(0)
    mx = f32(0)
    for j in range(32):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            mx = xb[j]
    if amax < GROUP_MAX_EPS:
        Lb[:] = 8                   # (quantize_row_iq4_nl_ref would keep stale codes)
        return f32(0), False
    d = -mx / kv[0] if ntry > 0 else mx / kv[0]
    idd = f32(1) / d
    for j in range(32):
        Lb[j] = _best_index(kv, idd * xb[j])
    sumqx, sumq2 = _sums(kv, xb, w, idd)
    d = sumqx / sumq2 if sumq2 > 0 else f32(0)
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        sumqx, sumq2 = _sums(kv, xb, w, (f32(itry) + kv[0]) / mx)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d, True


@njit(cache=True, inline="always")
def _codes(kv, xs, L, ib, idl):
    for j in range(32):
        L[32 * ib + j] = _best_index(kv, idl * xs[32 * ib + j])


@njit(cache=True, inline="always")
def _xs_scales(kv, xs, L, scales, y):
    """IQ4_XS's super-block scale (returned) from its 8 sub-block scales, their 6-bit
    codes into y[2:8] and the codes of every value into L."""
    max_scale = f32(0)
    amax_scale = f32(0)
    for ib in range(8):
        if abs(scales[ib]) > amax_scale:
            amax_scale = abs(scales[ib])
            max_scale = scales[ib]
    d = -max_scale / f32(32)
    idd = f32(1) / d if d != 0 else f32(0)
    y[2:8] = 0
    for ib in range(8):
        l = max(-32, min(31, np.int64(np.rint(idd * scales[ib]))))
        dl = d * f32(l)
        _codes(kv, xs, L, ib, f32(1) / dl if dl != 0 else f32(0))
        l += 32
        y[4 + ib // 2] |= (l & 0xF) << (4 * (ib % 2))
        y[2 + ib // 4] |= ((l >> 4) << (2 * (ib % 4))) & 0xFF
    return d


@njit(cache=True, parallel=True)
def _quantize_iq4(x, qw, weighted, super_block, ntry, d_out, out):
    """Codes and sub-block scales of every block into out (n_rows, row_bytes); the
    float32 block scale into d_out (n_rows, n_blocks) (the caller writes its f16)."""
    kv = _KV
    nb = super_block // 32
    size = 18 if nb == 1 else 136
    o_qs = 2 if nb == 1 else 8
    for r in prange(x.shape[0]):
        L = np.full(super_block, 8, np.int64)
        w = np.empty(32, np.float32)
        scales = np.empty(nb, np.float32)
        for s in range(x.shape[1] // super_block):
            xs = x[r, s * super_block:(s + 1) * super_block]
            y = out[r, s * size:(s + 1) * size]
            sigma2 = _sigma2(xs) if weighted else f32(0)
            for ib in range(nb):
                _weights(xs, qw, weighted, sigma2, s * super_block, ib, w)
                d, _ = _fit_block(kv, xs[32 * ib:32 * ib + 32], w, L[32 * ib:32 * ib + 32], ntry)
                scales[ib] = d
            if nb > 1:
                d_out[r, s] = _xs_scales(kv, xs, L, scales, y)
            else:
                d_out[r, s] = scales[0]
                if ntry > 0:
                    _codes(kv, xs, L, 0, f32(1) / scales[0] if scales[0] != 0 else f32(0))
            for i in range(nb):
                for j in range(16):
                    y[o_qs + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)


# ----------------------------------------------------------------- numpy reference
def _best_index_ref(x: np.ndarray) -> np.ndarray:
    """best_index_int8 on a float32 array: mu is the first table value above x."""
    mu = np.clip(np.searchsorted(_KV, x, side="right"), 1, 15)
    idx = np.where(x - _KV[mu - 1] < _KV[mu] - x, mu - 1, mu)
    return np.where(x <= _KV[0], 0, np.where(x >= _KV[15], 15, idx))


def _sums_ref(xb, w, idd):
    sumqx = np.zeros(xb.shape[0], f32)
    sumq2 = np.zeros(xb.shape[0], f32)
    q = _KV[_best_index_ref(idd[:, None] * xb)]
    for j in range(32):
        sumqx += w[:, j] * q[:, j] * xb[:, j]
        sumq2 += w[:, j] * q[:, j] * q[:, j]
    return sumqx, sumq2


def _fit_blocks_ref(xb, w, ntry):
    """(scales, first-pass codes) of 32-value blocks xb (n, 32)."""
    ia = np.argmax(np.abs(xb), axis=1)                      # first of the largest |x|
    mx = xb[np.arange(xb.shape[0]), ia]
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, f32(1), mx)
    idd = f32(1) / ((-mx if ntry > 0 else mx) / _KV[0])
    L = _best_index_ref(idd[:, None] * xb)
    sumqx, sumq2 = _sums_ref(xb, w, idd)
    d = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, f32(1)), f32(0))
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        sumqx, sumq2 = _sums_ref(xb, w, (f32(itry) + _KV[0]) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / np.where(better, sumq2, f32(1)), d)
        best = np.where(better, d * sumqx, best)
    return np.where(zero, f32(0), d), np.where(zero[:, None], 8, L)


def _pack_ref(L: np.ndarray) -> np.ndarray:
    """(n, 32) codes -> (n, 16) bytes: j in the low nibble, j + 16 in the high one."""
    return (L[:, :16] | (L[:, 16:] << 4)).astype(np.uint8)


def quantize_iq4_ref(x: np.ndarray, qtype, quant_weights: np.ndarray | None = None,
                     ntry: int = NTRY) -> np.ndarray:
    """numpy reference of :func:`quantize_iq4` (same arguments and result)."""
    qtype, x, qw = _check(x, qtype, quant_weights)
    n_rows, n_cols = x.shape
    sb = _SUPER[qtype]
    xb = x.reshape(-1, 32)
    if qw is None:
        w = xb * xb
    else:
        xs = x.reshape(-1, sb)
        sigma2 = np.zeros(xs.shape[0], f32)
        for j in range(sb):
            sigma2 += xs[:, j] * xs[:, j]
        sigma2 = np.repeat(sigma2 * (f32(2) / f32(sb)), sb // 32)
        w = np.tile(qw.reshape(-1, 32), (n_rows, 1)) * np.sqrt(sigma2[:, None] + xb * xb)
    d, L = _fit_blocks_ref(xb, w, ntry)
    if qtype == T.IQ4_NL:
        if ntry > 0:
            L = _best_index_ref(np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0))[:, None] * xb)
        blocks = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), _pack_ref(L)], 1)
        return blocks.reshape(n_rows, -1)
    scales = d.reshape(-1, 8)
    amax = np.abs(scales).max(1)
    max_scale = scales[np.arange(scales.shape[0]), np.argmax(np.abs(scales), 1)]
    ds = -np.where(amax > 0, max_scale, f32(0)) / f32(32)
    ids = np.where(ds != 0, f32(1) / np.where(ds != 0, ds, f32(1)), f32(0))
    ls = np.clip(np.rint(ids[:, None] * scales), -32, 31).astype(np.int64)
    dl = (ds[:, None] * ls.astype(f32)).reshape(-1)
    idl = np.where(dl != 0, f32(1) / np.where(dl != 0, dl, f32(1)), f32(0))
    L = _best_index_ref(idl[:, None] * xb)
    ls += 32
    scales_h = sum(((ls[:, k] >> 4) << (2 * k)) for k in range(8)).astype("<u2")
    scales_l = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    blocks = np.concatenate([ds.astype(np.float16).view(np.uint8).reshape(-1, 2),
                             scales_h.view(np.uint8).reshape(-1, 2), scales_l,
                             _pack_ref(L).reshape(-1, 128)], 1)
    return blocks.reshape(n_rows, -1)


# --------------------------------------------------------------------- Python API
def _check(x, qtype, quant_weights):
    qtype = T[qtype] if isinstance(qtype, str) and qtype in T.__members__ else qtype
    if qtype not in _SUPER:
        raise ValueError(f"quantize_iq4: {qtype!r} is not IQ4_NL or IQ4_XS")
    qtype = T(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % _SUPER[qtype]:
        raise ValueError(f"{qtype.name}: expected (n_rows, n_cols) with n_cols a multiple of "
                         f"{_SUPER[qtype]}, got shape {x.shape}")
    qw = None
    if quant_weights is not None:
        qw = np.ascontiguousarray(quant_weights, dtype=np.float32)
        if qw.shape != (x.shape[1],):
            raise ValueError(f"{qtype.name}: importance weights of shape {qw.shape} for {x.shape[1]} columns")
    return qtype, x, qw


def quantize_iq4(x: np.ndarray, qtype, quant_weights: np.ndarray | None = None,
                 ntry: int = NTRY) -> np.ndarray:
    """quantize_iq4_nl / quantize_iq4_xs of ggml-quants.c (what llama-quantize writes).

    x (n_rows, n_cols) float32, n_cols a multiple of 32 (IQ4_NL) or 256 (IQ4_XS);
    quant_weights (n_cols,) importances (imatrix) or None; ntry -1 gives
    quantize_row_iq4_nl_ref. Returns uint8 (n_rows, row_bytes) in the GGUF layout."""
    qtype, x, qw = _check(x, qtype, quant_weights)
    out = np.empty((x.shape[0], x.shape[1] // _SUPER[qtype] * GGML_QUANT_SIZES[qtype][1]), np.uint8)
    if out.size:
        _quantize_into(x, qtype, qw, ntry, out)
    return out


def _quantize_into(x, qtype, qw, ntry, out):
    """quantize_iq4 into out (n_rows, row_bytes) of checked arguments: the kernel, then
    the f16 block scales."""
    sb, size = _SUPER[qtype], GGML_QUANT_SIZES[qtype][1]
    n_rows, n_blocks = x.shape[0], x.shape[1] // sb
    d = np.empty((n_rows, n_blocks), np.float32)
    _quantize_iq4(x, np.zeros(1, f32) if qw is None else qw, qw is not None, sb, ntry, d, out)
    out.reshape(n_rows, n_blocks, size)[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(n_rows, n_blocks, 2)


def _plain(qtype):
    def kernel(x, out):
        _quantize_into(x, qtype, None, NTRY, out)
    return kernel


def _weighted(qtype):
    def kernel(x, qw, row_sigma2, out):      # sigma2 is the super-block's (row_sigma2 unused)
        _quantize_into(x, qtype, qw, NTRY, out)
    return kernel


IQ4_KERNELS = {t: _plain(t) for t in _SUPER}
"""kernel(x, out) per type, as kernels/quantize.py dispatches its own."""
IQ4_WEIGHTED_KERNELS = {t: _weighted(t) for t in _SUPER}
"""kernel(x, quant_weights, row_sigma2, out) per type, as kernels/quantize_weighted.py's."""
