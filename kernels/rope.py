"""Rotary position embedding (RoPE), forward and backward (numba CPU kernels + numpy refs).

Mirrors llama.cpp's `ggml_rope` as computed by `ggml_compute_forward_rope_f32`
(ggml-cpu ops.cpp), for linear frequency scaling only (ext_factor 0, no YaRN):

* `rope_cache` is `ggml_rope_cache_init` in float32: theta_scale = powf(freq_base,
  -2.0f/n_rot); for each position p, theta starts at (float)p and is multiplied by
  theta_scale after each pair; the angle of pair i is freq_scale * (theta / ff[i])
  (ff = Llama-3.1 `rope_freqs`, else 1) and cos/sin are cosf/sinf of it.
* ROPE_NORM (mode 0) rotates adjacent pairs (x[2i], x[2i+1]); ROPE_NEOX (mode 2)
  rotates (x[i], x[i + n_rot/2]). Dimensions >= n_rot pass through unchanged.
* The backward is ggml's ROPE_BACK: the same rotation by -theta (sin negated),
  since R(theta) is orthogonal, dx = R(theta)^T dout = R(-theta) dout.
* Positions: cos/sin tables of shape (T, n_rot//2) rotate every row the same way
  (positions 0..T-1, or n_past.. in inference); tables of shape (B, T, n_rot//2)
  give each token its own angles, for packed rows whose positions restart at 0
  with each sample (llama.cpp takes a position per token, `ggml_rope`'s `b`).
  `rope_tables` gathers them from one cache of positions 0..max.

Both rotations work in place (out may be x, dx may be dout).
"""

import numpy as np
from numba import njit, prange

from ._checks import check_array
from .scalar import rotate

ROPE_NORM = 0
ROPE_NEOX = 2


@njit(cache=True)
def _rope_cache_kernel(cos, sin, positions, n_rot, freq_base, freq_scale, freq_factors):
    # cos, sin (T, n_rot//2) float32; positions (T,) int64; freq_factors (n_rot//2,)
    # float32; freq_base, freq_scale float32. Every operation below is float32.
    theta_scale = freq_base ** (np.float32(-2.0) / np.float32(n_rot))  # powf
    T, n_pairs = cos.shape
    for t in range(T):
        theta = np.float32(positions[t])  # theta_base = p
        for i in range(n_pairs):
            angle = freq_scale * (theta / freq_factors[i])  # rope_yarn, ext_factor 0
            cos[t, i] = np.cos(angle)
            sin[t, i] = np.sin(angle)
            theta = theta * theta_scale


@njit(cache=True, parallel=True)
def _rope_kernel(out, x, cos, sin, n_rot, neox, inverse):
    # out, x (B, T, H, D), may alias; cos, sin (1 or B, T, n_rot//2): one table for
    # all rows, or one per row; inverse=True rotates by -theta (the backward).
    # The pair layout and the sign are chosen outside the pair loops, which LLVM
    # then vectorizes (sin * -1 is exactly -sin).
    B, T, H, D = x.shape
    half = n_rot // 2
    per_row = cos.shape[0] > 1
    sg = np.float32(-1.0) if inverse else np.float32(1.0)
    for bt in prange(B * T):
        b = bt // T
        t = bt % T
        cb = b if per_row else 0
        cs, sn = cos[cb, t], sin[cb, t]
        for h in range(H):
            xr, orow = x[b, t, h], out[b, t, h]
            if neox:  # pairs (i, i + half)
                for i in range(half):
                    c, s = cs[i], sn[i] * sg
                    orow[i], orow[i + half] = rotate(xr[i], xr[i + half], c, s)  # both read first
            else:  # adjacent pairs (2i, 2i + 1)
                for i in range(half):
                    c, s = cs[i], sn[i] * sg
                    orow[2 * i], orow[2 * i + 1] = rotate(xr[2 * i], xr[2 * i + 1], c, s)
            for d in range(n_rot, D):  # pass-through dims (a no-op when in place)
                orow[d] = xr[d]


def _check(name, a, shape, dtype):
    check_array("rope", name, a, shape, dtype)


def _check_n_rot(n_rot, D=None):
    if n_rot <= 0 or n_rot % 2 or (D is not None and n_rot > D):
        raise ValueError(f"rope: n_rot must be even, > 0 and <= head size {D}, got {n_rot}")


