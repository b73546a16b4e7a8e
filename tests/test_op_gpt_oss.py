"""gpt-oss's kernels: the clamped SwiGLU (kernels/swiglu_oai.py), attention sinks
(kernels/attention_sinks.py), YaRN rope tables (kernels/rope_yarn.py) and the experts'
biases and gate in the grouped expert kernels (kernels/moe.py). Each forward against its
definition (HF's and ggml's formulas), each backward against float64 finite differences:
the clamp on both sides of its limit, the sinks through attention's own backward."""
import math

import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import F32, F64, FD_TOL, randn

from llamatune.kernels import moe as kmoe
from llamatune.kernels.attention import attention_backward, attention_forward
from llamatune.kernels.attention_sinks import attention_sinks_forward_ref, sinks_backward, sinks_forward
from llamatune.kernels.rope_yarn import attn_factor, corr_dims, rope_cache_yarn
from llamatune.kernels.swiglu_oai import (LIMIT, swiglu_oai_backward, swiglu_oai_backward_ref, swiglu_oai_forward,
                                          swiglu_oai_forward_ref)


def gate_inputs(rng, n=6, f=40, dtype=F64):
    """g, u spread over [-11, 11], none within 0.01 of the clamp's limits (finite differences
    of 1e-6 stay on one side), and at least a few beyond them."""
    g, u = (rng.uniform(-11, 11, (n, f)) for _ in range(2))
    for a in (g, u):
        a[np.abs(np.abs(a) - LIMIT) < 0.01] += 0.05
    assert (g > LIMIT).sum() > 5 and (np.abs(u) > LIMIT).sum() > 5 and (g < LIMIT).sum() > 50
    return g.astype(dtype), u.astype(dtype)


def test_swiglu_oai_forward_is_hf_and_ggml():
    g, u = gate_inputs(np.random.default_rng(0))
    out = np.empty_like(g)
    swiglu_oai_forward(out, g, u)
    alpha = float(np.float32(1.702))
    x, y = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)                  # HF's _apply_gate
    np.testing.assert_allclose(out, x * (1 / (1 + np.exp(-alpha * x))) * (y + 1), rtol=1e-13)
    ref = np.empty_like(g)
    swiglu_oai_forward_ref(ref, g, u)
    np.testing.assert_allclose(out, ref, rtol=1e-13)
    g32, u32, o32 = g.astype(F32), u.astype(F32), np.empty(g.shape, F32)
    swiglu_oai_forward(o32, g32, u32)
    np.testing.assert_allclose(o32, out, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["numba", "ref"])
def test_swiglu_oai_backward_fd_both_sides_of_the_clamp(impl):
    rng = np.random.default_rng(1)
    g, u = gate_inputs(rng)
    dout = randn(rng, *g.shape, dtype=F64)
    fwd, bwd = (swiglu_oai_forward, swiglu_oai_backward) if impl == "numba" else \
        (swiglu_oai_forward_ref, swiglu_oai_backward_ref)
    dg, du = np.empty_like(g), np.empty_like(u)
    bwd(dg, du, dout, g, u)
    assert (dg[g > LIMIT] == 0).all() and (du[np.abs(u) > LIMIT] == 0).all()
    assert np.abs(dg[g < LIMIT]).min() >= 0 and np.abs(du[np.abs(u) < LIMIT]).max() > 0

    def loss(g, u):
        out = np.empty_like(g)
        fwd(out, g, u)
        return float((out * dout).sum())
    tol = dict(rtol=1e-6, atol=1e-7)     # outputs up to ~60: L's rounding over 2 eps is ~1e-8
    assert fd_check(loss, dict(g=g, u=u), dict(g=dg, u=du), **tol) <= tol["rtol"]


# ------------------------------------------------------------------ sinks
B, T, NH, NKV, HS = 2, 9, 4, 2, 8


def attention_inputs(rng, dtype=F64):
    q, k, v = randn(rng, B, T, NH, HS, dtype=dtype), randn(rng, B, T, NKV, HS, dtype=dtype), \
        randn(rng, B, T, NKV, HS, dtype=dtype)
    return q, k, v, np.array([0.5, -1.0, 2.0, 0.0], dtype)


@pytest.mark.parametrize("window", [0, 3])
def test_sinks_forward_is_the_sink_column(window):
    q, k, v, sinks = attention_inputs(np.random.default_rng(2))
    out, lse = np.empty_like(q), np.empty((B, NH, T))
    attention_forward(out, lse, q, k, v, 0, window=window)
    sinks_forward(out, lse, sinks)
    want, want_lse = np.empty_like(q), np.empty((B, NH, T))
    attention_sinks_forward_ref(want, want_lse, q, k, v, sinks, window=window)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    plain = np.empty_like(q)
    attention_forward(plain, np.empty((B, NH, T)), q, k, v, 0, window=window)
    assert np.abs(plain - out).max() > 0.05                                 # the sinks matter


@pytest.mark.parametrize("window", [0, 3])
def test_sinks_backward_fd(window):
    """dq, dk, dv from attention's backward on what the sinks left, dsinks from
    sinks_backward: all against finite differences of the attention with sinks."""
    rng = np.random.default_rng(3)
    q, k, v, sinks = attention_inputs(rng)
    dout = randn(rng, B, T, NH, HS, dtype=F64)
    out, lse = np.empty_like(q), np.empty((B, NH, T))
    attention_forward(out, lse, q, k, v, 0, window=window)
    sinks_forward(out, lse, sinks)
    dq, dk, dv, ds = np.empty_like(q), np.empty_like(k), np.empty_like(v), np.zeros(NH)
    attention_backward(dq, dk, dv, dout, q, k, v, out, lse, window=window)
    sinks_backward(ds, dout, out, lse, sinks)

    def loss(q, k, v, sinks):
        o, l = np.empty_like(q), np.empty((B, NH, T))
        attention_sinks_forward_ref(o, l, q, k, v, sinks, window=window)
        return float((o * dout).sum())
    worst = fd_check(loss, dict(q=q, k=k, v=v, sinks=sinks), dict(q=dq, k=dk, v=dv, sinks=ds), **FD_TOL)
    assert worst <= FD_TOL["rtol"] and np.abs(ds).min() > 0


