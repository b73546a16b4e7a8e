"""The CPU kernels of the newer architectures (gemma, gemma2/3, qwen3): GeGLU gating,
soft-capping, attention with a q.k scale, soft-capped scores and a sliding window,
and per-head q/k RMSNorm through the plain rmsnorm kernel. Each numba kernel
against its numpy reference on whole tensors, every backward (numba and reference)
against float64 finite differences, oracles that need no reference (a window of 1,
a window as long as the sequence, packed samples alone), and the argument checks.
The CUDA twins are tested in test_cuda_kernels.py."""

import numpy as np
import pytest
from fdcheck import fd_check
from test_kernels import impls, qkv, randn

from llamatune.kernels import attention, geglu, rmsnorm, softcap

F32, F64 = np.float32, np.float64
TOL32 = dict(rtol=1e-5, atol=1e-6)  # numba kernel vs numpy reference in float32
FD_TOL = dict(rtol=1e-6, atol=1e-8)  # finite differences in float64
# attention: float32 gradients that should be 0 (a token alone in its window) come out
# as the rounding of dP - rowsum(P dP), ~1e-6
TOL_ATT = dict(rtol=1e-5, atol=2e-6)


# ---------------------------------------------------------------------------- geglu

@pytest.mark.parametrize("N,F", [(1, 1), (3, 7), (4, 33)])
def test_geglu_matches_ref_and_in_place(N, F):
    rng = np.random.default_rng(1)
    g, u, dh = 4 * randn(rng, N, F), randn(rng, N, F), randn(rng, N, F)
    h, want = np.full_like(g, np.nan), np.zeros_like(g)
    geglu.geglu_forward(h, g, u)
    geglu.geglu_forward_ref(want, g, u)
    np.testing.assert_allclose(h, want, **TOL32)
    got, ref = [np.full_like(g, np.nan) for _ in range(2)], [np.zeros_like(g) for _ in range(2)]
    geglu.geglu_backward(*got, dh, g, u)
    geglu.geglu_backward_ref(*ref, dh, g, u)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, **TOL32)
    gi, ui = g.copy(), u.copy()  # in place: h over g, then dg over g and du over u
    geglu.geglu_forward(gi, gi, u)
    np.testing.assert_array_equal(gi, h)
    gi = g.copy()
    geglu.geglu_backward(gi, ui, dh, gi, ui)
    np.testing.assert_array_equal(gi, got[0])
    np.testing.assert_array_equal(ui, got[1])


def test_geglu_is_ggml_gelu_tanh_times_up():
    """The float32 forward is ggml_gelu_f32(g) * u evaluated in ggml's operation order
    (checked in float32 numpy up to tanhf's rounding: one ulp of tanh near -1 is
    |x|/2 ulp(1) in 0.5 x (1 + tanh)), and GELU's known values hold."""
    f = F32
    g = np.array([[-12.0, -3.0, -1.0, -1e-3, 0.0, 0.5, 1.0, 2.0, 5.0, 12.0]], F32)
    u = np.ones_like(g)
    h = np.zeros_like(g)
    geglu.geglu_forward(h, g, u)
    ggml = f(0.5) * g * (f(1) + np.tanh(f(0.79788456080286535587989211986876) * g
                                        * (f(1) + f(0.044715) * g * g)))
    assert np.all(np.abs(h - ggml) <= np.abs(g) * np.finfo(F32).eps + 2e-7 * np.abs(ggml))
    assert h[0, 4] == 0 and h[0, 0] == 0 and h[0, -1] == 12
    np.testing.assert_allclose(h[0, 6], 0.8411920, rtol=1e-6)  # gelu_tanh(1)


