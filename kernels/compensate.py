"""Error-compensating quantization of one weight matrix (GPTQ / OBQ, in the type's blocks).

For W (n_out, n_in) and the second moment of its inputs H = E[x x^T] (n_in, n_in),
the error that matters is the output error  E||(W - Q) x||^2 = tr((W-Q) H (W-Q)^T).
Columns are quantized in order, one group of the type's block (32 values; 256 for
the K-quants) at a time, by the type's own importance-weighted quantizer
(quantize_weighted.py) on the current, error-updated weights; each group's rounding
error is then carried onto the columns not yet quantized, as GPTQ (Frantar et al.
2022, gptq.py `fasterquant`) does column by column:

    delta_R = E_G · H_GR · H_RR^{-1}                  (the best update of the rest R
                                                       for fixed errors E_G = W_G - Q_G)
            = E_G · U_GG^{-1} · U_GR                  U upper, U^T U = H^{-1} (damped)

The second form costs one (n_out, g) x (g, n_rest) product per group; updates are
applied by halves (a blocked form of GPTQ's "lazy batch"). The loss a
group adds after that compensation is ||E_G U_GG^{-1}||^2 per row; a row's group is
written with whichever of two codes costs less: the new one, or, when given, the
base tensor's own block (same type) -- so an unchanged weight keeps its bytes and a
merge never moves a block away from a better code it already had.

`quantize_compensated_ref` is the numpy reference (the first form, solved directly,
no Cholesky); tests compare the two.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from .dequant import dequantize
from .quantize_weighted import quantize_weighted

__all__ = ["DAMP", "inverse_cholesky", "quantize_compensated", "quantize_compensated_ref"]

DAMP = 0.01        # GPTQ's percdamp: H + DAMP * mean(diag H) * I
LEAF = 128         # spans of at most this many columns are compensated group by group
_LEGACY = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0})


def damped(h: np.ndarray, damp: float = DAMP, mean: float | None = None) -> np.ndarray:
    """H (float64 copy) with dead inputs (H_ii = 0) set to 1 and damp * mean(diag) added
    to the diagonal, as GPTQ does before factoring (`mean`: that of the whole H, when
    h is one diagonal block of it)."""
    h = np.array(h, dtype=np.float64)
    d = np.diagonal(h).copy()
    dead = d <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    if mean is None:
        mean = float(np.mean(np.diagonal(h)))
    np.fill_diagonal(h, np.diagonal(h) + damp * max(mean, 1e-30))
    return h


def _mean_diagonal(blocks: list[np.ndarray]) -> float:
    """mean(diag) of the block-diagonal matrix of `blocks` after damped()'s dead inputs -> 1."""
    d = np.concatenate([np.diagonal(b) for b in blocks]).astype(np.float64)
    return float(np.mean(np.where(d <= 0, 1.0, d)))


def lower_cholesky_inverse(a: np.ndarray) -> np.ndarray:
    """L^{-1} for the Cholesky factor L of a symmetric positive definite a (a = L L^T),
    by halves, every step a matrix product at GEMM rate (numpy's potrf ran at 26
    GFLOP/s on a 4864 input, its GEMM at 168), down to blocks of at most 64 (a 1024
    block: 16 ms, against 26 with blocks of 256, whose LAPACK inverse is slower):
        L11^{-1} of a11;  L21 = a21 L11^{-T};  L22^{-1} of a22 - L21 L21^T;
        (L^{-1})21 = -L22^{-1} L21 L11^{-1}                  (4/3 n^3 flops in all)."""
    n = a.shape[0]
    if n <= 64:
        return np.tril(np.linalg.inv(np.linalg.cholesky(a)))
    k = n // 2
    out = np.empty_like(a)
    out[:k, k:] = 0
    out[:k, :k] = i11 = lower_cholesky_inverse(a[:k, :k])
    l21 = a[k:, :k] @ i11.T
    out[k:, k:] = i22 = lower_cholesky_inverse(a[k:, k:] - l21 @ l21.T)
    out[k:, :k] = -(i22 @ (l21 @ i11))
    return out


def lower_inverse(l: np.ndarray) -> np.ndarray:
    """l^{-1} of a lower triangular l, by halves (n^3/3 flops, GEMMs): a 256 block of
    float32 in 0.5 ms, against 2.7 ms for LAPACK's general inverse."""
    n = l.shape[0]
    if n <= 32:
        return np.tril(np.linalg.inv(l))
    k = n // 2
    out = np.zeros_like(l)
    out[:k, :k] = i11 = lower_inverse(l[:k, :k])
    out[k:, k:] = i22 = lower_inverse(l[k:, k:])
    out[k:, :k] = -(i22 @ (l[k:, :k] @ i11))
    return out