# ------------------------------------------------------------------ YaRN
def test_yarn_tables_are_ggml_rope_yarn():
    """gpt-oss-20b's rope (head 64, base 150000, factor 32 over 4096): the ramp's pairs,
    the magnitude HF's attention_factor (0.1 ln 32 + 1) and each angle the mix of the
    interpolated and extrapolated ones, as ggml's rope_yarn (float64 formula here)."""
    n_rot, base, scale, orig = 64, 150000.0, 1 / 32, 4096
    low, high = corr_dims(n_rot, orig, base)

    def dim(rot):
        return n_rot * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    assert (low, high) == (math.floor(dim(32)), math.ceil(dim(1))) == (8, 18)
    pos = np.array([0, 1, 7, 130, 5000], np.int64)
    cos, sin = np.empty((5, 32), F32), np.empty((5, 32), F32)
    rope_cache_yarn(cos, sin, pos, n_rot, base, scale, orig, 1.0, attn_factor(scale))
    i = np.arange(32)
    extrap = pos[:, None] * base ** (-2.0 * i / n_rot)
    mix = 1 - np.clip((i - low) / (high - low), 0, 1)
    theta = extrap * scale * (1 - mix) + extrap * mix
    m = 0.1 * math.log(32) + 1
    # ggml's float32 running product theta *= theta_scale: the angle's error grows with
    # the position and the pair (one rounding a step)
    bound = m * (np.abs(theta) * (i + 2) * 1.2e-7 + 1e-6)
    assert (np.abs(cos - m * np.cos(theta)) <= bound).all() and (np.abs(sin - m * np.sin(theta)) <= bound).all()
    assert attn_factor(scale) * (1 + 0.1 * math.log(32)) == pytest.approx(m, rel=1e-6)


# ------------------------------------------------------------------ experts with biases
N, C, F, E, K = 7, 6, 5, 8, 2


def test_expert_biases_and_gate_forward_and_fd():
    """kernels/moe.py with gpt-oss's hooks: each expert's projections plus its biases and
    the clamped gate, against a per-token loop; the backward (x, router weights, per-expert
    LoRA) by finite differences, the biases frozen."""
    rng = np.random.default_rng(4)
    x = 2 * randn(rng, N, C, dtype=F64)
    wg, wu = (2 * randn(rng, E, F, C, dtype=F64) for _ in range(2))     # gates and ups past the limit
    wd = 0.1 * randn(rng, E, C, F, dtype=F64)
    bias = {"gate": randn(rng, E, F, dtype=F64), "up": randn(rng, E, F, dtype=F64), "down": randn(rng, E, C, dtype=F64)}
    idx = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.int64)
    w = rng.uniform(0.2, 0.8, (N, K))
    lora = {p: kmoe.ExpertLora(randn(rng, E, 2, n_in, dtype=F64) * 0.3, randn(rng, E, n_out, 2, dtype=F64) * 0.3, 0.7,
                               np.zeros((E, 2, n_in)), np.zeros((E, n_out, 2)))
            for p, n_out, n_in in (("gate", F, C), ("up", F, C), ("down", C, F))}
    gate = (swiglu_oai_forward, swiglu_oai_backward)

    def forward(x, w, **ab):
        lo = {p: kmoe.ExpertLora(ab[p + "_a"], ab[p + "_b"], 0.7) for p in lora} if ab else lora
        out = np.empty_like(x)
        rows = kmoe.moe_ffn_forward(out, x, idx, w, wg, wu, wd, lora=lo, bias=bias, gate=gate)
        return out, rows
    out, rows = forward(x, w)
    want = np.zeros_like(x)
    for t in range(N):
        for s in range(K):
            e = idx[t, s]

            def proj(p, v, W):
                return v @ W[e].T + 0.7 * (v @ lora[p].a[e].T) @ lora[p].b[e].T + bias[p][e]
            h = np.empty((1, F))
            swiglu_oai_forward_ref(h, proj("gate", x[t:t + 1], wg), proj("up", x[t:t + 1], wu))
            want[t] += w[t, s] * proj("down", h, wd)[0]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    assert (rows.g > LIMIT).any() or (np.abs(rows.u) > LIMIT).any()         # the clamp is met

    dout = randn(rng, N, C, dtype=F64)
    dx, dw = np.empty_like(x), np.empty_like(w)
    kmoe.moe_ffn_backward(dx, dw, None, None, None, dout, x, w, wg, wu, wd, rows, lora=lora, bias=bias, gate=gate)
    params = {f"{p}_{s}": getattr(lora[p], s) for p in lora for s in "ab"}
    grads = {f"{p}_{s}": getattr(lora[p], "d" + s) for p in lora for s in "ab"}

    def loss(x, w, **ab):
        return float((forward(x, w, **ab)[0] * dout).sum())
    tol = dict(rtol=1e-6, atol=1e-7)     # gradients up to ~20: L's rounding over 2 eps is ~1e-8
    worst = fd_check(loss, dict(x=x, w=w, **params), dict(x=dx, w=dw, **grads), **tol)
    assert worst <= tol["rtol"]
