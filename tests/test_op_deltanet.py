"""The gated delta-net layer's kernels (kernels/deltanet.py, causal_conv.py, gated_norm.py,
deltanet_gates.py):
the chunked delta rule against the step-by-step recurrence (its numpy reference, HF's
order) in float64 to rounding and in float32 within a stated bound, with several
chunks and a partial last one, both head orders and the options; the backward
against the reference's backward through time; every backward (numba and reference)
against float64 finite differences, g, beta and the initial state included; decoding
step by step (state carried) against the full-sequence forward, for the delta rule
and the convolution; the gated norm and the gates g, beta; the argument checks."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import F32, F64, FD_TOL, TOL32, impls, randn, zeros32

from llamatune.kernels import causal_conv, deltanet, deltanet_gates, gated_norm

TIGHT64 = dict(rtol=1e-12, atol=1e-12)  # float64: the two forms differ only in rounding
# float32 chunked form against the float64 recurrence (same inputs): the UT transform's
# products and the inverse of L round differently from the step-by-step updates
TOL_DN32 = dict(rtol=2e-4, atol=2e-5)
# (B, T, NK, NV, DK, DV): T = 11 with chunks of 4 gives two full chunks and a partial
# one; NV = 2 NK: two value heads per q/k head (grouped or tiled), and one MHA shape
DN_SHAPES = [(2, 11, 2, 4, 5, 3), (1, 9, 3, 3, 4, 6)]


def dn_inputs(rng, B, T, NK, NV, DK, DV, dtype=F64):
    """q, k, v, g (= -softplus, <= 0, the models' range), beta (sigmoid) and a state."""
    q, k = randn(rng, B, T, NK, DK, dtype=dtype), randn(rng, B, T, NK, DK, dtype=dtype)
    v = randn(rng, B, T, NV, DV, dtype=dtype)
    g = -np.log1p(np.exp(randn(rng, B, T, NV, dtype=F64))).astype(dtype)
    beta = (1 / (1 + np.exp(-randn(rng, B, T, NV, dtype=F64)))).astype(dtype)
    state = randn(rng, B, NV, DK, DV, dtype=dtype)
    return q, k, v, g, beta, state


def run_forward(fn, q, k, v, g, beta, state_in, **opts):
    """(out, final state) of a forward (kernel or reference), outputs NaN-prefilled."""
    B, T, NV, DV = v.shape
    out = np.full(v.shape, np.nan, q.dtype)
    state_out = np.full((B, NV, q.shape[3], DV), np.nan, q.dtype)
    fn(out, state_out, q, k, v, g, beta, state_in, **opts)
    return out, state_out


def run_backward(fn, dout, dstate_out, q, k, v, g, beta, state_in, **opts):
    """[dq, dk, dv, dg, dbeta, dstate_in] of a backward, NaN-prefilled."""
    grads = [np.full(a.shape, np.nan, q.dtype) for a in (q, k, v, g, beta, state_in)]
    fn(*grads, dout, q, k, v, g, beta, state_in, dstate_out, **opts)
    return grads


OPTIONS = [dict(), dict(heads="tiled"), dict(l2norm=False, scale=0.3), dict(heads="tiled", scale=0.7)]


@pytest.mark.parametrize("chunk,group", [(4, 32), (4, 2), (4, 1), (64, 32)])
@pytest.mark.parametrize("opts", OPTIONS, ids=["default", "tiled", "raw-scale", "tiled-scale"])
@pytest.mark.parametrize("shape", DN_SHAPES, ids=["gqa", "mha"])
def test_deltanet_chunked_equals_recurrent_float64(shape, opts, chunk, group, monkeypatch):
    """Output, final state and every gradient of the chunked form against the step-by-step
    reference, from a given state and from zeros (chunk 4: several chunks, a partial last one,
    in one group, in groups of two chunks and of one; 64: one partial chunk)."""
    monkeypatch.setattr(deltanet, "CHUNK", chunk)
    monkeypatch.setattr(deltanet, "GROUP_CHUNKS", group)
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = dn_inputs(rng, *shape)
    dout, ds_out = randn(rng, *v.shape, dtype=F64), randn(rng, *s0.shape, dtype=F64)
    for state in (s0, None):
        got = run_forward(deltanet.deltanet_forward, q, k, v, g, beta, state, **opts)
        want = run_forward(deltanet.deltanet_forward_ref, q, k, v, g, beta, state, **opts)
        for a, w in zip(got, want, strict=True):
            np.testing.assert_allclose(a, w, **TIGHT64)
    got = run_backward(deltanet.deltanet_backward, dout, ds_out, q, k, v, g, beta, s0, **opts)
    want = run_backward(deltanet.deltanet_backward_ref, dout, ds_out, q, k, v, g, beta, s0, **opts)
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, **TIGHT64)