def test_geglu_docstring_figures_for_ggml_table_lookup():
    """The figures the module docstring gives for ggml's GGML_GELU_FP16 table lookup
    (input rounded to float16, gelu of it rounded to float16, clamped outside
    +-10) against this kernel's exact formula."""
    x = np.linspace(-10, 10, 400001, dtype=F32)[None]
    exact = np.zeros_like(x)
    geglu.geglu_forward(exact, x, np.ones_like(x))
    x16 = x.astype(np.float16).astype(F32)
    table = np.zeros_like(x)
    geglu.geglu_forward(table, x16, np.ones_like(x))
    table = table.astype(np.float16).astype(F32)
    table[x <= -10], table[x >= 10] = 0, x[x >= 10]
    d = np.abs(table - exact)[0]
    x = x[0]
    assert d[(x > -3) & (x < 0)].max() <= 1.2e-4
    assert d[np.abs(x) < 1].max() <= 5.1e-4
    assert d[np.abs(x) < 4].max() <= 2.1e-3
    assert 3e-3 < d.max() <= 3.91e-3
    pos = x > 1e-3
    assert (d[pos] / exact[0, pos]).max() <= 1.0e-3


@pytest.mark.parametrize("fns", impls(geglu, "geglu_forward", "geglu_backward"))
def test_geglu_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(2)
    g, u, dh = 2 * randn(rng, 3, 6, dtype=F64), randn(rng, 3, 6, dtype=F64), randn(rng, 3, 6, dtype=F64)
    h = np.zeros_like(g)

    def loss(g, u):
        forward(h, g, u)
        return np.sum(h * dh)

    dg, du = np.zeros_like(g), np.zeros_like(g)
    backward(dg, du, dh, g, u)
    print("fd max rel err", fd_check(loss, {"g": g, "u": u}, {"g": dg, "u": du}, **FD_TOL))


# -------------------------------------------------------------------------- softcap

@pytest.mark.parametrize("shape", [(1, 1), (3, 50), (2, 3, 7)])
def test_softcap_matches_ref_and_in_place(shape):
    rng = np.random.default_rng(3)
    x, dy, cap = 40 * randn(rng, *shape), randn(rng, *shape), 30.0
    y, want = np.full_like(x, np.nan), np.zeros_like(x)
    softcap.softcap_forward(y, x, cap)
    softcap.softcap_forward_ref(want, x, cap)
    np.testing.assert_allclose(y, want, **TOL32)
    assert np.abs(y).max() <= cap
    dx, dx_ref = np.full_like(x, np.nan), np.zeros_like(x)
    softcap.softcap_backward(dx, dy, y, cap)
    softcap.softcap_backward_ref(dx_ref, dy, want, cap)
    np.testing.assert_allclose(dx, dx_ref, **TOL32)
    xi, dyi = x.copy(), dy.copy()  # in place, as the logits chunk is capped
    softcap.softcap_forward(xi, xi, cap)
    np.testing.assert_array_equal(xi, y)
    softcap.softcap_backward(dyi, dyi, xi, cap)
    np.testing.assert_array_equal(dyi, dx)


def test_softcap_is_ggml_scale_tanh_scale():
    """y = cap * tanh(x * float32(1/cap)), the three float32 ops of gemma2's graph."""
    rng = np.random.default_rng(4)
    x, cap = 60 * randn(rng, 4, 33), 30.0
    y = np.zeros_like(x)
    softcap.softcap_forward(y, x, cap)
    np.testing.assert_allclose(y, F32(cap) * np.tanh(x * (F32(1) / F32(cap))), rtol=2e-7,
                               atol=0)


@pytest.mark.parametrize("fns", impls(softcap, "softcap_forward", "softcap_backward"))
def test_softcap_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(5)
    x, dy, cap = 6 * randn(rng, 3, 8, dtype=F64), randn(rng, 3, 8, dtype=F64), 5.0
    y = np.zeros_like(x)

    def loss(x):
        forward(y, x, cap)
        return np.sum(y * dy)

    loss(x)
    dx = np.zeros_like(x)
    backward(dx, dy, y.copy(), cap)
    print("fd max rel err", fd_check(loss, {"x": x}, {"x": dx}, **FD_TOL))


# ------------------------------------------------------------------------ attention

