"""Fused elementwise chains of the block on the GPU: fewer, larger launches (float32;
CPU twin and numpy references: ``llamatune.kernels.fused``, which runs the same
chains as the separate CPU kernels).

Each launch costs numba-cuda about 75 us of Python, so the chains the forward and
backward run back to back become one kernel:

* ``rope_qk_forward`` / ``rope_qk_backward``: rope of q and of k in one launch
  (two before). Same thread layout as ``rope._rope_kernel``, over q's rows then k's.
* ``qk_norm_rope_forward``: the per-head RMSNorm of q and of k (qwen3, gemma3),
  each followed by its rope, in one launch (four before): one block per head row
  normalises the row, synchronises, and rotates the pairs it just wrote.
* ``qk_norm_rope_backward``: rope's backward, then the per-head norms' dx, in one
  launch, and both norm weights' dw in a second (six before): the row kernel
  rotates dq/dk back in place (they hold R(-theta) dy afterwards; the dw kernel
  reads them), then computes dx as ``rmsnorm._rmsnorm_dx_kernel``.
* ``add_rmsnorm_forward``: the residual add and the RMSNorm that follows it
  (s += x; out = RMSNorm(s) w) in one launch (two before).
* ``rmsnorm_backward_add``: the norm's dx added straight into the residual's
  gradient (dx += ...) by the dx kernel, instead of written to a scratch and added
  by a second launch; dw as ``rmsnorm``'s dw kernel.

The arithmetic of every element is that of the separate kernels (float32 products,
float64 row sums in the same block tree order), so results agree with them to the
bit where the order of the block reduction is the same, and with the CPU to rounding.
"""
from __future__ import annotations

import numpy as np

from ..rope import table_shape
from .rmsnorm import _rmsnorm_dw_kernel, norm_dw_column, norm_dx_row, norm_row, sum_squares
from .rope import rotate_pair
from ._common import MAX_THREADS, cdiv, check, check_ndim, cuda, float64, row_threads

ROPE_NORM = 0
ROPE_NEOX = 2
_THREADS = 128
_DW_THREADS = 128

__all__ = ["rope_qk_forward", "rope_qk_backward", "qk_norm_rope_forward", "qk_norm_rope_backward",
           "add_rmsnorm_forward", "rmsnorm_backward_add"]


# ------------------------------------------------------------------ rope of q and k
@cuda.jit(device=True)
def _token(row, x):
    # (b, t, h) of head row `row` of x (B, T, H, D), rows in (b, t, h) order
    bt = row // x.shape[2]
    return bt // x.shape[1], bt % x.shape[1], row % x.shape[2]


@cuda.jit
def _rope_qk_kernel(q, k, cos, sin, n_rot, neox, inverse):
    # q (B, T, NH, D), k (B, T, NKV, D) rotated in place; one thread per pair of q, then of k
    B, T, NH, D = q.shape
    NKV = k.shape[2]
    half = n_rot // 2
    idx = cuda.grid(1)
    nq = B * T * NH * half
    if idx >= nq + B * T * NKV * half:
        return
    a = q
    if idx >= nq:
        a = k
        idx -= nq
    j = idx % half
    row = idx // half
    b, t, h = _token(row, a)
    rotate_pair(a[b, t, h], a[b, t, h], cos, sin, b, t, j, n_rot, neox, inverse)


def _tables(x_shape, cos, sin, n_rot):
    shape = table_shape(x_shape, len(getattr(cos, "shape", ())), n_rot)
    check("fused", "cos", cos, shape, np.float32)
    check("fused", "sin", sin, shape, np.float32)
    return (cos.reshape(1, *shape), sin.reshape(1, *shape)) if len(shape) == 2 else (cos, sin)