@pytest.mark.parametrize("heads", ["grouped", "tiled"])
def test_deltanet_chunked_float32_within_bound(heads):
    """float32 at the real chunk size (64), T = 150 (two full chunks and a partial one),
    against the float64 reference of the same inputs: outputs, state, gradients."""
    rng = np.random.default_rng(2)
    ins64 = dn_inputs(rng, 1, 150, 2, 4, 16, 16)
    ins32 = [a.astype(F32) for a in ins64]
    dout = randn(rng, 1, 150, 4, 16, dtype=F64)
    ds_out = randn(rng, 1, 4, 16, 16, dtype=F64)
    got = list(run_forward(deltanet.deltanet_forward, *ins32, heads=heads))
    want = list(run_forward(deltanet.deltanet_forward_ref, *ins64, heads=heads))
    got += run_backward(deltanet.deltanet_backward, dout.astype(F32), ds_out.astype(F32), *ins32,
                        heads=heads)
    want += run_backward(deltanet.deltanet_backward_ref, dout, ds_out, *ins64, heads=heads)
    for a, w in zip(got, want, strict=True):
        scale = np.abs(w).max()  # relative to the tensor's largest entry
        np.testing.assert_allclose(a, w, rtol=TOL_DN32["rtol"], atol=TOL_DN32["atol"] * max(1, scale))