def run_attention(fwd, bwd, q, k, v, n_past=0, segments=None, dout=None, **opts):
    """[out, lse] and, with dout, [dq, dk, dv] (outputs prefilled with NaN)."""
    B, T, NH, _ = q.shape
    res = [np.full_like(q, np.nan), np.full((B, NH, T), np.nan, q.dtype)]
    fwd(*res, q, k, v, n_past, segments, **opts)
    if dout is not None:
        grads = [np.full_like(q, np.nan), np.full(k.shape, np.nan, q.dtype),
                 np.full(v.shape, np.nan, q.dtype)]
        bwd(*grads, dout, q, k, v, *res, segments, **opts)
        res += grads
    return res


CPU = (attention.attention_forward, attention.attention_backward)
REF = (attention.attention_forward_ref, attention.attention_backward_ref)

# scale / softcap / window: each alone, the combinations, windows 1, short, >= T
OPTIONS = [
    dict(scale=0.3), dict(softcap=2.0), dict(window=1), dict(window=3), dict(window=100),
    dict(softcap=1.5, window=4), dict(scale=0.7, softcap=3.0), dict(scale=0.2, window=2),
    dict(scale=0.9, softcap=2.5, window=3),
]
OPT_IDS = ["-".join(f"{k}{v}" for k, v in o.items()) for o in OPTIONS]


@pytest.mark.parametrize("qblock", [128, 2])  # 2: several query blocks, windows across them
@pytest.mark.parametrize("opts", OPTIONS, ids=OPT_IDS)
def test_attention_options_match_ref(opts, qblock, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(6)
    B, T, NH, NKV, HS = 2, 7, 4, 2, 8
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    q *= 2  # large scores, so that the cap matters
    dout = randn(rng, B, T, NH, HS)
    got = run_attention(*CPU, q, k, v, dout=dout, **opts)
    want = run_attention(*REF, q, k, v, dout=dout, **opts)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **TOL_ATT)


@pytest.mark.parametrize("qblock", [128, 3])
@pytest.mark.parametrize("opts", [dict(window=1), dict(window=4), dict(window=30),
                                  dict(scale=0.5, softcap=2.0, window=3)],
                         ids=["window1", "window4", "window30", "all"])
def test_attention_options_with_n_past_match_ref(opts, qblock, monkeypatch):
    """Decoding after a cache: the window counts absolute positions n_past + i."""
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(7)
    B, T, NH, NKV, HS, n_past = 2, 5, 4, 1, 6, 6
    q, k, v = qkv(rng, B, T, NH, NKV, HS, n_past)  # k, v: [:, :S] slices of a cache
    got = run_attention(*CPU, q, k, v, n_past, **opts)
    want = run_attention(*REF, q, k, v, n_past, **opts)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **TOL_ATT)


def packed_segments():
    # runs of 1 to 5 tokens, ids out of order, padding (-1) at the end of row 0
    return np.array([[4, 4, 4, 4, 4, 0, 7, 7, -1], [2, 2, 9, 9, 9, 9, 9, 1, 1]], np.int32)


@pytest.mark.parametrize("qblock", [128, 2, 3])
@pytest.mark.parametrize("opts", [dict(window=2), dict(window=4, softcap=2.0, scale=0.5)],
                         ids=["window2", "all"])
def test_attention_options_with_segments_match_ref(opts, qblock, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(8)
    seg = packed_segments()
    B, T, NH, NKV, HS = 2, seg.shape[1], 4, 2, 5
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout = randn(rng, B, T, NH, HS)
    got = run_attention(*CPU, q, k, v, 0, seg, dout, **opts)
    want = run_attention(*REF, q, k, v, 0, seg, dout, **opts)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **TOL_ATT)


