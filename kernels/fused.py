"""Fused elementwise chains of the block: the CPU side (the separate CPU kernels, run
in sequence) and the numpy references. The GPU runs each chain as one launch
(``llamatune.kernels.cuda.fused``); on the CPU a launch costs nothing, so these are
the very kernels the forward and backward ran before, in the same order, and give
the same bits.

    rope_qk_forward(q, k, ...)            q, k = R(theta) q, R(theta) k        (in place)
    rope_qk_backward(dq, dk, ...)         dq, dk = R(-theta) dq, R(-theta) dk  (in place)
    qk_norm_rope_forward(...)             q = rope(RMSNorm(qp) per head), and k of kp (qwen3, gemma3)
    qk_norm_rope_backward(...)            dqp, dkp = dL/dqp, dL/dkp; dwq, dwk +=; dq, dk rotated back in place
    add_rmsnorm_forward(out, rstd, s, x, w, eps)   s += x; out = RMSNorm(s) w
    rmsnorm_backward_add(dx, dw, dout, x, w, rstd, scratch)   dx += dL/dx of RMSNorm(x) w; dw +=

Shapes: q, qp (B, T, NH, D), k, kp (B, T, NKV, D), per-head rstd (B*T*NH,) and
(B*T*NKV,), norm weights (D,); cos, sin as in ``rope`` ((T, n_rot//2) or per row
(B, T, n_rot//2)). Gradient rule as everywhere: dx overwritten, dw accumulated.
"""

import numpy as np

from . import rmsnorm, rope
from .rope import ROPE_NEOX, ROPE_NORM  # noqa: F401  (the modes, as rope names them)


def _rows(a):
    return a.reshape(-1, a.shape[-1])


def rope_qk_forward(q, k, cos, sin, n_rot, mode):
    """q, k (B, T, H, D) rotated in place by R(theta)."""
    rope.rope_forward(q, q, cos, sin, n_rot, mode)
    rope.rope_forward(k, k, cos, sin, n_rot, mode)


def rope_qk_backward(dq, dk, cos, sin, n_rot, mode):
    """dq, dk (B, T, H, D) rotated in place by R(-theta)."""
    rope.rope_backward(dq, dq, cos, sin, n_rot, mode)
    rope.rope_backward(dk, dk, cos, sin, n_rot, mode)


def qk_norm_rope_forward(q, rstd_q, qp, wq, k, rstd_k, kp, wk, cos, sin, eps, n_rot, mode):
    """q = rope(RMSNorm(qp) * wq per head), k = rope(RMSNorm(kp) * wk); rstd saved."""
    rmsnorm.rmsnorm_forward(_rows(q), rstd_q, _rows(qp), wq, eps)
    rmsnorm.rmsnorm_forward(_rows(k), rstd_k, _rows(kp), wk, eps)
    rope_qk_forward(q, k, cos, sin, n_rot, mode)


def _dw(dw, like):
    """dw, or a throwaway (C,) for a frozen norm weight (dw None: the GPU skips its kernel)."""
    return np.zeros(like.shape[-1], like.dtype) if dw is None else dw


def qk_norm_rope_backward(dqp, dwq, dq, qp, wq, rstd_q, dkp, dwk, dk, kp, wk, rstd_k, cos, sin, n_rot, mode):
    """dqp, dkp overwritten; dwq, dwk += (both None: not wanted); dq, dk hold R(-theta) dq,
    R(-theta) dk after."""
    if (dwq is None) != (dwk is None):
        raise ValueError("fused: dwq and dwk must both be arrays or both be None")
    rope_qk_backward(dq, dk, cos, sin, n_rot, mode)
    rmsnorm.rmsnorm_backward(_rows(dqp), _dw(dwq, qp), _rows(dq), _rows(qp), wq, rstd_q)
    rmsnorm.rmsnorm_backward(_rows(dkp), _dw(dwk, kp), _rows(dk), _rows(kp), wk, rstd_k)


def add_rmsnorm_forward(out, rstd, s, x, w, eps):
    """s (N, C) += x; out (N, C) = RMSNorm(s) * w; rstd (N,) saved."""
    s += x
    rmsnorm.rmsnorm_forward(out, rstd, s, w, eps)


def rmsnorm_backward_add(dx, dw, dout, x, w, rstd, scratch):
    """dx (N, C) += the norm's dL/dx (computed into scratch (N, C) first); dw (C,) +=, or
    None (a frozen weight)."""
    rmsnorm.rmsnorm_backward(scratch, _dw(dw, x), dout, x, w, rstd)
    dx += scratch


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the functions above, no checks


def rope_qk_forward_ref(q, k, cos, sin, n_rot, mode):
    rope.rope_forward_ref(q, q.copy(), cos, sin, n_rot, mode)
    rope.rope_forward_ref(k, k.copy(), cos, sin, n_rot, mode)


def rope_qk_backward_ref(dq, dk, cos, sin, n_rot, mode):
    rope.rope_backward_ref(dq, dq.copy(), cos, sin, n_rot, mode)
    rope.rope_backward_ref(dk, dk.copy(), cos, sin, n_rot, mode)


def qk_norm_rope_forward_ref(q, rstd_q, qp, wq, k, rstd_k, kp, wk, cos, sin, eps, n_rot, mode):
    for y, rstd, x, w in ((q, rstd_q, qp, wq), (k, rstd_k, kp, wk)):
        normed = np.empty_like(x)
        rmsnorm.rmsnorm_forward_ref(_rows(normed), rstd, _rows(x), w, eps)
        rope.rope_forward_ref(y, normed, cos, sin, n_rot, mode)


def qk_norm_rope_backward_ref(dqp, dwq, dq, qp, wq, rstd_q, dkp, dwk, dk, kp, wk, rstd_k, cos, sin, n_rot, mode):
    for dx, dw, dy, x, w, rstd in ((dqp, dwq, dq, qp, wq, rstd_q), (dkp, dwk, dk, kp, wk, rstd_k)):
        rope.rope_backward_ref(dy, dy.copy(), cos, sin, n_rot, mode)
        rmsnorm.rmsnorm_backward_ref(_rows(dx), dw, _rows(dy), _rows(x), w, rstd)


def add_rmsnorm_forward_ref(out, rstd, s, x, w, eps):
    s[:] = s + x
    rmsnorm.rmsnorm_forward_ref(out, rstd, s, w, eps)


def rmsnorm_backward_add_ref(dx, dw, dout, x, w, rstd, scratch):
    rmsnorm.rmsnorm_backward_ref(scratch, dw, dout, x, w, rstd)
    dx[:] = dx + scratch