@pytest.mark.slow
def test_deltanet_float32_at_real_shape():
    """Qwen3.5's head dims (DK = DV = 128), ctx 2048 (32 chunks), float32 against the float64
    reference: every tensor within 1e-5 of its largest entry (measured: 1.3e-6, dv)."""
    rng = np.random.default_rng(13)
    ins64 = dn_inputs(rng, 1, 2048, 1, 2, 128, 128)
    ins32 = [a.astype(F32) for a in ins64]
    dout, ds_out = randn(rng, 1, 2048, 2, 128, dtype=F64), randn(rng, 1, 2, 128, 128, dtype=F64)
    got = list(run_forward(deltanet.deltanet_forward, *ins32))
    got += run_backward(deltanet.deltanet_backward, dout.astype(F32), ds_out.astype(F32), *ins32)
    want = list(run_forward(deltanet.deltanet_forward_ref, *ins64))
    want += run_backward(deltanet.deltanet_backward_ref, dout, ds_out, *ins64)
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def test_deltanet_tiled_heads_are_the_gguf_reordering_of_grouped():
    """llama.cpp's convert_hf_to_gguf.py reorders the value heads from HF's grouped order
    (the G heads of q/k head 0, then of head 1, ...) to the tiled order ggml broadcasts
    (head p reads q/k head p % NK): GGUF head p is HF head (p % NK) * G + p // NK. The
    tiled kernels on reordered heads give the grouped kernels' results, reordered."""
    rng = np.random.default_rng(17)
    NK, G = 3, 2
    q, k, v, g, beta, s0 = dn_inputs(rng, 2, 9, NK, NK * G, 4, 3)
    dout, ds_out = randn(rng, *v.shape, dtype=F64), randn(rng, *s0.shape, dtype=F64)
    perm = np.arange(NK * G).reshape(NK, G).T.reshape(-1)  # GGUF head p <- HF head perm[p]
    assert [perm[p] for p in range(NK * G)] == [(p % NK) * G + p // NK for p in range(NK * G)]
    grouped = list(run_forward(deltanet.deltanet_forward, q, k, v, g, beta, s0))
    grouped += run_backward(deltanet.deltanet_backward, dout, ds_out, q, k, v, g, beta, s0)
    heads = [np.ascontiguousarray(a[:, :, perm]) for a in (v, g, beta, dout)]
    st = [np.ascontiguousarray(a[:, perm]) for a in (s0, ds_out)]
    tiled = list(run_forward(deltanet.deltanet_forward, q, k, *heads[:3], st[0], heads="tiled"))
    tiled += run_backward(deltanet.deltanet_backward, heads[3], st[1], q, k, *heads[:3], st[0], heads="tiled")
    out, state, dq, dk, dv, dg, dbeta, ds = grouped
    want = [out[:, :, perm], state[:, perm], dq, dk, dv[:, :, perm], dg[:, :, perm], dbeta[:, :, perm],
            ds[:, perm]]
    for a, w in zip(tiled, want, strict=True):
        np.testing.assert_allclose(a, w, **TIGHT64)


@pytest.mark.parametrize("fns", impls(deltanet, "deltanet_forward", "deltanet_backward"))
@pytest.mark.parametrize("opts", [dict(), dict(heads="tiled", l2norm=False, scale=0.6)],
                         ids=["default", "tiled-raw"])
def test_deltanet_fd(fns, opts, monkeypatch):
    """Finite differences through the delta rule: q, k, v, g, beta and the initial state,
    with the final state in the loss too (chunks of 3 over T = 7, in groups of 2 chunks)."""
    monkeypatch.setattr(deltanet, "CHUNK", 3)
    monkeypatch.setattr(deltanet, "GROUP_CHUNKS", 2)
    forward, backward = fns
    rng = np.random.default_rng(3)
    q, k, v, g, beta, s0 = dn_inputs(rng, 1, 7, 1, 2, 3, 2)
    dout, ds_out = randn(rng, *v.shape, dtype=F64), randn(rng, *s0.shape, dtype=F64)

    def loss(q, k, v, g, beta, state):
        out, state_out = run_forward(forward, q, k, v, g, beta, state, **opts)
        return np.sum(out * dout) + np.sum(state_out * ds_out)

    grads = run_backward(backward, dout, ds_out, q, k, v, g, beta, s0, **opts)
    names = ["q", "k", "v", "g", "beta", "state"]
    fd_check(loss, dict(zip(names, (q, k, v, g, beta, s0))), dict(zip(names, grads)), **FD_TOL)


@pytest.mark.parametrize("dtype,tol", [(F64, TIGHT64), (F32, TOL_DN32)], ids=["f64", "f32"])
@pytest.mark.parametrize("opts", [dict(heads="grouped"), dict(heads="tiled"),
                                  dict(heads="tiled", l2norm=False, scale=0.4)],
                         ids=["grouped", "tiled", "tiled-raw-scale"])
def test_deltanet_decode_step_by_step_equals_full_forward(opts, dtype, tol, monkeypatch):
    """Decoding one token at a time, the state carried from call to call, gives the
    full-sequence (chunked) forward's outputs and final state; so does a chunked prefill
    of the first tokens followed by decoding the rest; and the reference's decode."""
    monkeypatch.setattr(deltanet, "CHUNK", 4)
    rng = np.random.default_rng(4)
    q, k, v, g, beta, s0 = dn_inputs(rng, 2, 10, 2, 4, 8, 4, dtype)
    full_out, full_state = run_forward(deltanet.deltanet_forward, q, k, v, g, beta, s0, **opts)
    for decode in (deltanet.deltanet_decode, deltanet.deltanet_decode_ref):
        state = s0.copy()
        outs = []
        for t in range(10):
            o = np.full((2, 1, 4, 4), np.nan, dtype)
            step = [np.ascontiguousarray(a[:, t: t + 1]) for a in (q, k, v, g, beta)]
            decode(o, state, *step, **opts)
            outs.append(o)
        np.testing.assert_allclose(np.concatenate(outs, axis=1), full_out, **tol)
        np.testing.assert_allclose(state, full_state, **tol)
    prefill = [np.ascontiguousarray(a[:, :6]) for a in (q, k, v, g, beta)]
    rest = [np.ascontiguousarray(a[:, 6:]) for a in (q, k, v, g, beta)]
    state = s0.copy()
    out6, _ = run_forward(deltanet.deltanet_forward, *prefill, state, **opts)
    deltanet.deltanet_forward(out6, state, *prefill, state, **opts)  # state_out = state_in
    out4 = np.full((2, 4, 4, 4), np.nan, dtype)
    deltanet.deltanet_decode(out4, state, *rest, **opts)
    np.testing.assert_allclose(np.concatenate([out6, out4], axis=1), full_out, **tol)
    np.testing.assert_allclose(state, full_state, **tol)


# packed rows: runs of 1 to 5 tokens, ids out of order, a padding run (-1) at the end of row 0
SEGMENTS = np.array([[4, 4, 4, 4, 4, 0, 7, 7, -1, -1, -1], [2, 9, 9, 9, 9, 9, 1, 1, 1, 3, 3]], np.int32)


def run_packed(q, k, v, g, beta, dout, segments, fns=None, **opts):
    """[out, dq, dk, dv, dg, dbeta] of packed rows (no states), NaN-prefilled."""
    forward, backward = fns or (deltanet.deltanet_forward, deltanet.deltanet_backward)
    out = np.full(v.shape, np.nan, q.dtype)
    forward(out, None, q, k, v, g, beta, None, segments, **opts)
    grads = [np.full(a.shape, np.nan, q.dtype) for a in (q, k, v, g, beta)]
    backward(*grads, None, dout, q, k, v, g, beta, None, None, segments, **opts)
    return [out, *grads]


@pytest.mark.parametrize("chunk,group", [(2, 1), (64, 32)])
@pytest.mark.parametrize("heads", ["grouped", "tiled"])
def test_deltanet_packed_rows(heads, chunk, group, monkeypatch):
    """Packed rows: each sample's outputs and gradients are those of the sample alone
    (from a zero state), and the kernel agrees with the reference (float64)."""
    monkeypatch.setattr(deltanet, "CHUNK", chunk)
    monkeypatch.setattr(deltanet, "GROUP_CHUNKS", group)
    rng = np.random.default_rng(14)
    q, k, v, g, beta, _ = dn_inputs(rng, 2, 11, 2, 4, 3, 2)
    dout = randn(rng, *v.shape, dtype=F64)
    got = run_packed(q, k, v, g, beta, dout, SEGMENTS, heads=heads)
    want = run_packed(q, k, v, g, beta, dout, SEGMENTS,
                      (deltanet.deltanet_forward_ref, deltanet.deltanet_backward_ref), heads=heads)
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, **TIGHT64)
    for b, t0, t1 in [(0, 0, 5), (0, 5, 6), (0, 6, 8), (0, 8, 11), (1, 0, 1), (1, 1, 6), (1, 9, 11)]:
        part = [np.ascontiguousarray(a[b: b + 1, t0:t1]) for a in (q, k, v, g, beta, dout)]
        alone = run_packed(*part, None, heads=heads)
        for a, w in zip(got, alone, strict=True):
            np.testing.assert_allclose(a[b: b + 1, t0:t1], w, **TIGHT64)