@pytest.mark.parametrize("qblock", [128, 3])
def test_attention_windowed_packed_row_equals_samples_alone(qblock, monkeypatch):
    """With a window, each sample of a packed row gets exactly what it gets alone:
    the window counts positions within the sample (no reference involved)."""
    monkeypatch.setattr(attention, "_QBLOCK", qblock)
    rng = np.random.default_rng(9)
    T, NH, NKV, HS = 11, 4, 2, 4
    opts = dict(window=3, softcap=2.0)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, 1, T, NH, NKV, HS))
    dout = randn(rng, 1, T, NH, HS)
    seg = np.array([[3, 3, 3, 3, 3, 0, 0, 7, 7, 7, 7]], np.int32)
    res = run_attention(*CPU, q, k, v, 0, seg, dout, **opts)
    for lo, hi in ((0, 5), (5, 7), (7, 11)):
        part = [np.ascontiguousarray(a[:, lo:hi]) for a in (q, k, v, dout)]
        alone = run_attention(*CPU, *part[:3], 0, None, part[3], **opts)
        for got, want in zip(res, alone):
            rows = got[:, :, lo:hi] if got.ndim == 3 else got[:, lo:hi]
            np.testing.assert_allclose(rows, want, **TOL_ATT)


def test_attention_defaults_are_unchanged_bit_for_bit():
    """scale = 1/sqrt(HS) given explicitly, softcap 0 and a window >= every query's
    position give exactly the default results (same blocks, same arithmetic)."""
    rng = np.random.default_rng(10)
    B, T, NH, NKV, HS = 2, 140, 4, 2, 8  # two query blocks
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS))
    dout = randn(rng, B, T, NH, HS)
    base = run_attention(*CPU, q, k, v, dout=dout)
    for opts in (dict(scale=1 / np.sqrt(HS)), dict(softcap=0.0), dict(window=T),
                 dict(window=10 * T)):
        for a, b in zip(base, run_attention(*CPU, q, k, v, dout=dout, **opts)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n_past", [0, 3])
def test_attention_window_of_one_sees_only_itself(n_past):
    """window = 1: out_i = v_i (own position), lse_i = the query's own score;
    its gradients: dv_i = sum of the group's dout_i, dq = dk = 0."""
    rng = np.random.default_rng(11)
    B, T, NH, NKV, HS = 2, 6, 4, 2, 4
    q, k, v = qkv(rng, B, T, NH, NKV, HS, n_past)
    out, lse = run_attention(*CPU, q, k, v, n_past, window=1, softcap=2.0)
    G = NH // NKV
    np.testing.assert_allclose(out, np.repeat(v[:, n_past:], G, axis=2), **TOL_ATT)
    own = np.einsum("bthd,bthd->bht", q, np.repeat(k[:, n_past:], G, axis=2)) / np.sqrt(HS)
    np.testing.assert_allclose(lse, 2.0 * np.tanh(own / 2.0), **TOL_ATT)
    if n_past == 0:
        dout = randn(rng, B, T, NH, HS)
        _, _, dq, dk, dv = run_attention(*CPU, q, k, v, 0, dout=dout, window=1)
        np.testing.assert_allclose(dq, 0, atol=TOL_ATT["atol"])  # rounding of dP - P dP
        np.testing.assert_allclose(dk, 0, atol=TOL_ATT["atol"])
        np.testing.assert_allclose(dv, dout.reshape(B, T, NKV, G, HS).sum(axis=3), **TOL_ATT)


def test_attention_window_skips_keys_that_slid_out():
    """Keys outside every query's window do not matter: NaN there changes nothing."""
    rng = np.random.default_rng(12)
    B, T, NH, NKV, HS, n_past, window = 1, 4, 2, 1, 4, 6, 3
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS, n_past))
    want = run_attention(*CPU, q, k, v, n_past, window=window)
    first_seen = n_past - window + 1  # query 0 sits at position n_past
    k[:, :first_seen], v[:, :first_seen] = np.nan, np.nan
    got = run_attention(*CPU, q, k, v, n_past, window=window)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


FD_OPTIONS = [dict(window=3), dict(softcap=1.5, scale=0.8), dict(scale=0.6, softcap=2.0, window=2)]