def _check_qk(qn, q, kn, k, n_rot, mode):
    B, T, NH, D = check_ndim("fused", qn, q, 4, np.float32)
    check("fused", qn, q, (B, T, NH, D), np.float32)
    NKV = check_ndim("fused", kn, k, 4, np.float32)[2]
    check("fused", kn, k, (B, T, NKV, D), np.float32)
    if n_rot <= 0 or n_rot % 2 or n_rot > D:
        raise ValueError(f"fused: n_rot must be even, > 0 and <= head size {D}, got {n_rot}")
    if mode not in (ROPE_NORM, ROPE_NEOX):
        raise ValueError(f"fused: mode must be ROPE_NORM (0) or ROPE_NEOX (2), got {mode}")
    return B, T, NH, NKV, D


def _rope_qk(qn, q, kn, k, cos, sin, n_rot, mode, inverse):
    B, T, NH, NKV, D = _check_qk(qn, q, kn, k, n_rot, mode)
    cos, sin = _tables(q.shape, cos, sin, n_rot)
    n = B * T * (NH + NKV) * (n_rot // 2)
    if n:
        _rope_qk_kernel[cdiv(n, _THREADS), _THREADS](q, k, cos, sin, np.int64(n_rot), mode == ROPE_NEOX,
                                                     inverse)


def rope_qk_forward(q, k, cos, sin, n_rot, mode) -> None:
    """q (B, T, NH, D), k (B, T, NKV, D) = R(theta) q, R(theta) k, in place, in one launch;
    cos, sin (T, n_rot//2) or (B, T, n_rot//2) as in rope.rope_forward."""
    _rope_qk("q", q, "k", k, cos, sin, n_rot, mode, False)


def rope_qk_backward(dq, dk, cos, sin, n_rot, mode) -> None:
    """dq, dk = R(-theta) dq, R(-theta) dk, in place, in one launch."""
    _rope_qk("dq", dq, "dk", dk, cos, sin, n_rot, mode, True)


# ------------------------------------------------------------------ per-head norm, then rope
@cuda.jit(device=True)
def _norm_rope_row(buf, y, rstd, x, w, row, cos, sin, eps, n_rot, neox):
    # head row `row` of x (B, T, H, D): y = rope(x * r * w), r = rstd[row] saved; y may not alias x
    b, t, h = _token(row, x)
    r = norm_row(buf, y[b, t, h], x[b, t, h], w, sum_squares(x[b, t, h]), eps)
    if cuda.threadIdx.x == 0:
        rstd[row] = r
    cuda.syncthreads()                       # the row is normed; pairs cross threads
    for j in range(cuda.threadIdx.x, n_rot // 2, cuda.blockDim.x):
        rotate_pair(y[b, t, h], y[b, t, h], cos, sin, b, t, j, n_rot, neox, False)


@cuda.jit
def _qk_norm_rope_kernel(q, rstd_q, qp, wq, k, rstd_k, kp, wk, cos, sin, eps, n_rot, neox):
    # grid NQ + NK head rows (q's, then k's), block row_threads(D)
    # (a call per side: choosing the arrays instead made every access a generic-address one)
    buf = cuda.shared.array(MAX_THREADS, float64)
    row = cuda.blockIdx.x
    NQ = rstd_q.shape[0]
    if row < NQ:
        _norm_rope_row(buf, q, rstd_q, qp, wq, row, cos, sin, eps, n_rot, neox)
    else:
        _norm_rope_row(buf, k, rstd_k, kp, wk, row - NQ, cos, sin, eps, n_rot, neox)


@cuda.jit(device=True)
def _norm_rope_dx_row(buf, dx, dy, x, w, rstd, row, cos, sin, n_rot, neox):
    # head row `row` of dy (B, T, H, D) rotated back in place, then dx = the norm's dx of the row
    b, t, h = _token(row, x)
    for j in range(cuda.threadIdx.x, n_rot // 2, cuda.blockDim.x):
        rotate_pair(dy[b, t, h], dy[b, t, h], cos, sin, b, t, j, n_rot, neox, True)
    cuda.syncthreads()
    norm_dx_row(buf, dx[b, t, h], dy[b, t, h], x[b, t, h], w, rstd[row], False)


@cuda.jit
def _qk_norm_rope_dx_kernel(dqp, dq, qp, wq, rstd_q, dkp, dk, kp, wk, rstd_k, cos, sin, n_rot, neox):
    # grid NQ + NK head rows (q's, then k's), block row_threads(D)
    buf = cuda.shared.array(MAX_THREADS, float64)
    row = cuda.blockIdx.x
    NQ = rstd_q.shape[0]
    if row < NQ:
        _norm_rope_dx_row(buf, dqp, dq, qp, wq, rstd_q, row, cos, sin, n_rot, neox)
    else:
        _norm_rope_dx_row(buf, dkp, dk, kp, wk, rstd_k, row - NQ, cos, sin, n_rot, neox)


@cuda.jit
def _qk_norm_dw_kernel(dwq, dwk, dq, qp, rstd_q, dk, kp, rstd_k):
    # thread c < D: dwq[c] += sum over q's rows; D <= c < 2D: dwk[c - D] over k's rows
    # dq (NQ, D), qp (NQ, D), dk, kp (NK, D): 2-D views of the head rows
    c = cuda.grid(1)
    D = qp.shape[1]
    if c < D:
        norm_dw_column(dwq, dq, qp, rstd_q, c)
    elif c < 2 * D:
        norm_dw_column(dwk, dk, kp, rstd_k, c - D)


def _check_norm_rope(q_side: dict, k_side: dict, qp, kp, cos, sin, n_rot, mode):
    """q_side / k_side: name -> array of q's heads / k's heads, each (B, T, H, D), or
    (B*T*H,) for the rstd, or (D,) for the weights and their gradients."""
    B, T, NH, NKV, D = _check_qk("qp", qp, "kp", kp, n_rot, mode)
    for side, H in ((q_side, NH), (k_side, NKV)):
        for name, a in side.items():
            vector = len(getattr(a, "shape", ())) == 1
            shape = (B * T * H,) if name.startswith("rstd") else (D,) if vector else (B, T, H, D)
            check("fused", name, a, shape, np.float32)
    cos, sin = _tables(qp.shape, cos, sin, n_rot)
    return B * T * NH, B * T * NKV, D, cos, sin


def qk_norm_rope_forward(q, rstd_q, qp, wq, k, rstd_k, kp, wk, cos, sin, eps, n_rot, mode) -> None:
    """q (B, T, NH, D) = rope(RMSNorm(qp) per head, weight wq (D,)), rstd_q (B*T*NH,)
    saved; k, rstd_k the same of kp (B, T, NKV, D) with wk; one launch. q may not be qp."""
    NQ, NK, D, cos, sin = _check_norm_rope(dict(q=q, rstd_q=rstd_q, wq=wq), dict(k=k, rstd_k=rstd_k, wk=wk), qp, kp,
                                           cos, sin, n_rot, mode)
    if not eps > 0:
        raise ValueError(f"fused: eps must be > 0, got {eps}")
    if NQ + NK and D:
        _qk_norm_rope_kernel[NQ + NK, row_threads(D)](q, rstd_q, qp, wq, k, rstd_k, kp, wk, cos, sin,
                                                      np.float32(eps), np.int64(n_rot), mode == ROPE_NEOX)


def qk_norm_rope_backward(dqp, dwq, dq, qp, wq, rstd_q, dkp, dwk, dk, kp, wk, rstd_k, cos, sin, n_rot,
                          mode) -> None:
    """The backward of qk_norm_rope_forward: dqp, dkp = dL/dqp, dL/dkp (overwritten),
    dwq, dwk (D,) += dL/dwq, dL/dwk (both None: frozen weights, no launch for them),
    from dq, dk = dL/dq, dL/dk, which are rotated back in place (R(-theta) dq
    afterwards). Two launches (one without dw)."""
    if (dwq is None) != (dwk is None):
        raise ValueError("fused: dwq and dwk must both be arrays or both be None")
    NQ, NK, D, cos, sin = _check_norm_rope(
        dict(dqp=dqp, dq=dq, wq=wq, rstd_q=rstd_q, **({} if dwq is None else dict(dwq=dwq))),
        dict(dkp=dkp, dk=dk, wk=wk, rstd_k=rstd_k, **({} if dwk is None else dict(dwk=dwk))),
        qp, kp, cos, sin, n_rot, mode)
    if not (NQ + NK and D):
        return
    _qk_norm_rope_dx_kernel[NQ + NK, row_threads(D)](dqp, dq, qp, wq, rstd_q, dkp, dk, kp, wk, rstd_k, cos, sin,
                                                     np.int64(n_rot), mode == ROPE_NEOX)
    if dwq is not None:
        _qk_norm_dw_kernel[cdiv(2 * D, _DW_THREADS), _DW_THREADS](
            dwq, dwk, dq.reshape(NQ, D), qp.reshape(NQ, D), rstd_q, dk.reshape(NK, D), kp.reshape(NK, D), rstd_k)


# ------------------------------------------------------------------ residual add, then RMSNorm
@cuda.jit
def _add_rmsnorm_kernel(out, rstd, s, x, w, eps):
    # grid N, block row_threads(C): s += x, then out = s * rstd * w (as rmsnorm's forward)
    n = cuda.blockIdx.x
    buf = cuda.shared.array(MAX_THREADS, float64)
    ss = 0.0
    for c in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        v = s[n, c] + x[n, c]
        s[n, c] = v
        ss += v * v
    r = norm_row(buf, out[n], s[n], w, ss, eps)   # each thread rereads the s[n, c] it wrote
    if cuda.threadIdx.x == 0:
        rstd[n] = r


def add_rmsnorm_forward(out, rstd, s, x, w, eps) -> None:
    """s (N, C) += x (the residual add); out (N, C) = RMSNorm(s) * w, rstd (N,) saved;
    w (C,). One launch; out may not be s or x."""
    N, C = check_ndim("fused", "s", s, 2, np.float32)
    for name, a, shape in (("out", out, (N, C)), ("rstd", rstd, (N,)), ("s", s, (N, C)), ("x", x, (N, C)),
                           ("w", w, (C,))):
        check("fused", name, a, shape, np.float32)
    if not eps > 0:
        raise ValueError(f"fused: eps must be > 0, got {eps}")
    if N and C:
        _add_rmsnorm_kernel[N, row_threads(C)](out, rstd, s, x, w, np.float32(eps))


@cuda.jit
def _rmsnorm_dx_add_kernel(dx, dout, x, w, rstd):
    # grid N, block row_threads(C): dx += the norm's dx (rmsnorm._rmsnorm_dx_kernel's maths)
    n = cuda.blockIdx.x
    buf = cuda.shared.array(MAX_THREADS, float64)
    norm_dx_row(buf, dx[n], dout[n], x[n], w, rstd[n], True)


def rmsnorm_backward_add(dx, dw, dout, x, w, rstd, scratch) -> None:
    """dx (N, C) += dL/dx of out = RMSNorm(x) w (a residual's gradient gathering the
    norm's share); dw (C,) += dL/dw, or None for a frozen weight (no launch for it);
    dout, x (N, C); rstd (N,). Two launches with dw, one without; scratch (N, C) unused
    (the CPU's room for dL/dx). dx may not alias dout or x."""
    N, C = check_ndim("fused", "x", x, 2, np.float32)
    for name, a, shape in (("dx", dx, (N, C)), ("dw", dw, (C,)), ("dout", dout, (N, C)), ("x", x, (N, C)),
                           ("w", w, (C,)), ("rstd", rstd, (N,))):
        if a is not None or name != "dw":
            check("fused", name, a, shape, np.float32)
    if N and C:
        _rmsnorm_dx_add_kernel[N, row_threads(C)](dx, dout, x, w, rstd)
        if dw is not None:
            _rmsnorm_dw_kernel[cdiv(C, _DW_THREADS), _DW_THREADS](dw, dout, x, rstd)