@pytest.mark.parametrize("fns", impls(deltanet, "deltanet_forward", "deltanet_backward"))
def test_deltanet_packed_rows_fd(fns, monkeypatch):
    monkeypatch.setattr(deltanet, "CHUNK", 3)
    rng = np.random.default_rng(15)
    q, k, v, g, beta, _ = dn_inputs(rng, 2, 11, 1, 2, 3, 2)
    dout = randn(rng, *v.shape, dtype=F64)

    def loss(q, k, v, g, beta):
        out = np.zeros_like(v)
        fns[0](out, None, q, k, v, g, beta, None, SEGMENTS)
        return np.sum(out * dout)

    grads = run_packed(q, k, v, g, beta, dout, SEGMENTS, fns)[1:]
    names = ["q", "k", "v", "g", "beta"]
    fd_check(loss, dict(zip(names, (q, k, v, g, beta))), dict(zip(names, grads)), **FD_TOL)


def test_deltanet_results_do_not_depend_on_threads():
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread only")
    rng = np.random.default_rng(5)
    ins = [a.astype(F32) for a in dn_inputs(rng, 2, 70, 2, 4, 8, 8)]
    dout, ds_out = randn(rng, 2, 70, 4, 8), randn(rng, 2, 4, 8, 8)
    before, results = numba.get_num_threads(), []
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            results.append(run_forward(deltanet.deltanet_forward, *ins)
                           + tuple(run_backward(deltanet.deltanet_backward, dout, ds_out, *ins)))
    finally:
        numba.set_num_threads(before)
    assert len(results) == 2
    for a, c in zip(results[0], results[1]):
        np.testing.assert_array_equal(a, c)


# ------------------------------------------------------------------ the causal convolution

def conv_inputs(rng, B, T, C, K, dtype=F32):
    return randn(rng, B, T, C, dtype=dtype), 0.5 * randn(rng, C, K, dtype=dtype)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("B,T,C,K", [(2, 7, 5, 4), (1, 2, 70, 4), (2, 5, 3, 1)])