@pytest.mark.parametrize("opts", FD_OPTIONS, ids=["window", "softcap-scale", "all"])
@pytest.mark.parametrize("fns", impls(attention, "attention_forward", "attention_backward"))
def test_attention_options_fd(fns, opts, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", 3)  # blocks of 3 queries: the block path too
    forward, backward = fns
    rng = np.random.default_rng(13)
    B, T, NH, NKV, HS = 1, 7, 4, 2, 3
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS, dtype=F64))
    q *= 2
    dout = randn(rng, B, T, NH, HS, dtype=F64)
    out, lse = np.zeros_like(q), np.zeros((B, NH, T))

    def loss(q, k, v):
        forward(out, lse, q, k, v, 0, **opts)
        return np.sum(out * dout)

    loss(q, k, v)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    backward(dq, dk, dv, dout, q, k, v, out.copy(), lse.copy(), **opts)
    err = fd_check(loss, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, **FD_TOL)
    print("fd max rel err", err)


@pytest.mark.parametrize("fns", impls(attention, "attention_forward", "attention_backward"))
def test_attention_options_with_segments_fd(fns, monkeypatch):
    monkeypatch.setattr(attention, "_QBLOCK", 3)
    forward, backward = fns
    rng = np.random.default_rng(14)
    seg = packed_segments()
    B, T, NH, NKV, HS = 2, seg.shape[1], 2, 1, 3
    opts = dict(scale=0.7, softcap=2.0, window=3)
    q, k, v = (np.ascontiguousarray(a) for a in qkv(rng, B, T, NH, NKV, HS, dtype=F64))
    dout = randn(rng, B, T, NH, HS, dtype=F64)
    out, lse = np.zeros_like(q), np.zeros((B, NH, T))

    def loss(q, k, v):
        forward(out, lse, q, k, v, 0, seg, **opts)
        return np.sum(out * dout)

    loss(q, k, v)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    backward(dq, dk, dv, dout, q, k, v, out.copy(), lse.copy(), seg, **opts)
    err = fd_check(loss, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, **FD_TOL)
    print("fd max rel err", err)


# ------------------------------------------------------------- per-head q/k RMSNorm

def per_head_norm_ref(x, w, eps):
    """qwen3 / gemma3 q_norm, k_norm: each head vector x[n, h] (head_dim,) normalised
    by its own RMS, times the (head_dim,) weight; in float64."""
    x = x.astype(F64)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def test_per_head_rmsnorm_is_rmsnorm_on_the_head_view():
    """q (N, n_head, head_dim) viewed as (N * n_head, head_dim) with a (head_dim,)
    weight: the forward is the per-head norm; the backward's dw sums over tokens and
    heads."""
    rng = np.random.default_rng(15)
    N, NH, HD, eps = 5, 3, 8, 1e-6
    x, w = randn(rng, N, NH, HD), randn(rng, HD)
    out, rstd = np.full((N * NH, HD), np.nan, F32), np.full(N * NH, np.nan, F32)
    rmsnorm.rmsnorm_forward(out, rstd, x.reshape(N * NH, HD), w, eps)
    np.testing.assert_allclose(out.reshape(N, NH, HD), per_head_norm_ref(x, w, eps), **TOL32)
    dout = randn(rng, N, NH, HD)
    dx, dw = np.full((N * NH, HD), np.nan, F32), np.zeros(HD, F32)
    rmsnorm.rmsnorm_backward(dx, dw, dout.reshape(N * NH, HD), x.reshape(N * NH, HD), w, rstd)
    # dw of the per-head form: sum over tokens and heads of dout * x / rms
    r = 1 / np.sqrt(np.mean(x.astype(F64) ** 2, axis=-1, keepdims=True) + eps)
    np.testing.assert_allclose(dw, np.sum(dout * x * r, axis=(0, 1)), **TOL32)


