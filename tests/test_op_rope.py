"""rope (kernels/rope.py, kernels/cuda/rope.py): the cos/sin cache bit for bit
against ggml_rope_cache_init, the CPU and CUDA kernels against the numpy reference
on whole tensors (pass-through dims, in place, per-token position tables), the
backward (numba and reference) against float64 finite differences, and the
argument checks."""
import ctypes
import ctypes.util

import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import CUDA, F32, F64, FD_TOL, TOL32, cases, impls, randn, zeros32

from llamatune.kernels import rope

MODES = [rope.ROPE_NORM, rope.ROPE_NEOX]


def ggml_rope_cache_loop(positions, n_rot, freq_base, freq_scale, freq_factors):
    """ggml_rope_cache_init written out element by element with libm's powf/cosf/sinf."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    for fn, n_args in (("powf", 2), ("cosf", 1), ("sinf", 1)):
        getattr(libm, fn).restype = ctypes.c_float
        getattr(libm, fn).argtypes = [ctypes.c_float] * n_args
    cos = np.zeros((len(positions), n_rot // 2), F32)
    sin = np.zeros_like(cos)
    theta_scale = F32(libm.powf(freq_base, F32(-2.0) / F32(n_rot)))
    for t, p in enumerate(positions):
        theta = F32(p)
        for i in range(n_rot // 2):
            ff = F32(1.0) if freq_factors is None else freq_factors[i]
            angle = F32(freq_scale) * (theta / ff)  # numpy float32 scalars: float32 maths
            cos[t, i], sin[t, i] = libm.cosf(angle), libm.sinf(angle)
            theta = theta * theta_scale
    return cos, sin


@pytest.mark.parametrize("n_rot,base,scale,with_ff", [(8, 10000.0, 1.0, False),
                                                       (128, 500000.0, 0.25, True)])
def test_rope_cache_mirrors_ggml(n_rot, base, scale, with_ff):
    positions = np.array([0, 1, 7, 1000, 32767, 131071], np.int64)
    ff = np.linspace(1.0, 8.0, n_rot // 2).astype(F32) if with_ff else None
    cos, sin = np.zeros((6, n_rot // 2), F32), np.zeros((6, n_rot // 2), F32)
    rope.rope_cache(cos, sin, positions, n_rot, base, scale, ff)
    want_cos, want_sin = ggml_rope_cache_loop(positions, n_rot, base, scale, ff)
    # bit for bit: the same float32 angles, and numba lowers cos/sin to libm's cosf/sinf
    np.testing.assert_array_equal(cos, want_cos)
    np.testing.assert_array_equal(sin, want_sin)
    # the numpy reference uses numpy's own SIMD cos/sin: within one ulp
    ref_cos, ref_sin = np.zeros_like(cos), np.zeros_like(sin)
    rope.rope_cache_ref(ref_cos, ref_sin, positions, n_rot, base, scale, ff)
    np.testing.assert_array_max_ulp(ref_cos, cos, maxulp=1)
    np.testing.assert_array_max_ulp(ref_sin, sin, maxulp=1)


def rope_tables(rng, T, n_rot, dtype=F32):
    cos, sin = np.zeros((T, n_rot // 2), F32), np.zeros((T, n_rot // 2), F32)
    positions = rng.integers(0, 4096, T).astype(np.int64)
    rope.rope_cache(cos, sin, positions, n_rot, 10000.0, 1.0, None)
    return cos.astype(dtype), sin.astype(dtype)


# (B, T, H); D, n_rot: n_rot < D leaves pass-through dims
@pytest.mark.parametrize("b,mode,D,n_rot,BTH", cases(
    cpu=[(m, D, r, (2, 5, 3)) for D, r in [(8, 8), (7, 4)] for m in MODES],
    cuda=[(m, D, r, (1, 3, 2)) for D, r in [(8, 8), (10, 6)] for m in MODES]))
def test_rope_matches_ref_and_in_place(b, mode, D, n_rot, BTH):
    rng = np.random.default_rng(3)
    x = randn(rng, *BTH, D)
    cos, sin = rope_tables(rng, BTH[1], n_rot)
    cd, sd = b.to(cos), b.to(sin)
    want = np.zeros_like(x)
    rope.rope_forward_ref(want, x, cos, sin, n_rot, mode)
    out = b.nan(x.shape)
    b.k.rope.rope_forward(out, b.to(x), cd, sd, n_rot, mode)
    got = b.get(out)
    np.testing.assert_allclose(got, want, **TOL32)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])
    dx_want = np.zeros_like(x)
    rope.rope_backward_ref(dx_want, got, cos, sin, n_rot, mode)
    dx = b.nan(x.shape)
    b.k.rope.rope_backward(dx, out, cd, sd, n_rot, mode)
    np.testing.assert_allclose(b.get(dx), dx_want, **TOL32)
    np.testing.assert_allclose(b.get(dx), x, **TOL32)  # R(-theta) R(theta) = 1
    y = b.to(x)  # in place, forward then backward
    b.k.rope.rope_forward(y, y, cd, sd, n_rot, mode)
    np.testing.assert_array_equal(b.get(y), got)
    b.k.rope.rope_backward(y, y, cd, sd, n_rot, mode)
    np.testing.assert_array_equal(b.get(y), b.get(dx))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fns", impls(rope, "rope_forward", "rope_backward"))
def test_rope_fd(fns, mode):
    forward, backward = fns
    rng = np.random.default_rng(4)
    B, T, H, D, n_rot = 1, 3, 2, 6, 4
    x, dout = randn(rng, B, T, H, D, dtype=F64), randn(rng, B, T, H, D, dtype=F64)
    cos, sin = rope_tables(rng, T, n_rot, F64)
    out = np.zeros_like(x)

    def loss(x):
        forward(out, x, cos, sin, n_rot, mode)
        return np.sum(out * dout)

    dx = np.zeros_like(x)
    backward(dx, dout, cos, sin, n_rot, mode)
    print("fd max rel err", fd_check(loss, {"x": x}, {"x": dx}, **FD_TOL))


PER_TOKEN_CPU = ((2, 10, 8), np.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [8, 0, 1, 2, 0, 1]]))
PER_TOKEN_CUDA = ((2, 8, 6), np.array([[0, 1, 0], [4, 0, 1]]))


@pytest.mark.parametrize("b,mode,HDR,positions", cases(cpu=[(m, *PER_TOKEN_CPU) for m in MODES],
                                                       cuda=[(m, *PER_TOKEN_CUDA) for m in MODES]))
def test_rope_per_token_positions(b, mode, HDR, positions):
    """Per-row tables (B, T, n_rot//2): gathered from a cache of 0..P-1 they equal
    rope_cache of the positions themselves, and each row rotates exactly as it does
    alone with its own (T, n_rot//2) table, forward and backward; whole tensors
    against the reference too."""
    rng = np.random.default_rng(24)
    (B, T), (H, D, n_rot), P = positions.shape, HDR, positions.max() + 1
    positions = positions.astype(np.int64)
    cache_cos, cache_sin = np.zeros((P, n_rot // 2), F32), np.zeros((P, n_rot // 2), F32)
    rope.rope_cache(cache_cos, cache_sin, np.arange(P, dtype=np.int64), n_rot, 1e4, 1.0, None)
    cos, sin = rope.rope_tables(cache_cos, cache_sin, positions)
    assert cos.shape == (B, T, n_rot // 2) and cos.flags.c_contiguous
    x, dout = randn(rng, B, T, H, D), randn(rng, B, T, H, D)
    out, dx = b.nan(x.shape), b.nan(x.shape)
    b.k.rope.rope_forward(out, b.to(x), b.to(cos), b.to(sin), n_rot, mode)
    b.k.rope.rope_backward(dx, b.to(dout), b.to(cos), b.to(sin), n_rot, mode)
    out, dx = b.get(out), b.get(dx)
    for i in range(B):
        c, s = np.zeros((T, n_rot // 2), F32), np.zeros((T, n_rot // 2), F32)
        rope.rope_cache(c, s, positions[i], n_rot, 1e4, 1.0, None)
        np.testing.assert_array_equal(cos[i], c)
        np.testing.assert_array_equal(sin[i], s)
        row, drow = b.nan(x[:1].shape), b.nan(x[:1].shape)
        b.k.rope.rope_forward(row, b.to(x[i:i + 1]), b.to(c), b.to(s), n_rot, mode)
        b.k.rope.rope_backward(drow, b.to(dout[i:i + 1]), b.to(c), b.to(s), n_rot, mode)
        np.testing.assert_array_equal(out[i], b.get(row)[0])
        np.testing.assert_array_equal(dx[i], b.get(drow)[0])
    want, dx_want = np.zeros_like(x), np.zeros_like(x)
    rope.rope_forward_ref(want, x, cos, sin, n_rot, mode)
    rope.rope_backward_ref(dx_want, dout, cos, sin, n_rot, mode)
    np.testing.assert_allclose(out, want, **TOL32)
    np.testing.assert_allclose(dx, dx_want, **TOL32)


@pytest.mark.parametrize("fns", impls(rope, "rope_forward", "rope_backward"))
def test_rope_per_token_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(25)
    B, T, H, D, n_rot = 2, 3, 2, 6, 4
    x, dout = randn(rng, B, T, H, D, dtype=F64), randn(rng, B, T, H, D, dtype=F64)
    cos, sin = (a.reshape(B, T, -1) for a in rope_tables(rng, B * T, n_rot, F64))
    out = np.zeros_like(x)

    def loss(x):
        forward(out, x, cos, sin, n_rot, rope.ROPE_NEOX)
        return np.sum(out * dout)

    dx = np.zeros_like(x)
    backward(dx, dout, cos, sin, n_rot, rope.ROPE_NEOX)
    print("fd max rel err", fd_check(loss, {"x": x}, {"x": dx}, **FD_TOL))


# ------------------------------------------------------------------- argument checks

def _rope(out=(1, 2, 1, 4), x=(1, 2, 1, 4), cos=(2, 2), n_rot=4, mode=0, backward=False):
    fn = rope.rope_backward if backward else rope.rope_forward
    return lambda: fn(zeros32(*out), zeros32(*x), zeros32(*cos), zeros32(2, 2), n_rot, mode)


def _cache(positions=np.zeros(2, np.int64), n_rot=4, ff=None):
    return lambda: rope.rope_cache(zeros32(2, 2), zeros32(2, 2), positions, n_rot, 1e4, 1.0, ff)


def _cuda(n_rot=4, mode=rope.ROPE_NORM, cos=(2, 2)):
    def call():
        x, cs = CUDA.to(zeros32(1, 2, 1, 6)), CUDA.to(zeros32(2, 2))
        CUDA.k.rope.rope_forward(x, x, CUDA.to(zeros32(*cos)), cs, n_rot, mode)
    return call


@pytest.mark.parametrize("b,call,match", cases(cpu=[
    (_cache(n_rot=5), "n_rot must be even"),
    (_cache(positions=np.zeros((2, 1), np.int64)), "positions must be a 1-D"),
    (_cache(positions=np.zeros(2, np.int32)), "positions must be .* int64"),
    (_cache(ff=zeros32(3)), "freq_factors must be"),
    (_rope(x=(1, 2, 4)), "x must be a 4-D"),
    (_rope(n_rot=6), "n_rot must be even, > 0 and <= head size 4"),
    (_rope(mode=1), "mode must be ROPE_NORM"),
    (_rope(cos=(2, 1), backward=True), r"cos must be .* \(2, 2\)"),
    (_rope(out=(1, 2, 1, 5), backward=True), r"dx must be .* \(1, 2, 1, 4\)"),
    (_rope(cos=(2, 2, 2)), r"cos must be .* \(1, 2, 2\)"),
    (lambda: rope.rope_tables(zeros32(3, 2), zeros32(3, 2), np.zeros(3, np.int64)),
     "positions must be a 2-D int64"),
    (lambda: rope.rope_tables(zeros32(3, 2), zeros32(3, 2), np.array([[0, 3]])),
     r"positions must lie in \[0, 3\)"),
], cuda=[
    (_cuda(n_rot=5), "n_rot"),
    (_cuda(mode=1), "mode"),
    (_cuda(n_rot=6), "cos"),
    (_cuda(cos=(2, 2, 2)), r"cos must be .* \(1, 2, 2\)"),
]))
def test_argument_checks_raise(b, call, match):
    with pytest.raises(ValueError, match=match):
        call()