def rope_cache(cos, sin, positions, n_rot, freq_base, freq_scale, freq_factors):
    """Fill cos, sin (T, n_rot//2) float32 for positions (T,) int64.

    freq_factors: None or float32 (n_rot//2,) (Llama-3.1 rope_freqs, theta_i /= ff_i).
    freq_scale is the linear scale (1 / rope.scale_linear), 1.0 for none.
    """
    _check_n_rot(n_rot)
    if not (isinstance(positions, np.ndarray) and positions.ndim == 1):
        raise ValueError("rope: positions must be a 1-D int64 array (T,)")
    shape = (positions.shape[0], n_rot // 2)
    _check("positions", positions, shape[:1], np.int64)
    _check("cos", cos, shape, np.float32)
    _check("sin", sin, shape, np.float32)
    if freq_factors is None:
        freq_factors = np.ones(shape[1], np.float32)  # theta / 1.0f == theta exactly
    _check("freq_factors", freq_factors, shape[1:], np.float32)
    _rope_cache_kernel(cos, sin, positions, n_rot, np.float32(freq_base),
                       np.float32(freq_scale), freq_factors)


def table_shape(x_shape, cos_ndim, n_rot):
    """The shape cos/sin must have for x (B, T, H, D): (T, n_rot//2) when 2-D, else
    (B, T, n_rot//2) (one table per row). Shared with the CUDA kernels."""
    B, T = x_shape[:2]
    return (T, n_rot // 2) if cos_ndim == 2 else (B, T, n_rot // 2)


def _check_rope(out_name, out, x_name, x, cos, sin, n_rot, mode):
    if not isinstance(x, np.ndarray) or x.ndim != 4 or x.dtype not in (np.float32, np.float64):
        raise ValueError(f"rope: {x_name} must be a 4-D float32 or float64 array (B, T, H, D)")
    B, T, H, D = x.shape
    _check_n_rot(n_rot, D)
    if mode not in (ROPE_NORM, ROPE_NEOX):
        raise ValueError(f"rope: mode must be ROPE_NORM (0) or ROPE_NEOX (2), got {mode}")
    _check(x_name, x, (B, T, H, D), x.dtype)
    _check(out_name, out, (B, T, H, D), x.dtype)
    shape = table_shape(x.shape, getattr(cos, "ndim", 0), n_rot)
    _check("cos", cos, shape, x.dtype)
    _check("sin", sin, shape, x.dtype)
    return (cos, sin) if cos.ndim == 3 else (cos[None], sin[None])


def rope_forward(out, x, cos, sin, n_rot, mode):
    """out (B, T, H, D) = R(theta) x; x (B, T, H, D) (out may be x);
    cos, sin (T, n_rot//2), or (B, T, n_rot//2) for per-token positions."""
    cos, sin = _check_rope("out", out, "x", x, cos, sin, n_rot, mode)
    _rope_kernel(out, x, cos, sin, n_rot, mode == ROPE_NEOX, False)


def rope_backward(dx, dout, cos, sin, n_rot, mode):
    """dx (B, T, H, D) = R(-theta) dout (overwritten; dx may be dout); cos, sin as
    in rope_forward."""
    cos, sin = _check_rope("dx", dx, "dout", dout, cos, sin, n_rot, mode)
    _rope_kernel(dx, dout, cos, sin, n_rot, mode == ROPE_NEOX, True)


def rope_tables(cos, sin, positions):
    """Per-token tables (B, T, n_rot//2) for positions (B, T) int64 >= 0, gathered
    from cos, sin (P, n_rot//2) = rope_cache of positions 0..P-1 (P > every position):
    the very same float32 angles as rope_cache of those positions."""
    if not (isinstance(positions, np.ndarray) and positions.ndim == 2
            and positions.dtype == np.int64):
        raise ValueError("rope: positions must be a 2-D int64 array (B, T)")
    if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise ValueError(f"rope: positions must lie in [0, {cos.shape[0]}), got "
                         f"[{positions.min()}, {positions.max()}]")
    return cos[positions], sin[positions]


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks


def rope_cache_ref(cos, sin, positions, n_rot, freq_base, freq_scale, freq_factors):
    f32 = np.float32
    ff = np.ones(n_rot // 2, f32) if freq_factors is None else freq_factors
    theta_scale = f32(freq_base) ** (f32(-2.0) / f32(n_rot))
    theta = positions.astype(f32)  # all positions at once, pairs in sequence
    for i in range(n_rot // 2):
        angle = f32(freq_scale) * (theta / ff[i])
        cos[:, i] = np.cos(angle)
        sin[:, i] = np.sin(angle)
        theta = theta * theta_scale


def _rotate_ref(x, cos, sin, n_rot, mode):
    # x (B, T, H, D) -> new array rotated by the angles of cos/sin (T or B, T, n_rot//2)
    out = x.copy()
    c, s = cos[..., None, :], sin[..., None, :]  # broadcast over heads (and rows)
    if mode == ROPE_NEOX:
        i0, i1 = slice(0, n_rot // 2), slice(n_rot // 2, n_rot)
    else:
        i0, i1 = slice(0, n_rot, 2), slice(1, n_rot, 2)
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


def rope_forward_ref(out, x, cos, sin, n_rot, mode):
    out[:] = _rotate_ref(x, cos, sin, n_rot, mode)


def rope_backward_ref(dx, dout, cos, sin, n_rot, mode):
    dx[:] = _rotate_ref(dout, cos, -sin, n_rot, mode)