@pytest.mark.parametrize("fns", impls(rmsnorm, "rmsnorm_forward", "rmsnorm_backward"))
def test_per_head_rmsnorm_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(16)
    N, NH, HD, eps = 3, 2, 5, 1e-6
    x, w, dout = randn(rng, N, NH, HD, dtype=F64), randn(rng, HD, dtype=F64), randn(rng, N, NH, HD, dtype=F64)
    out, rstd = np.zeros((N * NH, HD)), np.zeros(N * NH)

    def loss(x, w):  # x in the (N, n_head, head_dim) layout the graph holds
        forward(out, rstd, x.reshape(N * NH, HD), w, eps)
        return np.sum(out.reshape(N, NH, HD) * dout)

    loss(x, w)
    dx, dw = np.zeros((N * NH, HD)), np.zeros(HD)
    backward(dx, dw, dout.reshape(N * NH, HD), x.reshape(N * NH, HD), w, rstd)
    err = fd_check(loss, {"x": x, "w": w}, {"x": dx.reshape(N, NH, HD), "w": dw}, **FD_TOL)
    print("fd max rel err", err)


# ------------------------------------------------------------------- argument checks

def _f32(*shape):
    return np.zeros(shape, F32)


def _attn(backward=False, **opts):
    X = (1, 2, 2, 4)
    if backward:
        return lambda: attention.attention_backward(*[_f32(*X)] * 8, _f32(1, 2, 2), **opts)
    return lambda: attention.attention_forward(_f32(*X), _f32(1, 2, 2), *[_f32(*X)] * 3, 0, **opts)


CHECKS = [
    (lambda: geglu.geglu_forward(_f32(2, 3), _f32(6), _f32(2, 3)), "geglu: g must be a 2-D"),
    (lambda: geglu.geglu_forward(_f32(2, 3), _f32(2, 3), _f32(3, 2)), r"geglu: u must be .* \(2, 3\)"),
    (lambda: geglu.geglu_backward(_f32(2, 3), np.zeros((2, 3)), _f32(2, 3), _f32(2, 3), _f32(2, 3)),
     "geglu: du must be a C-contiguous float32"),
    (lambda: softcap.softcap_forward(_f32(2, 3), _f32(2, 3), 0.0), "softcap: cap must be a finite number > 0"),
    (lambda: softcap.softcap_forward(_f32(2, 3), _f32(2, 3), float("inf")), "cap must be a finite"),
    (lambda: softcap.softcap_forward(_f32(2, 3), np.zeros((2, 3), np.int32), 1.0),
     r"softcap: x must be a C-contiguous float32 array of shape \(2, 3\), got int32"),
    (lambda: softcap.softcap_forward(np.zeros(3, np.int32), _f32(3), 1.0),
     "softcap: y must be a float32 or float64 array"),
    (lambda: softcap.softcap_forward(_f32(2, 4), _f32(2, 3), 1.0), r"softcap: x must be .* \(2, 4\)"),
    (lambda: softcap.softcap_backward(_f32(2, 3), _f32(2, 3), _f32(2, 3)[:, ::2], 1.0), "softcap: y must be a C-contiguous"),
    (lambda: softcap.softcap_forward([1.0], _f32(1), 1.0), "softcap: y must be a float32 or float64 array"),
    (_attn(scale=0.0), "attention: scale must be None or a finite number > 0, got 0.0"),
    (_attn(scale=float("nan"), backward=True), "scale must be None or a finite number > 0"),
    (_attn(softcap=-1.0), "attention: softcap must be a finite number >= 0, got -1.0"),
    (_attn(window=-1), r"attention: window must be an integer >= 0 \(0: no window\), got -1"),
    (_attn(window=2.5, backward=True), "window must be an integer >= 0"),
]


@pytest.mark.parametrize("call,match", CHECKS, ids=[m for _, m in CHECKS])
def test_argument_checks_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_backend_registers_the_new_families():
    from llamatune.backend import cpu
    ops = cpu().ops
    assert ops.geglu is geglu and ops.softcap is softcap