def test_causal_conv_matches_ref(B, T, C, K, with_state):
    """Forward (and the state it leaves), backward (dx overwritten, dw accumulated) against
    the reference; T = 2 < K - 1 shifts the state partly; K = 1 has no state; C = 70
    spans two channel blocks of the dx kernel."""
    rng = np.random.default_rng(6)
    x, w = conv_inputs(rng, B, T, C, K)
    dout = randn(rng, B, T, C)
    state = randn(rng, B, K - 1, C) if with_state else None
    res = []
    for fwd, bwd in ((causal_conv.causal_conv_forward, causal_conv.causal_conv_backward),
                     (causal_conv.causal_conv_forward_ref, causal_conv.causal_conv_backward_ref)):
        out, st = np.full(x.shape, np.nan, F32), None if state is None else state.copy()
        fwd(out, x, w, st)
        dx, dw = np.full(x.shape, np.nan, F32), np.ones(w.shape, F32)
        bwd(dx, dw, dout, x, w, state)
        res.append([out, dx, dw] + ([] if st is None else [st]))
    for a, c in zip(*res, strict=True):
        np.testing.assert_allclose(a, c, **TOL32)


@pytest.mark.parametrize("fns", impls(causal_conv, "causal_conv_forward", "causal_conv_backward"))
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv_fd(fns, with_state):
    forward, backward = fns
    rng = np.random.default_rng(7)
    x, w = conv_inputs(rng, 2, 6, 3, 4, F64)
    dout = randn(rng, 2, 6, 3, dtype=F64)
    state = randn(rng, 2, 3, 3, dtype=F64) if with_state else None

    def loss(x, w):
        out = np.zeros_like(x)
        forward(out, x, w, None if state is None else state.copy())
        return np.sum(out * dout)

    dx, dw = np.zeros_like(x), np.zeros_like(w)
    backward(dx, dw, dout, x, w, state)
    fd_check(loss, {"x": x, "w": w}, {"x": dx, "w": dw}, **FD_TOL)


def test_causal_conv_packed_rows():
    """A packed sample's outputs and gradients (dx; dw summed over the samples) equal the
    sample alone, numba and reference; 70 rows per batch row: samples across row blocks."""
    rng = np.random.default_rng(16)
    T = 70
    x, w = conv_inputs(rng, 2, T, 5, 4, F64)
    dout = randn(rng, 2, T, 5, dtype=F64)
    seg = np.repeat(np.array([[3, 1, 4, 6, 9, 2], [6, 5, 3, 8, 7, 9]], np.int32),
                    [1, 2, 3, 30, 1, 33], axis=1)
    cuts = [0, 1, 3, 6, 36, 37, T]
    for fwd, bwd in ((causal_conv.causal_conv_forward, causal_conv.causal_conv_backward),
                     (causal_conv.causal_conv_forward_ref, causal_conv.causal_conv_backward_ref)):
        out, dx, dw = np.zeros_like(x), np.zeros_like(x), np.zeros_like(w)
        fwd(out, x, w, None, seg)
        bwd(dx, dw, dout, x, w, None, seg)
        dw_alone = np.zeros_like(w)
        for b in range(2):
            for t0, t1 in zip(cuts[:-1], cuts[1:]):
                xs, ds = np.ascontiguousarray(x[b: b + 1, t0:t1]), np.ascontiguousarray(dout[b: b + 1, t0:t1])
                o, d = np.zeros_like(xs), np.zeros_like(xs)
                fwd(o, xs, w)
                bwd(d, dw_alone, ds, xs, w)
                np.testing.assert_allclose(out[b: b + 1, t0:t1], o, **TIGHT64)
                np.testing.assert_allclose(dx[b: b + 1, t0:t1], d, **TIGHT64)
        np.testing.assert_allclose(dw, dw_alone, **TIGHT64)


@pytest.mark.parametrize("fwd", [causal_conv.causal_conv_forward, causal_conv.causal_conv_forward_ref],
                         ids=["numba", "ref"])
def test_causal_conv_decode_step_by_step_equals_full_forward(fwd):
    """From a zero state, one token at a time (and a prefill of 3 then the rest) gives the
    full forward's outputs, and the state ends as the last K - 1 inputs."""
    rng = np.random.default_rng(8)
    x, w = conv_inputs(rng, 2, 9, 6, 4)
    full = np.zeros_like(x)
    fwd(full, x, w)
    state, outs = np.zeros((2, 3, 6), F32), []
    for t in range(9):
        o = np.full((2, 1, 6), np.nan, F32)
        fwd(o, np.ascontiguousarray(x[:, t: t + 1]), w, state)
        outs.append(o)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, **TOL32)
    np.testing.assert_array_equal(state, x[:, -3:])
    state, a, b = np.zeros((2, 3, 6), F32), np.zeros((2, 3, 6), F32), np.zeros((2, 6, 6), F32)
    fwd(a, np.ascontiguousarray(x[:, :3]), w, state)
    fwd(b, np.ascontiguousarray(x[:, 3:]), w, state)
    np.testing.assert_allclose(np.concatenate([a, b], axis=1), full, **TOL32)