def inverse_cholesky(h, damp: float = DAMP, dtype=np.float64):
    """U (n, n) upper triangular with U^T U = damped(H)^{-1}, in `dtype` (float64, or
    float32 as GPTQ factors: twice the rate, for export's large inputs).
    With J the reversal, J H J = M M^T (M lower) gives H^{-1} = (J M^{-T} J)(J M^{-1} J),
    so U = J M^{-1} J (lower_cholesky_inverse; no explicit H^{-1}).
    h may be a list of the diagonal blocks of a block-diagonal H: then the list of
    their U (damped by the whole H's mean diagonal, as damped(H) would)."""
    if isinstance(h, list):
        mean = _mean_diagonal(h)
        return [_inverse_cholesky(damped(b, damp, mean).astype(dtype, copy=False), damp) for b in h]
    return _inverse_cholesky(damped(h, damp).astype(dtype, copy=False), damp)


def _inverse_cholesky(hd: np.ndarray, damp: float) -> np.ndarray:
    try:
        m_inv = lower_cholesky_inverse(np.ascontiguousarray(hd[::-1, ::-1]))
    except np.linalg.LinAlgError as e:
        raise ValueError(f"input second moment is not positive definite after damping {damp}") from e
    return np.ascontiguousarray(m_inv[::-1, ::-1])


def _group_codes(wg, qtype, qw, sig, base_g, cost, base_w=None):
    """Quantize one column group, choose per row between the new codes and base_g by
    cost(error) (n_out,), and return (codes, error). base_w: base_g dequantized, when
    the caller has it (one call for the whole matrix, not one per group)."""
    q = quantize_weighted(wg.astype(np.float32, copy=False), qtype, qw, sig)
    e = wg - dequantize(q, qtype, wg.shape[1])
    if base_g is not None:
        e_base = wg - (dequantize(base_g, qtype, wg.shape[1]) if base_w is None else base_w)
        keep = cost(e_base) <= cost(e)
        q[keep] = base_g[keep]
        e[keep] = e_base[keep]
    return q, e


