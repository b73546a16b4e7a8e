"""The CPU kernels: each numba kernel against its numpy reference on whole tensors,
every backward (numba and reference) against finite differences, the gradient
rules (activation gradients overwritten, parameter gradients accumulated), the
in-place cases, and every argument check."""

import ctypes
import ctypes.util

import numpy as np
import pytest
from fdcheck import fd_check

from llamatune.kernels import attention, cross_entropy, optim, rmsnorm, rope, swiglu, vecmath

F32, F64 = np.float32, np.float64
TOL32 = dict(rtol=1e-5, atol=1e-6)  # numba kernel vs numpy reference in float32
FD_TOL = dict(rtol=1e-6, atol=1e-8)  # finite differences in float64


def randn(rng, *shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def _f32(*shape):
    return np.zeros(shape, F32)


def impls(module, *names):
    """(numba wrapper, numpy reference) pairs, one pytest param per implementation."""
    return [pytest.param(tuple(getattr(module, n + sfx) for n in names), id=tag)
            for sfx, tag in (("", "numba"), ("_ref", "ref"))]


# ---------------------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("N,C", [(1, 1), (3, 5), (7, 130)])  # 130: three dw column blocks
def test_rmsnorm_matches_ref(N, C):
    rng = np.random.default_rng(1)
    x, w, dout = randn(rng, N, C), randn(rng, C), randn(rng, N, C)
    got = [np.full((N, C), np.nan, F32), np.full(N, np.nan, F32)]
    want = [np.zeros((N, C), F32), np.zeros(N, F32)]
    rmsnorm.rmsnorm_forward(*got, x, w, 1e-5)
    rmsnorm.rmsnorm_forward_ref(*want, x, w, 1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)  # same float ops but the sum order
    np.testing.assert_allclose(got[0], want[0], **TOL32)
    # dx is overwritten (NaN prefill), dw accumulated onto what is there
    dx, dw = np.full((N, C), np.nan, F32), np.ones(C, F32)
    dx_ref, dw_ref = np.zeros((N, C), F32), np.ones(C, F32)
    rmsnorm.rmsnorm_backward(dx, dw, dout, x, w, got[1])
    rmsnorm.rmsnorm_backward_ref(dx_ref, dw_ref, dout, x, w, got[1])
    np.testing.assert_allclose(dx, dx_ref, **TOL32)
    np.testing.assert_allclose(dw, dw_ref, **TOL32)
    rmsnorm.rmsnorm_backward(dx, dw, dout, x, w, got[1])
    np.testing.assert_allclose(dw - 1, 2 * (dw_ref - 1), **TOL32)


def test_rmsnorm_forward_mirrors_ggml_bit_for_bit():
    rng = np.random.default_rng(15)
    x, w, eps = randn(rng, 4, 33), randn(rng, 33), F32(1e-6)
    out, rstd = _f32(4, 33), _f32(4)
    rmsnorm.rmsnorm_forward(out, rstd, x, w, eps)
    for n in range(4):  # ggml_compute_forward_rms_norm_f32, then ggml_mul by w
        total = 0.0
        for xi in x[n]:
            total += float(xi * xi)  # float product, double sum in row order
        scale = F32(1.0) / np.sqrt(F32(total / 33) + eps)
        assert rstd[n] == scale
        np.testing.assert_array_equal(out[n], x[n] * scale * w)


@pytest.mark.parametrize("fns", impls(rmsnorm, "rmsnorm_forward", "rmsnorm_backward"))
def test_rmsnorm_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(2)
    N, C, eps = 3, 6, 1e-5
    x, w, dout = randn(rng, N, C, dtype=F64), randn(rng, C, dtype=F64), randn(rng, N, C, dtype=F64)
    out, rstd = np.zeros((N, C)), np.zeros(N)

    def loss(x, w):
        forward(out, rstd, x, w, eps)
        return np.sum(out * dout)

    loss(x, w)
    dx, dw = np.zeros((N, C)), np.zeros(C)
    backward(dx, dw, dout, x, w, rstd.copy())
    print("fd max rel err", fd_check(loss, {"x": x, "w": w}, {"x": dx, "w": dw}, **FD_TOL))


# ---------------------------------------------------------------------------- rope

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


@pytest.mark.parametrize("mode", [rope.ROPE_NORM, rope.ROPE_NEOX])
@pytest.mark.parametrize("D,n_rot", [(8, 8), (7, 4)])  # n_rot < D: pass-through dims
def test_rope_matches_ref_and_in_place(mode, D, n_rot):
    rng = np.random.default_rng(3)
    B, T, H = 2, 5, 3
    x = randn(rng, B, T, H, D)
    cos, sin = rope_tables(rng, T, n_rot)
    out, want = np.full_like(x, np.nan), np.zeros_like(x)
    rope.rope_forward(out, x, cos, sin, n_rot, mode)
    rope.rope_forward_ref(want, x, cos, sin, n_rot, mode)
    np.testing.assert_allclose(out, want, **TOL32)
    np.testing.assert_array_equal(out[..., n_rot:], x[..., n_rot:])
    dx, dx_want = np.full_like(x, np.nan), np.zeros_like(x)
    rope.rope_backward(dx, out, cos, sin, n_rot, mode)
    rope.rope_backward_ref(dx_want, out, cos, sin, n_rot, mode)
    np.testing.assert_allclose(dx, dx_want, **TOL32)
    np.testing.assert_allclose(dx, x, **TOL32)  # R(-theta) R(theta) = 1
    y = x.copy()
    rope.rope_forward(y, y, cos, sin, n_rot, mode)  # in place
    np.testing.assert_array_equal(y, out)
    rope.rope_backward(y, y, cos, sin, n_rot, mode)
    np.testing.assert_array_equal(y, dx)


@pytest.mark.parametrize("mode", [rope.ROPE_NORM, rope.ROPE_NEOX])
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


@pytest.mark.parametrize("mode", [rope.ROPE_NORM, rope.ROPE_NEOX])
def test_rope_per_token_positions(mode):
    """Per-row tables (B, T, n_rot//2): gathered from a cache of 0..P-1 they equal
    rope_cache of the positions themselves, and each row rotates exactly as it does
    alone with its own (T, n_rot//2) table, forward and backward; whole tensors
    against the reference too."""
    rng = np.random.default_rng(24)
    B, T, H, D, n_rot, P = 3, 6, 2, 10, 8, 9
    positions = np.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [8, 0, 1, 2, 0, 1]], np.int64)
    cache_cos, cache_sin = np.zeros((P, n_rot // 2), F32), np.zeros((P, n_rot // 2), F32)
    rope.rope_cache(cache_cos, cache_sin, np.arange(P, dtype=np.int64), n_rot, 1e4, 1.0, None)
    cos, sin = rope.rope_tables(cache_cos, cache_sin, positions)
    assert cos.shape == (B, T, n_rot // 2) and cos.flags.c_contiguous
    x, dout = randn(rng, B, T, H, D), randn(rng, B, T, H, D)
    out, dx = np.full_like(x, np.nan), np.full_like(x, np.nan)
    rope.rope_forward(out, x, cos, sin, n_rot, mode)
    rope.rope_backward(dx, dout, cos, sin, n_rot, mode)
    for b in range(B):
        c, s = np.zeros((T, n_rot // 2), F32), np.zeros((T, n_rot // 2), F32)
        rope.rope_cache(c, s, positions[b], n_rot, 1e4, 1.0, None)
        np.testing.assert_array_equal(cos[b], c)
        np.testing.assert_array_equal(sin[b], s)
        row, drow = np.zeros_like(x[:1]), np.zeros_like(x[:1])
        rope.rope_forward(row, x[b:b + 1], c, s, n_rot, mode)
        rope.rope_backward(drow, dout[b:b + 1], c, s, n_rot, mode)
        np.testing.assert_array_equal(out[b], row[0])
        np.testing.assert_array_equal(dx[b], drow[0])
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


# ---------------------------------------------------------------------------- attention

def qkv(rng, B, T, NH, NKV, HS, n_past=0, dtype=F32):
    S = n_past + T
    q = randn(rng, B, T, NH, HS, dtype=dtype)
    k_cache = randn(rng, B, S + 3, NKV, HS, dtype=dtype)  # longer cache, sliced
    v_cache = randn(rng, B, S + 3, NKV, HS, dtype=dtype)
    return q, k_cache[:, :S], v_cache[:, :S]


ATTN_SHAPES = [(2, 5, 4, 2, 8), (1, 7, 4, 1, 6), (2, 3, 2, 2, 4)]  # GQA, MQA, MHA


@pytest.mark.parametrize("qblock", [128, 2])  # 2: several query blocks per sequence
@pytest.mark.parametrize("n_past", [0, 4])
@pytest.mark.parametrize("B,T,NH,NKV,HS", ATTN_SHAPES)
def test_attention_forward_matches_ref(B, T, NH, NKV, HS, n_past, qblock, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, B, T, NH, NKV, HS, n_past)
    out, lse = np.full_like(q, np.nan), np.full((B, NH, T), np.nan, F32)
    out_ref, lse_ref = np.zeros_like(q), np.zeros((B, NH, T), F32)
    attention.attention_forward(out, lse, q, k, v, n_past)
    attention.attention_forward_ref(out_ref, lse_ref, q, k, v, n_past)
    np.testing.assert_allclose(out, out_ref, **TOL32)
    np.testing.assert_allclose(lse, lse_ref, **TOL32)
    if n_past == 0:  # query 0 sees only key 0: out = v_0 of its kv head
        np.testing.assert_allclose(out[:, 0], np.repeat(v[:, 0], NH // NKV, axis=1), **TOL32)


@pytest.mark.parametrize("qblock", [128, 2])
@pytest.mark.parametrize("B,T,NH,NKV,HS", ATTN_SHAPES)
def test_attention_backward_matches_ref(B, T, NH, NKV, HS, qblock, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, B, T, NH, NKV, HS)
    dout = randn(rng, B, T, NH, HS)
    out, lse = np.zeros_like(q), np.zeros((B, NH, T), F32)
    attention.attention_forward(out, lse, q, k, v, 0)
    grads = [np.full_like(q, np.nan), np.full(k.shape, np.nan, F32), np.full(v.shape, np.nan, F32)]
    want = [np.zeros_like(g) for g in grads]
    attention.attention_backward(*grads, dout, q, k, v, out, lse)
    attention.attention_backward_ref(*want, dout, q, k, v, out, lse)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(got, ref, **TOL32)


@pytest.mark.parametrize("B,T,NH,NKV,HS", [(2, 4, 4, 2, 3), (1, 5, 2, 1, 4)])
@pytest.mark.parametrize("fns", impls(attention, "attention_forward", "attention_backward"))
def test_attention_fd(fns, B, T, NH, NKV, HS, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", 3)  # blocks of 3 queries: the block path too
    forward, backward = fns
    rng = np.random.default_rng(7)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS, dtype=F64))
    dout = randn(rng, B, T, NH, HS, dtype=F64)
    out, lse = np.zeros_like(q), np.zeros((B, NH, T))

    def loss(q, k, v):
        forward(out, lse, q, k, v, 0)
        return np.sum(out * dout)

    loss(q, k, v)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    backward(dq, dk, dv, dout, q, k, v, out.copy(), lse.copy())
    err = fd_check(loss, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, **FD_TOL)
    print("fd max rel err", err)


def packed_segments(rng, B, T):
    """(B, T) int32 sample ids of packed rows: random runs (some of one token), the
    ids not in order, and in row 0 a padding run at the end with its own id."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), size=min(T - 1, 3), replace=False))
        ids = rng.permutation(10)[: len(cuts) + 1] * (b + 1)
        for n, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, T])):
            seg[b, lo:hi] = ids[n]
    seg[0, -2:] = -1  # padding
    return seg


@pytest.mark.parametrize("qblock", [128, 2, 3])
@pytest.mark.parametrize("B,T,NH,NKV,HS", [(2, 9, 4, 2, 8), (3, 7, 4, 1, 6), (2, 6, 2, 2, 4)])
def test_attention_segments_match_ref(B, T, NH, NKV, HS, qblock, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(20)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    seg, dout = packed_segments(rng, B, T), randn(rng, B, T, NH, HS)
    out, lse = np.full_like(q, np.nan), np.full((B, NH, T), np.nan, F32)
    out_ref, lse_ref = np.zeros_like(q), np.zeros((B, NH, T), F32)
    attention.attention_forward(out, lse, q, k, v, 0, segments=seg)
    attention.attention_forward_ref(out_ref, lse_ref, q, k, v, 0, segments=seg)
    np.testing.assert_allclose(out, out_ref, **TOL32)
    np.testing.assert_allclose(lse, lse_ref, **TOL32)
    grads = [np.full_like(q, np.nan), np.full(k.shape, np.nan, F32), np.full(v.shape, np.nan, F32)]
    want = [np.zeros_like(g) for g in grads]
    attention.attention_backward(*grads, dout, q, k, v, out, lse, segments=seg)
    attention.attention_backward_ref(*want, dout, q, k, v, out, lse, segments=seg)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(got, ref, **TOL32)


@pytest.mark.parametrize("qblock", [128, 3])
def test_attention_packed_row_equals_samples_alone(qblock, monkeypatch):
    """Each sample of a packed row gets exactly what it gets alone in a row of its
    own (no reference involved): outputs, lse and all three gradients."""
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(21)
    T, NH, NKV, HS = 11, 4, 2, 8
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, 1, T, NH, NKV, HS))
    dout = randn(rng, 1, T, NH, HS)
    seg = np.array([[3, 3, 3, 3, 0, 0, 0, 7, 7, 7, 7]], np.int32)
    res = [np.zeros_like(q), np.zeros((1, NH, T), F32), np.zeros_like(q), np.zeros_like(k),
           np.zeros_like(v)]
    attention.attention_forward(*res[:2], q, k, v, 0, segments=seg)
    attention.attention_backward(*res[2:], dout, q, k, v, *res[:2], segments=seg)
    for lo, hi in ((0, 4), (4, 7), (7, 11)):
        part = [np.ascontiguousarray(a[:, lo:hi]) for a in (q, k, v, dout)]
        alone = [np.zeros_like(part[0]), np.zeros((1, NH, hi - lo), F32), np.zeros_like(part[0]),
                 np.zeros_like(part[1]), np.zeros_like(part[2])]
        attention.attention_forward(*alone[:2], *part[:3], 0)
        attention.attention_backward(*alone[2:], part[3], *part[:3], *alone[:2])
        for got, want in zip(res, alone):
            rows = got[:, :, lo:hi] if got.ndim == 3 else got[:, lo:hi]
            np.testing.assert_allclose(rows, want, **TOL32)


def test_attention_one_segment_is_the_plain_causal_path():
    rng = np.random.default_rng(22)
    B, T, NH, NKV, HS = 2, 130, 4, 2, 8  # two query blocks
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout = randn(rng, B, T, NH, HS)
    results = []
    for seg in (None, np.full((B, T), 5, np.int32)):
        r = [np.zeros_like(q), np.zeros((B, NH, T), F32), np.zeros_like(q), np.zeros_like(k),
             np.zeros_like(v)]
        attention.attention_forward(*r[:2], q, k, v, 0, segments=seg)
        attention.attention_backward(*r[2:], dout, q, k, v, *r[:2], segments=seg)
        results.append(r)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_attention_results_do_not_depend_on_threads():
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread only")
    rng = np.random.default_rng(26)
    B, T, NH, NKV, HS = 2, 140, 4, 2, 8
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout, seg = randn(rng, B, T, NH, HS), packed_segments(rng, B, T)
    results, before = [], numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            r = [np.zeros_like(q), np.zeros((B, NH, T), F32), np.zeros_like(q), np.zeros_like(k),
                 np.zeros_like(v)]
            attention.attention_forward(*r[:2], q, k, v, 0, segments=seg)
            attention.attention_backward(*r[2:], dout, q, k, v, *r[:2], segments=seg)
            results.append(r)
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("segmented", [False, True])
def test_attention_results_do_not_depend_on_tiles(segmented, monkeypatch):
    """Tiles of one kv head each, of two, and of all of a batch row's kv heads give the
    same bits: outputs, lse and gradients, plain, soft-capped and windowed."""
    import numba
    monkeypatch.setattr(attention, "_QBLOCK", 4)  # several query blocks
    rng = np.random.default_rng(27)
    B, T, NH, NKV, HS = 3, 11, 6, 3, 5
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout = randn(rng, B, T, NH, HS)
    seg = packed_segments(rng, B, T) if segmented else None
    pair = (NH // NKV) * 4 * T                                   # score floats of one kv head
    heads = {1: [1] * NKV, 2 * pair: [2, 1], 10 ** 9: [NKV]}      # _TILE_FLOATS: tiles' kv heads
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        for opts in ({}, {"softcap": 2.0}, {"window": 3}):
            results = []
            for floats, want in heads.items():
                monkeypatch.setattr(attention, "_TILE_FLOATS", floats)
                tiles = attention._tiles(B, NKV, pair)
                assert [ks.stop - ks.start for _, ks in tiles] == want * B
                r = [np.zeros_like(q), np.zeros((B, NH, T), F32), np.zeros_like(q), np.zeros_like(k),
                     np.zeros_like(v)]
                attention.attention_forward(*r[:2], q, k, v, 0, segments=seg, **opts)
                attention.attention_backward(*r[2:], dout, q, k, v, *r[:2], segments=seg, **opts)
                results.append(r)
            for r in results[1:]:
                for a, b in zip(results[0], r):
                    np.testing.assert_array_equal(a, b)
    finally:
        numba.set_num_threads(before)


def test_attention_tiles_cover_every_pair_once_and_feed_every_thread():
    import numba
    before = numba.get_num_threads()
    try:
        for nw in range(1, min(4, numba.config.NUMBA_NUM_THREADS) + 1):
            numba.set_num_threads(nw)
            for B, NKV, most in [(8, 4, 16), (1, 4, 4), (1, 1, 8), (5, 3, 2), (2, 8, 100), (3, 2, 1)]:
                tiles = attention._tiles(B, NKV, attention._TILE_FLOATS // most)
                pairs = [(b, h) for b, ks in tiles for h in range(NKV)[ks]]
                assert sorted(pairs) == [(b, h) for b in range(B) for h in range(NKV)]
                assert all(ks.stop - ks.start <= most for _, ks in tiles)
                assert len(tiles) >= min(nw, B * NKV)
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("fns", impls(attention, "attention_forward", "attention_backward"))
def test_attention_segments_fd(fns, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", 3)
    forward, backward = fns
    rng = np.random.default_rng(23)
    B, T, NH, NKV, HS = 2, 7, 4, 2, 3
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS, dtype=F64))
    dout, seg = randn(rng, B, T, NH, HS, dtype=F64), packed_segments(rng, B, T)
    out, lse = np.zeros_like(q), np.zeros((B, NH, T))

    def loss(q, k, v):
        forward(out, lse, q, k, v, 0, segments=seg)
        return np.sum(out * dout)

    loss(q, k, v)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    backward(dq, dk, dv, dout, q, k, v, out.copy(), lse.copy(), segments=seg)
    err = fd_check(loss, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, **FD_TOL)
    print("fd max rel err", err)


def test_float32_exp_of_the_softmax_kernels():
    """The vectorized float32 exp is within 3 ulp of exp over the range the softmax
    uses (s - max <= 0), and flushes below -87 to exp(-87) instead of 0."""
    from numba import njit

    @njit
    def exp_all(x, out):
        for i in range(x.size):
            out[i] = vecmath.expf(x[i])

    x = np.concatenate([-np.geomspace(1e-8, 87.0, 20000), [0.0, -1e-30]]).astype(F32)
    got = np.empty_like(x)
    exp_all(x, got)
    want = np.exp(x.astype(F64))
    ulp = np.abs(got - want) / np.spacing(want.astype(F32)).astype(F64)
    assert ulp.max() <= 3
    exp_all(np.array([-88.0, -1e4], F32), got[:2])
    np.testing.assert_array_equal(got[:2], F32(np.exp(F32(-87.0))))


def test_float32_tanh_of_the_gate_and_softcap_kernels():
    """The vectorized float32 tanh is within 1.2 ulp of tanh on both sides of its
    0.625 switch and out to saturation; -0 stays -0, +-inf gives +-1, NaN stays NaN;
    and a loop of it is vectorized (LLVM vector types in the float32 loop)."""
    from numba import njit

    @njit(error_model="numpy")
    def tanh_all(x, out):
        for i in range(x.size):
            out[i] = vecmath.tanhf(x[i])

    x = np.geomspace(1e-30, 100.0, 200000).astype(F32)
    x = np.concatenate([x, [F32(0.625), np.nextafter(F32(0.625), F32(0)), F32(1e-45)]])
    x = np.concatenate([x, -x])
    got = np.empty_like(x)
    tanh_all(x, got)
    want = np.tanh(x.astype(F64))
    ulp = np.abs(got - want) / np.spacing(np.abs(want).astype(F32)).astype(F64)
    assert ulp.max() <= 1.2
    special = np.array([-0.0, np.inf, -np.inf, np.nan], F32)
    out = np.empty_like(special)
    tanh_all(special, out)
    assert np.signbit(out[0]) and out[0] == 0 and out[1] == 1 and out[2] == -1 and np.isnan(out[3])
    ir = next(iter(tanh_all.inspect_llvm().values()))
    assert "x float>" in ir                       # a vector loop, not a scalar libm call


# ---------------------------------------------------------------------------- swiglu

@pytest.mark.parametrize("N,F", [(1, 1), (3, 7), (4, 33)])
def test_swiglu_matches_ref(N, F):
    rng = np.random.default_rng(8)
    g, u, dout = 4 * randn(rng, N, F), randn(rng, N, F), randn(rng, N, F)
    out, want = np.full_like(g, np.nan), np.zeros_like(g)
    swiglu.swiglu_forward(out, g, u)
    swiglu.swiglu_forward_ref(want, g, u)
    np.testing.assert_allclose(out, want, **TOL32)
    got, ref = [np.full_like(g, np.nan) for _ in range(2)], [np.zeros_like(g) for _ in range(2)]
    swiglu.swiglu_backward(*got, dout, g, u)
    swiglu.swiglu_backward_ref(*ref, dout, g, u)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, **TOL32)


@pytest.mark.parametrize("fns", impls(swiglu, "swiglu_forward", "swiglu_backward"))
def test_swiglu_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(9)
    g, u, dout = (randn(rng, 3, 5, dtype=F64) for _ in range(3))
    out = np.zeros_like(g)

    def loss(g, u):
        forward(out, g, u)
        return np.sum(out * dout)

    dg, du = np.zeros_like(g), np.zeros_like(g)
    backward(dg, du, dout, g, u)
    print("fd max rel err", fd_check(loss, {"g": g, "u": u}, {"g": dg, "u": du}, **FD_TOL))


# ---------------------------------------------------------------------------- cross-entropy

def ce_case(rng, dtype=F32):
    N, V = 6, 11
    logits = 3 * randn(rng, N, V, dtype=dtype)
    targets = np.array([0, 10, -1, 4, 4, -1], np.int64)
    weights = np.array([0.5, 1.0, 1.0, 0.0, 0.25, 0.0], dtype)  # weight 0 on row 3
    return logits, targets, weights


def test_cross_entropy_matches_ref_and_in_place():
    logits, targets, weights = ce_case(np.random.default_rng(10))
    losses, want = np.full(6, np.nan, F32), np.zeros(6, F32)
    cross_entropy.cross_entropy_forward(losses, logits, targets)
    cross_entropy.cross_entropy_forward_ref(want, logits, targets)
    np.testing.assert_allclose(losses, want, **TOL32)
    assert losses[2] == 0 and losses[5] == 0  # target -1
    p = np.exp(logits[0] - logits[0].max())
    np.testing.assert_allclose(losses[0], np.log(p.sum()) - np.log(p[0]), rtol=1e-5)
    dl, dl_ref = np.full_like(logits, np.nan), np.zeros_like(logits)
    cross_entropy.cross_entropy_backward(dl, logits, targets, weights)
    cross_entropy.cross_entropy_backward_ref(dl_ref, logits, targets, weights)
    np.testing.assert_allclose(dl, dl_ref, **TOL32)
    assert not dl[[2, 3, 5]].any()  # target -1 or weight 0
    np.testing.assert_allclose(dl.sum(axis=1), 0, atol=1e-6)
    in_place = logits.copy()
    cross_entropy.cross_entropy_backward(in_place, in_place, targets, weights)
    np.testing.assert_array_equal(in_place, dl)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_cross_entropy_forward_backward_is_forward_then_backward(dtype):
    """The fused kernel gives the backward's very bits (in place and into another
    array), the forward's losses to rounding (its row sum is reassociated, and in
    float32 its exp is vecmath's polynomial), and the reference's values; rows with target < 0
    or weight 0 get gradient 0."""
    logits, targets, weights = ce_case(np.random.default_rng(13), dtype)
    logits = np.concatenate([logits, 30 * randn(np.random.default_rng(14), 6, 40, dtype=dtype)], axis=1)
    losses, dl = np.zeros(6, dtype), np.zeros_like(logits)
    cross_entropy.cross_entropy_forward(losses, logits, targets)
    cross_entropy.cross_entropy_backward(dl, logits, targets, weights)
    got_losses, got = np.full(6, np.nan, dtype), logits.copy()          # in place: dlogits is logits
    cross_entropy.cross_entropy_forward_backward(got_losses, got, got, targets, weights)
    apart_losses, apart = np.full(6, np.nan, dtype), np.full_like(logits, np.nan)
    cross_entropy.cross_entropy_forward_backward(apart_losses, apart, logits, targets, weights)
    np.testing.assert_array_equal(got, dl)
    np.testing.assert_array_equal(apart, dl)
    np.testing.assert_array_equal(apart_losses, got_losses)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-6 if dtype == F32 else 1e-14)
    ref_losses, ref = np.zeros(6, dtype), np.zeros_like(logits)
    cross_entropy.cross_entropy_forward_backward_ref(ref_losses, ref, logits, targets, weights)
    np.testing.assert_allclose(got_losses, ref_losses, **(TOL32 if dtype == F32 else dict(rtol=1e-12)))
    np.testing.assert_allclose(got, ref, **(TOL32 if dtype == F32 else dict(rtol=1e-12, atol=1e-15)))
    assert not got[[2, 3, 5]].any() and got_losses[3] > 0
    with pytest.raises(ValueError, match="not overlap"):
        shifted = np.zeros(logits.size + 1, dtype)
        cross_entropy.cross_entropy_forward_backward(got_losses, shifted[1:].reshape(logits.shape),
                                                     shifted[:-1].reshape(logits.shape), targets, weights)


@pytest.mark.parametrize("fns", impls(cross_entropy, "cross_entropy_forward",
                                      "cross_entropy_backward"))
def test_cross_entropy_fd(fns):
    forward, backward = fns
    logits, targets, weights = ce_case(np.random.default_rng(11), F64)
    losses = np.zeros(len(targets))

    def loss(logits):
        forward(losses, logits, targets)
        return np.sum(weights * losses)

    dl = np.zeros_like(logits)
    backward(dl, logits, targets, weights)
    print("fd max rel err", fd_check(loss, {"logits": logits}, {"logits": dl}, **FD_TOL))


# ---------------------------------------------------------------------------- optimizers

@pytest.mark.parametrize("update", [optim.adamw_update, optim.adamw_update_ref], ids=["numba", "ref"])
def test_adamw_two_steps_match_hand_written_loop(update):
    rng = np.random.default_rng(12)
    n, lr, b1, b2, eps, wd = 37, 1e-2, 0.9, 0.999, 1e-8, 0.1
    p0, grads = randn(rng, n), [randn(rng, n), randn(rng, n)]
    p, m, v = p0.copy(), np.zeros(n, F32), np.zeros(n, F32)
    for t in (1, 2):
        update(p, grads[t - 1], m, v, lr, b1, b2, eps, wd, t)
    want, mw, vw = p0.astype(F64), np.zeros(n), np.zeros(n)
    for t in (1, 2):
        g = grads[t - 1].astype(F64)
        mw = b1 * mw + (1 - b1) * g
        vw = b2 * vw + (1 - b2) * g * g
        mhat, vhat = mw / (1 - b1**t), vw / (1 - b2**t)
        want = want - lr * (mhat / (np.sqrt(vhat) + eps) + wd * want)
    np.testing.assert_allclose(p, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m, mw, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(v, vw, rtol=1e-6, atol=1e-10)


def test_sgd_norm_and_scale_match_ref():
    rng = np.random.default_rng(13)
    p, g = randn(rng, 1001), randn(rng, 1001)
    want = p.copy()
    optim.sgd_update(p, g, 0.1, 0.01)
    optim.sgd_update_ref(want, g, 0.1, 0.01)
    np.testing.assert_allclose(p, want, rtol=1e-6)
    norm_sq = optim.global_norm_sq(g)
    assert isinstance(norm_sq, float)
    assert norm_sq == pytest.approx(optim.global_norm_sq_ref(g), rel=1e-12)
    scaled, want = g.copy(), g.copy()
    optim.scale_inplace(scaled, 0.3)
    optim.scale_inplace_ref(want, 0.3)
    np.testing.assert_array_equal(scaled, want)


# ---------------------------------------------------------------------------- fd_check itself

def test_fd_check_accepts_true_and_rejects_wrong_gradients():
    rng = np.random.default_rng(14)
    x, y = randn(rng, 4, 5, dtype=F64), randn(rng, 7, dtype=F64)

    def loss(x, y, scale):  # scale: a non-array input that passes through
        return scale * (np.sum(x**3) + np.sum(np.sin(y)))

    x0 = x.copy()
    err = fd_check(loss, {"x": x, "y": y, "scale": 2.0}, {"x": 6 * x**2, "y": 2 * np.cos(y)},
                   rtol=1e-7, atol=1e-9, n_probe=5)
    assert err <= 1e-7
    np.testing.assert_array_equal(x, x0)  # perturbations restored
    wrong = 6 * x**2
    wrong[3, 4] *= 1.001  # one element off by 0.1%
    with pytest.raises(AssertionError, match="gradient of 'x'"):
        fd_check(loss, {"x": x, "y": y, "scale": 2.0}, {"x": wrong}, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------- argument checks

def _rope(out=(1, 2, 1, 4), x=(1, 2, 1, 4), cos=(2, 2), n_rot=4, mode=0, backward=False):
    fn = rope.rope_backward if backward else rope.rope_forward
    return lambda: fn(_f32(*out), _f32(*x), _f32(*cos), _f32(2, 2), n_rot, mode)


def _cache(positions=np.zeros(2, np.int64), n_rot=4, ff=None):
    return lambda: rope.rope_cache(_f32(2, 2), _f32(2, 2), positions, n_rot, 1e4, 1.0, ff)


def _attn_fwd(q=(1, 2, 2, 4), k=None, n_past=0):
    q = _f32(*q)
    k = _f32(1, 2, 2, 4) if k is None else k  # an array: may be a strided view
    lse = _f32(1, q.shape[-2], 2)
    return lambda: attention.attention_forward(np.zeros_like(q), lse, q, k, _f32(1, 2, 2, 4), n_past)


def _attn_bwd(dk=(1, 2, 2, 4)):
    X = (1, 2, 2, 4)
    return lambda: attention.attention_backward(_f32(*X), _f32(*dk), _f32(*X), _f32(*X), _f32(*X),
                                                _f32(*X), _f32(*X), _f32(*X), _f32(1, 2, 2))


def _attn_seg(segments, T=2, n_past=0, backward=False):
    X, KV = (1, T, 2, 4), (1, n_past + T, 2, 4)
    if backward:
        return lambda: attention.attention_backward(*[_f32(*X)] * 8, _f32(1, 2, T), segments=segments)
    return lambda: attention.attention_forward(_f32(*X), _f32(1, 2, T), _f32(*X), _f32(*KV), _f32(*KV),
                                               n_past, segments=segments)


CE_T = np.zeros(2, np.int64)
FLAT4 = [_f32(3)] * 4
CHECKS = [
    (lambda: rmsnorm.rmsnorm_forward(_f32(2, 3), _f32(2), _f32(2, 3, 1), _f32(3), 1e-5), "x must be a 2-D"),
    (lambda: rmsnorm.rmsnorm_forward(_f32(2, 3), _f32(3), _f32(2, 3), _f32(3), 1e-5), r"rstd must be .* \(2,\)"),
    (lambda: rmsnorm.rmsnorm_forward(_f32(2, 3), _f32(2), _f32(2, 3), _f32(3), 0.0), "eps must be > 0"),
    (lambda: rmsnorm.rmsnorm_backward(_f32(2, 3), np.zeros(3), _f32(2, 3), _f32(2, 3), _f32(3), _f32(2)),
     "dw must be a C-contiguous float32"),
    (_cache(n_rot=5), "n_rot must be even"),
    (_cache(positions=np.zeros((2, 1), np.int64)), "positions must be a 1-D"),
    (_cache(positions=np.zeros(2, np.int32)), "positions must be .* int64"),
    (_cache(ff=_f32(3)), "freq_factors must be"),
    (_rope(x=(1, 2, 4)), "x must be a 4-D"),
    (_rope(n_rot=6), "n_rot must be even, > 0 and <= head size 4"),
    (_rope(mode=1), "mode must be ROPE_NORM"),
    (_rope(cos=(2, 1), backward=True), r"cos must be .* \(2, 2\)"),
    (_rope(out=(1, 2, 1, 5), backward=True), r"dx must be .* \(1, 2, 1, 4\)"),
    (_rope(cos=(2, 2, 2)), r"cos must be .* \(1, 2, 2\)"),
    (lambda: rope.rope_tables(_f32(3, 2), _f32(3, 2), np.zeros(3, np.int64)), "positions must be a 2-D int64"),
    (lambda: rope.rope_tables(_f32(3, 2), _f32(3, 2), np.array([[0, 3]])), r"positions must lie in \[0, 3\)"),
    (lambda: swiglu.swiglu_forward(_f32(2, 3), _f32(6), _f32(2, 3)), "g must be a 2-D"),
    (lambda: swiglu.swiglu_backward(_f32(2, 3), _f32(3, 2), _f32(2, 3), _f32(2, 3), _f32(2, 3)), "du must be"),
    (lambda: cross_entropy.cross_entropy_forward(_f32(2), _f32(2), CE_T), "logits must be a 2-D"),
    (lambda: cross_entropy.cross_entropy_forward(_f32(2), _f32(2, 3), np.array([0, 3])), "target 3 out of range"),
    (lambda: cross_entropy.cross_entropy_forward(_f32(2), _f32(2, 3), CE_T.astype(np.int32)), "targets must be"),
    (lambda: cross_entropy.cross_entropy_backward(_f32(2, 3), _f32(2, 3), CE_T, np.zeros(2)),
     "weights must be a C-contiguous float32"),
    (lambda: optim.sgd_update(np.zeros(3, np.int32), _f32(3), 0.1, 0.0), "must be float32 or float64"),
    (lambda: optim.sgd_update(_f32(3), _f32(4), 0.1, 0.0), "g must be a contiguous 1-D"),
    (lambda: optim.adamw_update(*FLAT4, 0.1, 0.9, 0.999, 1e-8, 0.0, 0), "step t must be an integer >= 1"),
    (lambda: optim.adamw_update(*FLAT4, 0.1, 1.0, 0.999, 1e-8, 0.0, 1), r"betas must lie in \[0, 1\)"),
    (_attn_fwd(n_past=-1), "n_past must be >= 0"),
    (_attn_fwd(q=(2, 2, 4)), "q must be a 4-D"),
    (_attn_fwd(k=_f32(2, 2, 4)), "k must be a 4-D"),
    (_attn_fwd(q=(1, 2, 3, 4)), "query heads 3 must be a multiple of kv heads 2"),
    (_attn_fwd(k=_f32(1, 3, 2, 4)), r"k must be a contiguous per batch element float32 array of shape \(1, 2, 2, 4\)"),
    (_attn_fwd(k=_f32(1, 2, 2, 8)[..., ::2]), "k must be a contiguous per batch element"),
    (_attn_bwd(dk=(1, 2, 1, 4)), "dk must be a C-contiguous"),
    (_attn_seg(np.zeros((1, 2), np.int64)), r"segments must be an int32 array of shape \(1, 2\)"),
    (_attn_seg(np.zeros((2, 1), np.int32)), r"segments must be an int32 array of shape \(1, 2\)"),
    (_attn_seg(np.array([[1, 2, 1]], np.int32), T=3), "segments row 0: sample id 1 appears in two"),
    (_attn_seg(np.zeros((1, 2), np.int32), n_past=1), "segments need n_past = 0"),
    (_attn_seg(np.array([[1, 2, 1]], np.int32), T=3, backward=True), "appears in two separate runs"),
    (lambda: fd_check(lambda x: 0.0, {"x": _f32(2)}, {"x": _f32(2)}), "must be a C-contiguous float64"),
    (lambda: fd_check(lambda x: 0.0, {"x": np.zeros(2)}, {"x": np.zeros(3)}), r"has shape \(3,\), input has \(2,\)"),
    (lambda: fd_check(lambda x: 0.0, {"x": np.zeros(2)}, {"x": np.zeros(2)}, rtol=0), "rtol must be > 0"),
]


@pytest.mark.parametrize("call,match", CHECKS, ids=[m for _, m in CHECKS])
def test_argument_checks_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