# ------------------------------------------------------------------ the gated norm

def norm_inputs(rng, N, D, dtype=F32):
    x, z = randn(rng, N, D, dtype=dtype), 2 * randn(rng, N, D, dtype=dtype)
    return x, z, 1 + 0.3 * randn(rng, D, dtype=dtype)


@pytest.mark.parametrize("N,D", [(5, 8), (300, 16)])
def test_gated_rmsnorm_matches_ref(N, D):
    """N = 300 spans several dw blocks."""
    rng = np.random.default_rng(9)
    x, z, w = norm_inputs(rng, N, D)
    dout = randn(rng, N, D)
    res = []
    for fwd, bwd in ((gated_norm.gated_rmsnorm_forward, gated_norm.gated_rmsnorm_backward),
                     (gated_norm.gated_rmsnorm_forward_ref, gated_norm.gated_rmsnorm_backward_ref)):
        out, rstd = np.full((N, D), np.nan, F32), np.full(N, np.nan, F32)
        fwd(out, rstd, x, z, w, 1e-6)
        dx, dz, dw = np.full((N, D), np.nan, F32), np.full((N, D), np.nan, F32), np.ones(D, F32)
        bwd(dx, dz, dw, dout, x, z, w, rstd)
        res.append([out, rstd, dx, dz, dw])
    for a, c in zip(*res, strict=True):
        np.testing.assert_allclose(a, c, **TOL32)


@pytest.mark.parametrize("fns", impls(gated_norm, "gated_rmsnorm_forward", "gated_rmsnorm_backward"))
def test_gated_rmsnorm_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(10)
    x, z, w = norm_inputs(rng, 4, 6, F64)
    dout = randn(rng, 4, 6, dtype=F64)
    out, rstd = np.zeros_like(x), np.zeros(4)

    def loss(x, z, w):
        forward(out, rstd, x, z, w, 1e-6)
        return np.sum(out * dout)

    loss(x, z, w)
    dx, dz, dw = np.zeros_like(x), np.zeros_like(z), np.zeros_like(w)
    backward(dx, dz, dw, dout, x, z, w, rstd.copy())
    fd_check(loss, {"x": x, "z": z, "w": w}, {"x": dx, "z": dz, "w": dw}, **FD_TOL)


# ------------------------------------------------------------------ argument checks

def _dn(backward=False, decode=False, **over):
    """A call of the delta rule with small valid float32 arguments, some replaced."""
    shapes = dict(q=(1, 2, 1, 4), k=(1, 2, 1, 4), v=(1, 2, 2, 3), g=(1, 2, 2), beta=(1, 2, 2))
    opts = {n: over.pop(n) for n in ("scale", "l2norm", "heads", "segments") if n in over}
    a = {n: over.get(n, zeros32(*s)) for n, s in shapes.items()}
    state = over["state"] if "state" in over else zeros32(1, 2, 4, 3)
    out = over.get("out", zeros32(1, 2, 2, 3))
    ins = [a[n] for n in ("q", "k", "v", "g", "beta")]
    if decode:
        return lambda: deltanet.deltanet_decode(out, state, *ins, **opts)
    if backward:
        grads = [over.get("d" + n, np.zeros_like(a[n])) for n in ("q", "k", "v", "g", "beta")]
        return lambda: deltanet.deltanet_backward(*grads, None, zeros32(1, 2, 2, 3), *ins, state, **opts)
    return lambda: deltanet.deltanet_forward(out, None, *ins, state, **opts)