def _check(w, qtype, quant_weights, base):
    qtype = T(qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_out, n_in = w.shape
    if n_in % block:
        raise ValueError(f"{qtype.name}: row length {n_in} is not a multiple of {block}")
    if base is not None and base.shape != (n_out, n_in // block * type_size):
        raise ValueError(f"base codes of shape {base.shape} for a {qtype.name} ({n_out}, {n_in}) matrix")
    qw = None if quant_weights is None else np.asarray(quant_weights, np.float32)
    # legacy types take sigma2 over the whole row (quantize_row_*_impl); keep the target's
    sig = np.mean(np.square(w, dtype=np.float32), axis=1, dtype=np.float32) if qtype in _LEGACY else None
    return qtype, block, type_size, qw, sig


def quantize_compensated(w: np.ndarray, qtype, u: np.ndarray, quant_weights: np.ndarray | None = None,
                         base: np.ndarray | None = None, leaf: int = LEAF, overwrite: bool = False) -> np.ndarray:
    """GPTQ-style quantization of w (n_out, n_in) to `qtype` bytes (n_out, row_bytes).

    u: inverse_cholesky(H) (n_in, n_in); or the list of its diagonal blocks for a
    block-diagonal H (each a multiple of the type's group; no update crosses a block);
    or its diagonal (n_in,) for a diagonal H (no cross-column updates: diag(H)^-1/2,
    or ones when nothing is known). The updates run in u's precision (float32 u:
    float32 updates, as GPTQ). quant_weights (n_in,): the importances passed to the
    type's quantizer (None: its plain quantizer); base: the base tensor's codes of the
    same type (n_out, row_bytes), kept per row and block where they cost no more.
    overwrite: w (of u's float type) may be used as the work array (its values are lost)."""
    qtype, g, ts, qw, sig = _check(w, qtype, quant_weights, base)
    n_out, n_in = w.shape
    blocks = u if isinstance(u, list) else [u]
    dtype = np.float32 if blocks[0].dtype == np.float32 else np.float64
    W = np.asarray(w, dtype) if overwrite else np.array(w, dtype)
    out = np.empty((n_out, n_in // g * ts), np.uint8)
    if sum(b.shape[0] for b in blocks) != n_in or any(b.shape[0] % g for b in blocks):
        raise ValueError(f"factor blocks {[b.shape for b in blocks]} do not tile {n_in} inputs in groups of {g}")

    base_w = None if base is None else dequantize(base, qtype, n_in)      # the base's weights, once

    def group(c0, c1, wg, cost):                      # codes of columns c0:c1 into out; their error
        base_g = None if base is None else base[:, c0 // g * ts:c1 // g * ts]
        q, e = _group_codes(wg, qtype, None if qw is None else qw[c0:c1], sig, base_g, cost,
                            None if base is None else base_w[:, c0:c1])
        out[:, c0 // g * ts:c1 // g * ts] = q
        return e
    if blocks[0].ndim == 1:                           # diagonal H: groups are independent
        for c0 in range(0, n_in, g):
            uinv = 1 / u[c0:c0 + g]
            group(c0, c0 + g, W[:, c0:c0 + g], lambda e, uinv=uinv: np.sum((e * uinv) ** 2, axis=1))
        return out
    c = 0
    for ub in blocks:                                 # block-diagonal H: no update crosses a block
        _compensate(W[:, c:c + ub.shape[0]], ub, g, max(g, leaf // g * g),
                    lambda c0, c1, wg, cost, c=c: group(c + c0, c + c1, wg, cost))
        c += ub.shape[0]
    return out


def _compensate(W: np.ndarray, u: np.ndarray, g: int, leaf: int, group) -> None:
    """GPTQ over the columns of W (a view, updated in place) with factor u, in groups of
    g; group(c0, c1, wg, cost) writes the codes and returns the error.

    By halves: the left half is compensated, its errors update the right half in one
    product (es_L U_LR), then the right half; spans of at most `leaf` columns go group
    by group. The flops are GPTQ's, but most run as square GEMMs rather than the
    (n_out, window) x (window, g) products of a lazy window. A group's columns of W are
    not read again once quantized: they then hold es = E_G U_GG^{-1}, which the updates
    of later columns read (no array of its own: a fresh one per matrix cost as much in
    page faults as the products)."""
    _span(W, u, g, leaf, group, _group_inverses(u, g), 0, W.shape[1])


def _span(W, u, g, leaf, group, uinv, a, b) -> None:
    """Columns a:b of _compensate (a function, not a closure: a recursive closure is a
    reference cycle that keeps W alive until the cyclic collector runs)."""
    if b - a > leaf:
        m = a + (b - a) // g // 2 * g
        _span(W, u, g, leaf, group, uinv, a, m)
        W[:, m:b] -= W[:, a:m] @ u[a:m, m:b]           # W[:, a:m] holds es by now
        _span(W, u, g, leaf, group, uinv, m, b)
        return
    for c0 in range(a, b, g):
        c1 = c0 + g
        wg = W[:, c0:c1] - W[:, a:c0] @ u[a:c0, c0:c1]
        ui = uinv[c0 // g]                            # U_GG^{-1}, upper triangular

        def cost(e, ui=ui):
            z = e @ ui
            return np.einsum("ij,ij->i", z, z)
        W[:, c0:c1] = group(c0, c1, wg, cost) @ ui    # es of the group, in its own columns


def _group_inverses(u: np.ndarray, g: int) -> list[np.ndarray]:
    """U_GG^{-1} of each g-column group (upper triangular): LAPACK's inverse of all of
    them in one call for small groups, lower_inverse's halves for larger ones."""
    n = u.shape[0] // g
    if g > 32:
        return [lower_inverse(u[c:c + g, c:c + g].T).T for c in range(0, n * g, g)]
    s0, s1 = u.strides
    diag_t = np.lib.stride_tricks.as_strided(u, (n, g, g), (g * (s0 + s1), s1, s0))    # U_GG^T, stacked
    return list(np.tril(np.linalg.inv(diag_t)).transpose(0, 2, 1))


def quantize_compensated_ref(w: np.ndarray, qtype, h: np.ndarray, quant_weights: np.ndarray | None = None,
                             base: np.ndarray | None = None, damp: float = DAMP) -> np.ndarray:
    """Reference of quantize_compensated: group by group, W_R += E_G H_GR H_RR^{-1}
    on the damped H, cost of a group error E_G S E_G^T with S = H_GG - H_GR H_RR^{-1} H_RG."""
    qtype, g, ts, qw, sig = _check(w, qtype, quant_weights, base)
    n_out, n_in = w.shape
    hd = damped(h, damp)
    W = np.array(w, dtype=np.float64)
    out = np.empty((n_out, n_in // g * ts), np.uint8)
    for c0 in range(0, n_in, g):
        c1 = c0 + g
        G, R = slice(c0, c1), slice(c1, n_in)
        h_gr = hd[G, R]
        h_rr_inv_h_rg = np.linalg.solve(hd[R, R], h_gr.T) if c1 < n_in else np.zeros((0, g))
        s = hd[G, G] - h_gr @ h_rr_inv_h_rg
        base_g = None if base is None else base[:, c0 // g * ts:c1 // g * ts]
        q, e = _group_codes(W[:, G], qtype, None if qw is None else qw[G], sig, base_g,
                            lambda e: np.einsum("ij,ij->i", e @ s, e))
        out[:, c0 // g * ts:c1 // g * ts] = q
        if c1 < n_in:
            W[:, R] += e @ h_rr_inv_h_rg.T
    return out