@pytest.mark.parametrize("call,match", [
    (_dn(q=zeros32(1, 2, 4)), r"deltanet: q must be a 4-D float32 or float64 array \(B, T, NK, DK\)"),
    (_dn(v=zeros32(1, 2, 6)), r"deltanet: v must be a 4-D array \(B, T, NV, DV\)"),
    (_dn(q=zeros32(1, 2, 2, 4), k=zeros32(1, 2, 2, 4), v=zeros32(1, 2, 3, 3)),
     "deltanet: value heads 3 must be a multiple of q/k heads 2"),
    (_dn(k=np.zeros((1, 2, 1, 4))),
     r"deltanet: k must be a C-contiguous float32 array of shape \(1, 2, 1, 4\)"),
    (_dn(g=zeros32(1, 2, 1)), r"deltanet: g must be a C-contiguous float32 array of shape \(1, 2, 2\)"),
    (_dn(beta=zeros32(1, 4, 2)[:, ::2]), "deltanet: beta must be a C-contiguous"),
    (_dn(out=zeros32(1, 2, 2, 4)), r"deltanet: out must be .* \(1, 2, 2, 3\)"),
    (_dn(state=zeros32(1, 2, 3, 4)), r"deltanet: state_in must be .* \(1, 2, 4, 3\)"),
    (_dn(decode=True, state=None), r"deltanet: state must be .* got NoneType"),
    (_dn(backward=True, dg=zeros32(1, 2)), r"deltanet: dg must be .* \(1, 2, 2\)"),
    (_dn(segments=np.zeros((1, 2), np.int32)),
     "deltanet: segments .* start every sample from a zero state: no initial or final state"),
    (_dn(segments=np.zeros((1, 2), np.int64), state=None),
     r"deltanet: segments must be an int32 array of shape \(1, 2\)"),
    (_dn(backward=True, segments=np.array([[1, 2]], np.int32)), "no initial or final state"),
    (_dn(scale=0.0), "deltanet: scale must be None or a finite number > 0, got 0.0"),
    (_dn(backward=True, scale=float("inf")), "deltanet: scale must be None or a finite number > 0"),
    (_dn(decode=True, heads="interleaved"), r"deltanet: heads must be one of \('grouped', 'tiled'\)"),
    (lambda: causal_conv.causal_conv_forward(zeros32(1, 2, 3), zeros32(2, 3), zeros32(3, 4)),
     r"causal_conv: x must be a 3-D float32 or float64 array \(B, T, C\)"),
    (lambda: causal_conv.causal_conv_forward(zeros32(1, 2, 3), zeros32(1, 2, 3), zeros32(4, 4)),
     r"causal_conv: w must be a \(C, K\) array with C = 3, got float32 \(4, 4\)"),
    (lambda: causal_conv.causal_conv_forward(zeros32(1, 2, 3), zeros32(1, 2, 3), zeros32(3, 4),
                                             zeros32(1, 4, 3)), r"causal_conv: state must be .* \(1, 3, 3\)"),
    (lambda: causal_conv.causal_conv_backward(zeros32(1, 2, 3), np.zeros((3, 4)), zeros32(1, 2, 3),
                                              zeros32(1, 2, 3), zeros32(3, 4)),
     "causal_conv: dw must be a C-contiguous float32"),
    (lambda: causal_conv.causal_conv_forward(zeros32(1, 2, 3), zeros32(1, 2, 3), zeros32(3, 4),
                                             zeros32(1, 3, 3), np.zeros((1, 2), np.int32)),
     "causal_conv: segments .* take no state"),
    (lambda: causal_conv.causal_conv_backward(zeros32(1, 2, 3), zeros32(3, 4), zeros32(1, 2, 3),
                                              zeros32(1, 2, 3), zeros32(3, 4), None,
                                              np.array([[1, 2, 1]], np.int32)),
     r"causal_conv: segments must be an int32 array of shape \(1, 2\)"),
    (lambda: gated_norm.gated_rmsnorm_forward(zeros32(2, 3), zeros32(2), zeros32(6), zeros32(2, 3),
                                              zeros32(3), 1e-6),
     r"gated_norm: x must be a 2-D float32 or float64 array \(N, D\)"),
    (lambda: gated_norm.gated_rmsnorm_forward(zeros32(2, 3), zeros32(2), zeros32(2, 3), zeros32(2, 4),
                                              zeros32(3), 1e-6), r"gated_norm: z must be .* \(2, 3\)"),
    (lambda: gated_norm.gated_rmsnorm_forward(zeros32(2, 3), zeros32(2), zeros32(2, 3), zeros32(2, 3),
                                              zeros32(3), 0.0), "gated_norm: eps must be > 0, got 0.0"),
    (lambda: gated_norm.gated_rmsnorm_backward(zeros32(2, 3), zeros32(2, 3), zeros32(3), zeros32(2, 3),
                                               zeros32(2, 3), zeros32(2, 3), zeros32(3), zeros32(3)),
     r"gated_norm: rstd must be .* \(2,\)"),
])
def test_argument_checks_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ the gates

def gate_inputs(rng, N, H, dtype=F32):
    """alpha (some past softplus's threshold of 20), b, a = -exp(A_log) < 0, dt_bias."""
    alpha, b = 3 * randn(rng, N, H, dtype=dtype), 3 * randn(rng, N, H, dtype=dtype)
    alpha[0, 0] = 25.0
    a = -np.exp(randn(rng, H, dtype=dtype))
    return alpha, b, a, randn(rng, H, dtype=dtype)


def test_deltanet_gates_match_ref():
    rng = np.random.default_rng(11)
    alpha, b, a, dt = gate_inputs(rng, 40, 6)
    dg, dbeta = randn(rng, 40, 6), randn(rng, 40, 6)
    res = []
    for fwd, bwd in ((deltanet_gates.deltanet_gates_forward, deltanet_gates.deltanet_gates_backward),
                     (deltanet_gates.deltanet_gates_forward_ref, deltanet_gates.deltanet_gates_backward_ref)):
        g, beta = np.full((40, 6), np.nan, F32), np.full((40, 6), np.nan, F32)
        fwd(g, beta, alpha, b, a, dt)
        dalpha, db = np.full((40, 6), np.nan, F32), np.full((40, 6), np.nan, F32)
        da, ddt = np.ones(6, F32), np.ones(6, F32)  # accumulated
        bwd(dalpha, db, da, ddt, dg, dbeta, alpha, b, a, dt)
        res.append([g, beta, dalpha, db, da, ddt])
    for x, y in zip(*res, strict=True):
        np.testing.assert_allclose(x, y, **TOL32)
    assert (res[0][0] <= 0).all()
    np.testing.assert_allclose(res[0][0][0, 0], a[0] * (25 + dt[0]), rtol=1e-6)  # above the threshold


@pytest.mark.parametrize("fns", impls(deltanet_gates, "deltanet_gates_forward", "deltanet_gates_backward"))
def test_deltanet_gates_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(12)
    alpha, b, a, dt = gate_inputs(rng, 5, 3, F64)
    alpha[0, 0] = 1.0  # finite differences stay off the threshold's kink
    dg, dbeta = randn(rng, 5, 3, dtype=F64), randn(rng, 5, 3, dtype=F64)

    def loss(alpha, b, a, dt):
        g, beta = np.zeros_like(alpha), np.zeros_like(alpha)
        forward(g, beta, alpha, b, a, dt)
        return np.sum(g * dg) + np.sum(beta * dbeta)

    dalpha, db, da, ddt = np.zeros_like(alpha), np.zeros_like(b), np.zeros_like(a), np.zeros_like(dt)
    backward(dalpha, db, da, ddt, dg, dbeta, alpha, b, a, dt)
    fd_check(loss, dict(alpha=alpha, b=b, a=a, dt=dt), dict(alpha=dalpha, b=db, a=da, dt=ddt), **FD_TOL)


def _gates(backward=False, **over):
    arr = dict(alpha=zeros32(2, 3), b=zeros32(2, 3), a=zeros32(3), dt=zeros32(3), g=zeros32(2, 3),
               beta=zeros32(2, 3), da=zeros32(3), ddt=zeros32(3))
    arr.update(over)
    if backward:
        return lambda: deltanet_gates.deltanet_gates_backward(
            zeros32(2, 3), zeros32(2, 3), arr["da"], arr["ddt"], zeros32(2, 3), zeros32(2, 3),
            arr["alpha"], arr["b"], arr["a"], arr["dt"])
    return lambda: deltanet_gates.deltanet_gates_forward(arr["g"], arr["beta"], arr["alpha"], arr["b"],
                                                          arr["a"], arr["dt"])


@pytest.mark.parametrize("call,match", [
    (_gates(alpha=zeros32(6)), r"deltanet_gates: alpha must be a 2-D float32 or float64 array \(N, H\)"),
    (_gates(b=np.zeros((2, 3))), r"deltanet_gates: b must be a C-contiguous float32 array of shape \(2, 3\)"),
    (_gates(g=zeros32(3, 2)), r"deltanet_gates: g must be .* \(2, 3\)"),
    (_gates(dt=zeros32(2)), r"deltanet_gates: dt_bias must be .* \(3,\)"),
    (_gates(backward=True, a=None), r"deltanet_gates: a must be .* got NoneType"),
    (_gates(backward=True, da=None), "deltanet_gates: da and ddt_bias go together"),
])
def test_gates_argument_checks_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
