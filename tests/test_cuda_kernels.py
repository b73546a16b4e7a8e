"""The CUDA kernels (llamatune.kernels.cuda) against the numpy references of their
CPU twins, on whole tensors; dequantization bit for bit against the CPU kernels
and gguf.

Runs on a GPU when one is present, else under numba's CUDA simulator: when no
GPU is found (without importing numba.cuda) and NUMBA_ENABLE_CUDASIM is unset,
the module sets it before numba.cuda is imported. The simulator runs every
CUDA thread as Python code, so the shapes here are tiny (but chosen so that the
tile loops, strided row loops and partial blocks all run).
"""
import math

import numpy as np
import pytest
from conftest_cuda import cuda_or_skip

cuda = cuda_or_skip()

import gguf  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from llamatune.kernels import (attention, cross_entropy, dequant, geglu, optim, rmsnorm, rope,  # noqa: E402
                               softcap, swiglu)
from llamatune.kernels import cuda as kc  # noqa: E402

pytestmark = pytest.mark.cuda

F32 = np.float32
TOL32 = dict(rtol=1e-5, atol=1e-6)  # GPU kernel vs numpy reference, float32
TOL_ATT = dict(rtol=1e-5, atol=2e-6)  # attention: different summation orders


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(F32)


def dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def nan_dev(shape, dtype=F32):
    return cuda.to_device(np.full(shape, np.nan, dtype))


def host(d):
    return d.copy_to_host()


# ---------------------------------------------------------------------- setup
def test_package_imports_nothing_from_numba_cuda_until_used():
    import subprocess
    import sys
    code = ("import sys, llamatune.kernels.cuda as c; "
            "print(any(m == 'numba.cuda' or m.startswith('numba.cuda.') for m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_numpy_compat_restores_row_stack(monkeypatch):
    """numba-cuda 0.30 overloads numpy.row_stack, which NumPy 2.5 removed."""
    monkeypatch.delattr(np, "row_stack", raising=False)
    kc.numpy_compat()
    assert np.row_stack is np.vstack
    kc.numpy_compat()                       # a second call leaves it as it is
    assert np.row_stack is np.vstack


def test_the_first_kernel_module_restores_row_stack():
    """The alias is in place before any kernel module imports numba.cuda, and only then:
    importing the package leaves numpy as it is."""
    import subprocess
    import sys
    code = ("import numpy as np; np.__dict__.pop('row_stack', None); "
            "import llamatune.kernels.cuda; print(hasattr(np, 'row_stack')); "
            "import llamatune.kernels.cuda.rope; print(np.row_stack is np.vstack)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "True"]


def test_simulator_or_gpu():
    from conftest_cuda import gpu_present
    assert kc.is_available()
    if not gpu_present():
        assert kc.simulator_enabled()


# -------------------------------------------------------------------- dequant
# the same random quantized blocks as the CPU dequant tests
from test_dequant import ALL_TYPES, FLOAT_TYPES, SCALE_OFFSETS, random_tensor  # noqa: E402,F401


def assert_bit_equal(actual, expected):
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


def small_cols(qtype):
    # K-quants: 2 super-blocks per row; legacy blocks and floats: 96 values
    # (a partial thread block)
    return 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96


def test_cuda_types_match_cpu():
    assert kc.dequant.CUDA_TYPES == dequant.NUMBA_TYPES


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact(qtype):
    n_rows, n_cols = 2, small_cols(qtype)
    data = random_tensor(qtype, n_rows, n_cols)
    out = nan_dev((n_rows, n_cols))
    kc.dequant.dequantize_into(dev(data), int(qtype), out)
    got = host(out)
    assert_bit_equal(got, dequant.dequantize(data, qtype, n_cols))
    want = np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(n_rows, n_cols)
    assert_bit_equal(got, want)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_dequantize_rows_gather(qtype):
    n_cols = small_cols(qtype)
    data = random_tensor(qtype, 4, n_cols, seed=1)
    rows = np.array([3, 0, 3], np.int64)
    out = nan_dev((3, n_cols))
    kc.dequant.dequantize_rows_into(dev(data), qtype, dev(rows), out)
    assert_bit_equal(host(out), dequant.dequantize(data, qtype, n_cols)[rows])


def test_f16_special_bit_patterns():
    """Zeros, subnormals (smallest, largest), normals at the edges, infs and NaN
    payloads decode like numpy's float16 -> float32 cast."""
    special = [0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x0155, 0x02AA, 0x03FF, 0x83FF,
               0x0400, 0x8400, 0x3C00, 0x3BFF, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7C01,
               0x7DFF, 0x7E00, 0x7FFF, 0xFC01, 0xFE00, 0xFFFF]
    rng = np.random.default_rng(0)
    bits = np.concatenate([special, rng.integers(0, 65536, 64 - len(special))]).astype(np.uint16)
    data = bits.view(np.uint8).reshape(1, 128)
    out = nan_dev((1, 64))
    kc.dequant.dequantize_into(dev(data), T.F16, out)
    assert_bit_equal(host(out), bits.view(np.float16).astype(np.float32).reshape(1, 64))


def test_dequant_argument_checks():
    data = random_tensor(T.Q8_0, 2, 64)
    with pytest.raises(ValueError, match="device array"):
        kc.dequant.dequantize_into(data, T.Q8_0, nan_dev((2, 64)))  # host data
    with pytest.raises(ValueError, match="bytes"):
        kc.dequant.dequantize_into(dev(data), T.Q4_0, nan_dev((2, 64)))
    with pytest.raises(ValueError, match="rows"):
        kc.dequant.dequantize_into(dev(data), T.Q8_0, nan_dev((3, 64)))
    with pytest.raises(ValueError, match="no CUDA"):
        kc.dequant.dequantize_into(dev(data), T.IQ4_NL, nan_dev((2, 64)))


# -------------------------------------------------------------------- rmsnorm
@pytest.mark.parametrize("N,C", [(3, 40), (2, 300)])  # 300 > 256 threads: strided rows
def test_rmsnorm(N, C):
    rng = np.random.default_rng(1)
    x, w, dout = randn(rng, N, C), randn(rng, C), randn(rng, N, C)
    out_ref, rstd_ref = np.zeros((N, C), F32), np.zeros(N, F32)
    rmsnorm.rmsnorm_forward_ref(out_ref, rstd_ref, x, w, 1e-5)
    out, rstd = nan_dev((N, C)), nan_dev(N)
    kc.rmsnorm.rmsnorm_forward(out, rstd, dev(x), dev(w), 1e-5)
    np.testing.assert_allclose(host(out), out_ref, **TOL32)
    np.testing.assert_allclose(host(rstd), rstd_ref, **TOL32)

    dw0 = randn(rng, C)  # dw accumulates
    dx_ref, dw_ref = np.zeros((N, C), F32), dw0.copy()
    rmsnorm.rmsnorm_backward_ref(dx_ref, dw_ref, dout, x, w, rstd_ref)
    dx, dw = nan_dev((N, C)), dev(dw0)
    kc.rmsnorm.rmsnorm_backward(dx, dw, dev(dout), dev(x), dev(w), dev(rstd_ref))
    np.testing.assert_allclose(host(dx), dx_ref, **TOL32)
    np.testing.assert_allclose(host(dw), dw_ref, **TOL32)

    xd = dev(x)  # forward in place
    kc.rmsnorm.rmsnorm_forward(xd, rstd, xd, dev(w), 1e-5)
    np.testing.assert_array_equal(host(xd), host(out))


def test_rmsnorm_argument_checks():
    x = dev(np.zeros((2, 4), F32))
    with pytest.raises(ValueError, match="w must be"):
        kc.rmsnorm.rmsnorm_forward(nan_dev((2, 4)), nan_dev(2), x, dev(np.zeros(5, F32)), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        kc.rmsnorm.rmsnorm_forward(nan_dev((2, 4)), nan_dev(2), x, dev(np.zeros(4, F32)), 0.0)
    with pytest.raises(ValueError, match="float32"):
        kc.rmsnorm.rmsnorm_forward(nan_dev((2, 4)), nan_dev(2), dev(np.zeros((2, 4))),
                                   dev(np.zeros(4, F32)), 1e-5)


# ----------------------------------------------------------------------- rope
@pytest.mark.parametrize("mode", [rope.ROPE_NORM, rope.ROPE_NEOX], ids=["norm", "neox"])
@pytest.mark.parametrize("D,n_rot", [(8, 8), (10, 6)])  # n_rot < D: pass-through dims
def test_rope(mode, D, n_rot):
    rng = np.random.default_rng(3)
    B, T, H = 1, 3, 2
    x = randn(rng, B, T, H, D)
    cos, sin = np.zeros((T, n_rot // 2), F32), np.zeros((T, n_rot // 2), F32)
    rope.rope_cache(cos, sin, np.array([0, 7, 4000], np.int64), n_rot, 10000.0, 1.0, None)
    want = np.zeros_like(x)
    rope.rope_forward_ref(want, x, cos, sin, n_rot, mode)
    out, cd, sd = nan_dev(x.shape), dev(cos), dev(sin)
    kc.rope.rope_forward(out, dev(x), cd, sd, n_rot, mode)
    got = host(out)
    np.testing.assert_allclose(got, want, **TOL32)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])
    dx_want = np.zeros_like(x)
    rope.rope_backward_ref(dx_want, got, cos, sin, n_rot, mode)
    dx = nan_dev(x.shape)
    kc.rope.rope_backward(dx, out, cd, sd, n_rot, mode)
    np.testing.assert_allclose(host(dx), dx_want, **TOL32)
    y = dev(x)  # in place, forward then backward
    kc.rope.rope_forward(y, y, cd, sd, n_rot, mode)
    np.testing.assert_array_equal(host(y), got)
    kc.rope.rope_backward(y, y, cd, sd, n_rot, mode)
    np.testing.assert_array_equal(host(y), host(dx))


@pytest.mark.parametrize("mode", [rope.ROPE_NORM, rope.ROPE_NEOX], ids=["norm", "neox"])
def test_rope_per_token_positions(mode):
    rng = np.random.default_rng(4)
    B, T, H, D, n_rot = 2, 3, 2, 8, 6
    x, dout = randn(rng, B, T, H, D), randn(rng, B, T, H, D)
    cache_cos, cache_sin = np.zeros((5, n_rot // 2), F32), np.zeros((5, n_rot // 2), F32)
    rope.rope_cache(cache_cos, cache_sin, np.arange(5, dtype=np.int64), n_rot, 1e4, 1.0, None)
    cos, sin = rope.rope_tables(cache_cos, cache_sin, np.array([[0, 1, 0], [4, 0, 1]], np.int64))
    want, dx_want = np.zeros_like(x), np.zeros_like(x)
    rope.rope_forward_ref(want, x, cos, sin, n_rot, mode)
    rope.rope_backward_ref(dx_want, dout, cos, sin, n_rot, mode)
    out, dx, cd, sd = nan_dev(x.shape), nan_dev(x.shape), dev(cos), dev(sin)
    kc.rope.rope_forward(out, dev(x), cd, sd, n_rot, mode)
    kc.rope.rope_backward(dx, dev(dout), cd, sd, n_rot, mode)
    np.testing.assert_allclose(host(out), want, **TOL32)
    np.testing.assert_allclose(host(dx), dx_want, **TOL32)


def test_rope_argument_checks():
    x = dev(np.zeros((1, 2, 1, 6), F32))
    cs = dev(np.zeros((2, 2), F32))
    with pytest.raises(ValueError, match="n_rot"):
        kc.rope.rope_forward(x, x, cs, cs, 5, rope.ROPE_NORM)
    with pytest.raises(ValueError, match="mode"):
        kc.rope.rope_forward(x, x, cs, cs, 4, 1)
    with pytest.raises(ValueError, match="cos"):
        kc.rope.rope_forward(x, x, cs, cs, 6, rope.ROPE_NORM)
    with pytest.raises(ValueError, match=r"cos must be .* \(1, 2, 2\)"):
        kc.rope.rope_forward(x, x, dev(np.zeros((2, 2, 2), F32)), cs, 4, rope.ROPE_NORM)


# ------------------------------------------------------------- swiglu, geglu
@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gate(name):
    """The elementwise gates (same calling convention): silu(g) * u and gelu_tanh(g) * u."""
    cpu, gpu = globals()[name], getattr(kc, name)
    forward, backward = getattr(gpu, name + "_forward"), getattr(gpu, name + "_backward")
    rng = np.random.default_rng(4)
    N, F = 3, 21
    g, u, dout = 4 * randn(rng, N, F), randn(rng, N, F), randn(rng, N, F)
    want = np.zeros((N, F), F32)
    getattr(cpu, name + "_forward_ref")(want, g, u)
    out = nan_dev((N, F))
    forward(out, dev(g), dev(u))
    np.testing.assert_allclose(host(out), want, **TOL32)
    dg_ref, du_ref = np.zeros((N, F), F32), np.zeros((N, F), F32)
    getattr(cpu, name + "_backward_ref")(dg_ref, du_ref, dout, g, u)
    dg, du = nan_dev((N, F)), nan_dev((N, F))
    backward(dg, du, dev(dout), dev(g), dev(u))
    np.testing.assert_allclose(host(dg), dg_ref, **TOL32)
    np.testing.assert_allclose(host(du), du_ref, **TOL32)
    gd, ud = dev(g), dev(u)  # in place: dg over g, du over u
    backward(gd, ud, dev(dout), gd, ud)
    np.testing.assert_array_equal(host(gd), host(dg))
    np.testing.assert_array_equal(host(ud), host(du))
    with pytest.raises(ValueError, match=f"{name}: u must be a C-contiguous float32 device array"):
        forward(out, dev(g), dev(u[:, :5]))


# -------------------------------------------------------------- cross-entropy
def test_cross_entropy():
    rng = np.random.default_rng(10)
    N, V = 5, 300  # V > 256 threads: strided rows
    logits = 3 * randn(rng, N, V)
    targets = np.array([0, 299, -1, 4, 17], np.int64)
    weights = np.array([0.5, 1.0, 1.0, 0.0, 0.25], F32)  # weight 0 on row 3
    want = np.zeros(N, F32)
    cross_entropy.cross_entropy_forward_ref(want, logits, targets)
    losses = nan_dev(N)
    ld, td = dev(logits), dev(targets)
    kc.cross_entropy.cross_entropy_forward(losses, ld, td)
    got = host(losses)
    np.testing.assert_allclose(got, want, **TOL32)
    assert got[2] == 0
    dl_ref = np.zeros_like(logits)
    cross_entropy.cross_entropy_backward_ref(dl_ref, logits, targets, weights)
    dl = nan_dev((N, V))
    kc.cross_entropy.cross_entropy_backward(dl, ld, td, dev(weights))
    g = host(dl)
    np.testing.assert_allclose(g, dl_ref, **TOL32)
    assert not g[[2, 3]].any()
    kc.cross_entropy.cross_entropy_backward(ld, ld, td, dev(weights))  # in place
    np.testing.assert_array_equal(host(ld), g)
    fl, fd = nan_dev(N), dev(logits)                                   # fused, in place
    kc.cross_entropy.cross_entropy_forward_backward(fl, fd, fd, td, dev(weights))
    np.testing.assert_array_equal(host(fl), got)
    np.testing.assert_array_equal(host(fd), g)


# ------------------------------------------------------------------ optimizer
def test_adamw_two_steps():
    rng = np.random.default_rng(12)
    n = 300  # two blocks, the second partial
    p, m, v = randn(rng, n), 0.1 * randn(rng, n), np.abs(randn(rng, n))
    pr, mr, vr = p.copy(), m.copy(), v.copy()
    pd, md, vd = dev(p), dev(m), dev(v)
    for t in (1, 2):
        g = randn(rng, n)
        optim.adamw_update_ref(pr, g, mr, vr, 1e-2, 0.9, 0.999, 1e-8, 0.1, t)
        kc.optim.adamw_update(pd, dev(g), md, vd, 1e-2, 0.9, 0.999, 1e-8, 0.1, t)
    np.testing.assert_allclose(host(pd), pr, **TOL32)
    np.testing.assert_allclose(host(md), mr, **TOL32)
    np.testing.assert_allclose(host(vd), vr, **TOL32)
    with pytest.raises(ValueError, match="step t"):
        kc.optim.adamw_update(pd, pd, md, vd, 1e-2, 0.9, 0.999, 1e-8, 0.1, 0)


def test_sgd_norm_scale_clip():
    rng = np.random.default_rng(13)
    n = 700
    p, g = randn(rng, n), randn(rng, n)
    pr = p.copy()
    optim.sgd_update_ref(pr, g, 0.05, 0.01)
    pd, gd = dev(p), dev(g)
    kc.optim.sgd_update(pd, gd, 0.05, 0.01)
    np.testing.assert_allclose(host(pd), pr, **TOL32)

    buf = dev(np.full(kc.optim.NORM_BUF, np.nan))
    kc.optim.global_norm_sq(buf, gd)
    want = optim.global_norm_sq_ref(g)
    np.testing.assert_allclose(host(buf)[0], want, rtol=1e-12)
    kc.optim.global_norm_sq(buf, dev(g[:5]), accumulate=True)  # a second segment
    np.testing.assert_allclose(host(buf)[0], want + optim.global_norm_sq_ref(g[:5]), rtol=1e-12)
    kc.optim.global_norm_sq(buf, dev(np.zeros(0, F32)))
    assert host(buf)[0] == 0.0

    gs = g.copy()
    optim.scale_inplace_ref(gs, 0.3)
    kc.optim.scale_inplace(gd, 0.3)
    np.testing.assert_array_equal(host(gd), gs)

    # clip: the CPU trainer's rule, g *= float32(max_norm / (norm + 1e-6)) if norm > max_norm
    gd = dev(g)
    kc.optim.global_norm_sq(buf, gd)
    norm = math.sqrt(host(buf)[0])
    kc.optim.clip_inplace(gd, buf, 2 * norm)  # below the limit: untouched
    np.testing.assert_array_equal(host(gd), g)
    kc.optim.clip_inplace(gd, buf, norm / 4)
    np.testing.assert_array_equal(host(gd), g * np.float32(norm / 4 / (norm + 1e-6)))


# ------------------------------------------------------------------ attention
def qkv(rng, B, T, NH, NKV, HS, n_past=0):
    S = n_past + T
    q = randn(rng, B, T, NH, HS)
    k_cache = randn(rng, B, S + 3, NKV, HS)  # a longer cache, sliced on the device
    v_cache = randn(rng, B, S + 3, NKV, HS)
    return q, k_cache, v_cache, S


# query blocks: None = the default (one block covers T); 2 and 3 rows: several
# blocks, a partial last block, blocks whose keys start past 0 (windows)
ATT_BLOCKS = [None, 2, 3]


@pytest.mark.parametrize("block_q", ATT_BLOCKS, ids=["default", "2", "3"])
@pytest.mark.parametrize("n_past", [0, 3])
def test_attention_forward(n_past, block_q):
    rng = np.random.default_rng(5)
    B, T, NH, NKV, HS = 1, 5, 2, 1, 4
    q, kc_, vc_, S = qkv(rng, B, T, NH, NKV, HS, n_past)
    k, v = kc_[:, :S], vc_[:, :S]
    out_ref, lse_ref = np.zeros_like(q), np.zeros((B, NH, T), F32)
    attention.attention_forward_ref(out_ref, lse_ref, q, k, v, n_past)
    out, lse = nan_dev(q.shape), nan_dev((B, NH, T))
    kd, vd = dev(kc_)[:, :S], dev(vc_)[:, :S]  # non-contiguous slices of a cache
    kc.attention.attention_forward(out, lse, dev(q), kd, vd, n_past, block_q=block_q,
                                   threads=32)
    np.testing.assert_allclose(host(out), out_ref, **TOL_ATT)
    np.testing.assert_allclose(host(lse), lse_ref, **TOL_ATT)


@pytest.mark.parametrize("block_q", ATT_BLOCKS, ids=["default", "2", "3"])
@pytest.mark.parametrize("B,T,NH,NKV,HS", [(1, 5, 2, 1, 4), (1, 4, 4, 2, 3)])  # MQA, GQA
def test_attention_backward(B, T, NH, NKV, HS, block_q):
    rng = np.random.default_rng(6)
    q, kc_, vc_, _ = qkv(rng, B, T, NH, NKV, HS)
    k, v = np.ascontiguousarray(kc_[:, :T]), np.ascontiguousarray(vc_[:, :T])
    dout = randn(rng, B, T, NH, HS)
    out, lse = np.zeros_like(q), np.zeros((B, NH, T), F32)
    attention.attention_forward_ref(out, lse, q, k, v, 0)
    dq_ref, dk_ref, dv_ref = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    attention.attention_backward_ref(dq_ref, dk_ref, dv_ref, dout, q, k, v, out, lse)
    dq, dk, dv = nan_dev(q.shape), nan_dev(k.shape), nan_dev(v.shape)
    kc.attention.attention_backward(dq, dk, dv, dev(dout), dev(q), dev(k), dev(v), dev(out),
                                    dev(lse), block_q=block_q, threads=32)
    np.testing.assert_allclose(host(dq), dq_ref, **TOL_ATT)
    np.testing.assert_allclose(host(dk), dk_ref, **TOL_ATT)
    np.testing.assert_allclose(host(dv), dv_ref, **TOL_ATT)


# packed rows: runs of one to four tokens, ids out of order, padding (-1) at the end
SEGMENTS = np.array([[4, 4, 4, 4, 0, 7, 7, -1], [2, 2, 2, 9, 9, 9, 9, 1]], np.int32)


@pytest.mark.parametrize("block_q", ATT_BLOCKS, ids=["default", "2", "3"])
def test_attention_segments(block_q):
    """Forward and backward with segments against the reference, whole tensors; the
    small blocks put sample starts inside blocks and at block edges."""
    rng = np.random.default_rng(7)
    B, T, NH, NKV, HS = 2, 8, 4, 2, 3
    q, kc_, vc_, _ = qkv(rng, B, T, NH, NKV, HS)
    k, v = np.ascontiguousarray(kc_[:, :T]), np.ascontiguousarray(vc_[:, :T])
    dout = randn(rng, B, T, NH, HS)
    out_ref, lse_ref = np.zeros_like(q), np.zeros((B, NH, T), F32)
    attention.attention_forward_ref(out_ref, lse_ref, q, k, v, 0, segments=SEGMENTS)
    grads_ref = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    attention.attention_backward_ref(*grads_ref, dout, q, k, v, out_ref, lse_ref, segments=SEGMENTS)
    kw = dict(block_q=block_q, threads=32)
    out, lse, seg = nan_dev(q.shape), nan_dev((B, NH, T)), dev(SEGMENTS)
    kc.attention.attention_forward(out, lse, dev(q), dev(k), dev(v), 0, seg, **kw)
    np.testing.assert_allclose(host(out), out_ref, **TOL_ATT)
    np.testing.assert_allclose(host(lse), lse_ref, **TOL_ATT)
    grads = [nan_dev(q.shape), nan_dev(k.shape), nan_dev(v.shape)]
    kc.attention.attention_backward(*grads, dev(dout), dev(q), dev(k), dev(v), dev(out_ref),
                                    dev(lse_ref), seg, **kw)
    for got, want in zip(grads, grads_ref):
        np.testing.assert_allclose(host(got), want, **TOL_ATT)


def test_attention_query_block():
    """A quarter of T (at least MIN_BLOCK rows, at most T), within the score budget."""
    qb = kc.attention.query_block
    assert qb(4, 32, 512, 512) == 128
    assert qb(1, 8, 100, 100) == 64
    assert qb(1, 8, 40, 40) == 40
    assert qb(1, 32, 4096, 4096) == 256                   # 2^25 / (32 * 4096)
    assert qb(64, 64, 65536, 65536) == 1                  # never 0
    for B, NH, T in [(4, 32, 512), (1, 32, 8192), (8, 8, 256)]:
        assert B * NH * qb(B, NH, T, T) * T <= kc.attention.SCORE_FLOATS


def test_attention_argument_checks():
    q = dev(np.zeros((1, 2, 3, 4), F32))
    k = dev(np.zeros((1, 2, 2, 4), F32))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        kc.attention.attention_forward(nan_dev((1, 2, 3, 4)), nan_dev((1, 3, 2)), q, k, k, 0)
    with pytest.raises(ValueError, match="n_past"):
        kc.attention.attention_forward(nan_dev((1, 2, 3, 4)), nan_dev((1, 3, 2)), q, k, k, -1)
    q, lse = dev(np.zeros((1, 2, 2, 4), F32)), nan_dev((1, 2, 2))
    with pytest.raises(ValueError, match=r"segments must be a C-contiguous int32 device array of shape \(1, 2\)"):
        kc.attention.attention_forward(nan_dev((1, 2, 2, 4)), lse, q, k, k, 0, dev(np.zeros((1, 2), np.int64)))
    with pytest.raises(ValueError, match="segments need n_past = 0"):
        kc.attention.attention_forward(nan_dev((1, 1, 2, 4)), nan_dev((1, 2, 1)), q[:, :1], k, k, 1,
                                       dev(np.zeros((1, 1), np.int32)))


# ------------------------------------------- ops of the newer architectures
def test_softcap():
    rng = np.random.default_rng(31)
    N, V, cap = 2, 300, 30.0  # 600 values: three blocks, the last partial
    x, dy = 50 * randn(rng, N, V), randn(rng, N, V)
    want, dx_ref = np.zeros_like(x), np.zeros_like(x)
    softcap.softcap_forward_ref(want, x, cap)
    softcap.softcap_backward_ref(dx_ref, dy, want, cap)
    y, dx = nan_dev((N, V)), nan_dev((N, V))
    kc.softcap.softcap_forward(y, dev(x), cap)
    np.testing.assert_allclose(host(y), want, **TOL32)
    kc.softcap.softcap_backward(dx, dev(dy), y, cap)
    np.testing.assert_allclose(host(dx), dx_ref, **TOL32)
    xd, dyd = dev(x), dev(dy)  # in place, as on the logits chunk
    kc.softcap.softcap_forward(xd, xd, cap)
    np.testing.assert_array_equal(host(xd), host(y))
    kc.softcap.softcap_backward(dyd, dyd, xd, cap)
    np.testing.assert_array_equal(host(dyd), host(dx))
    with pytest.raises(ValueError, match="softcap: cap must be a finite number > 0"):
        kc.softcap.softcap_forward(y, xd, -1.0)
    with pytest.raises(ValueError, match="softcap: x must be a C-contiguous float32 device array"):
        kc.softcap.softcap_forward(y, x, cap)  # host array
    with pytest.raises(ValueError, match="softcap: y must be a float32 device array"):
        kc.softcap.softcap_forward(dev(np.zeros((N, V))), xd, cap)


def test_per_head_rmsnorm_on_the_head_view():
    """qwen3/gemma3 q/k norm: rmsnorm on q (N, n_head, head_dim) viewed as
    (N * n_head, head_dim) with a (head_dim,) weight, against the per-head formula."""
    rng = np.random.default_rng(32)
    N, NH, HD, eps = 3, 4, 8, 1e-6
    x, w, dout = randn(rng, N, NH, HD), randn(rng, HD), randn(rng, N, NH, HD)
    x64 = x.astype(np.float64)
    r = 1 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    out, rstd = nan_dev((N * NH, HD)), nan_dev(N * NH)
    kc.rmsnorm.rmsnorm_forward(out, rstd, dev(x.reshape(N * NH, HD)), dev(w), eps)
    np.testing.assert_allclose(host(out).reshape(N, NH, HD), x64 * r * w, **TOL32)
    dx_ref, dw_ref = np.zeros((N * NH, HD), F32), np.zeros(HD, F32)
    rmsnorm.rmsnorm_backward_ref(dx_ref, dw_ref, dout.reshape(N * NH, HD), x.reshape(N * NH, HD),
                                 w, host(rstd))
    dx, dw = nan_dev((N * NH, HD)), dev(np.zeros(HD, F32))
    kc.rmsnorm.rmsnorm_backward(dx, dw, dev(dout.reshape(N * NH, HD)), dev(x.reshape(N * NH, HD)),
                                dev(w), rstd)
    np.testing.assert_allclose(host(dx), dx_ref, **TOL32)
    np.testing.assert_allclose(host(dw), np.sum(dout * x64 * r, axis=(0, 1)), **TOL32)


# scale / softcap / window alone and together; windows of 1, across blocks, >= S
ATT_OPTIONS = [dict(window=1), dict(window=3, softcap=2.0), dict(scale=0.4, softcap=1.5),
               dict(scale=0.6, softcap=2.5, window=2)]
ATT_OPT_IDS = ["w1", "w3-cap", "scale-cap", "all"]


def _att_ref(q, k, v, n_past, dout=None, segments=None, **opts):
    out, lse = np.zeros_like(q), np.zeros((q.shape[0], q.shape[2], q.shape[1]), F32)
    attention.attention_forward_ref(out, lse, q, k, v, n_past, segments, **opts)
    res = [out, lse]
    if dout is not None:
        grads = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
        attention.attention_backward_ref(*grads, dout, q, k, v, out, lse, segments, **opts)
        res += grads
    return res


@pytest.mark.parametrize("block_q", [None, 3], ids=["default", "3"])
@pytest.mark.parametrize("opts", ATT_OPTIONS, ids=ATT_OPT_IDS)
def test_attention_options(opts, block_q):
    """Forward after a cache (n_past = 3) and forward + backward (n_past = 0) with the
    gemma options, whole tensors against the reference."""
    rng = np.random.default_rng(33)
    B, T, NH, NKV, HS = 1, 5, 2, 1, 4
    kw = dict(block_q=block_q, threads=32, **opts)
    q, kc_, vc_, S = qkv(rng, B, T, NH, NKV, HS, 3)
    q *= 2  # large scores, so that the cap matters
    out_ref, lse_ref = _att_ref(q, kc_[:, :S], vc_[:, :S], 3, **opts)
    out, lse = nan_dev(q.shape), nan_dev((B, NH, T))
    kc.attention.attention_forward(out, lse, dev(q), dev(kc_)[:, :S], dev(vc_)[:, :S], 3, **kw)
    np.testing.assert_allclose(host(out), out_ref, **TOL_ATT)
    np.testing.assert_allclose(host(lse), lse_ref, **TOL_ATT)

    k, v = np.ascontiguousarray(kc_[:, :T]), np.ascontiguousarray(vc_[:, :T])
    dout = randn(rng, B, T, NH, HS)
    want = _att_ref(q, k, v, 0, dout, **opts)
    out, lse = nan_dev(q.shape), nan_dev((B, NH, T))
    kc.attention.attention_forward(out, lse, dev(q), dev(k), dev(v), 0, **kw)
    grads = [nan_dev(q.shape), nan_dev(k.shape), nan_dev(v.shape)]
    kc.attention.attention_backward(*grads, dev(dout), dev(q), dev(k), dev(v), dev(want[0]),
                                    dev(want[1]), **kw)
    for got, ref in zip([out, lse, *grads], want):
        np.testing.assert_allclose(host(got), ref, **TOL_ATT)


def test_attention_options_with_segments():
    """Packed rows with a window and soft-capping: the window counts within each
    sample; small blocks put window edges and sample starts inside and across blocks."""
    rng = np.random.default_rng(34)
    B, T, NH, NKV, HS = 2, 8, 2, 1, 3
    opts = dict(scale=0.8, softcap=2.0, window=2)
    q, kc_, vc_, _ = qkv(rng, B, T, NH, NKV, HS)
    k, v = np.ascontiguousarray(kc_[:, :T]), np.ascontiguousarray(vc_[:, :T])
    dout = randn(rng, B, T, NH, HS)
    want = _att_ref(q, k, v, 0, dout, SEGMENTS, **opts)
    kw = dict(block_q=2, threads=32, **opts)
    seg = dev(SEGMENTS)
    out, lse = nan_dev(q.shape), nan_dev((B, NH, T))
    kc.attention.attention_forward(out, lse, dev(q), dev(k), dev(v), 0, seg, **kw)
    grads = [nan_dev(q.shape), nan_dev(k.shape), nan_dev(v.shape)]
    kc.attention.attention_backward(*grads, dev(dout), dev(q), dev(k), dev(v), dev(want[0]),
                                    dev(want[1]), seg, **kw)
    for got, ref in zip([out, lse, *grads], want):
        np.testing.assert_allclose(host(got), ref, **TOL_ATT)


def test_attention_option_defaults_are_the_plain_path():
    """scale = 1/sqrt(HS) given, softcap 0 and a window >= S run the default
    arithmetic: the same bits as no options."""
    rng = np.random.default_rng(35)
    B, T, NH, NKV, HS = 1, 4, 2, 1, 4
    q, kc_, vc_, _ = qkv(rng, B, T, NH, NKV, HS)
    k, v, dout = dev(kc_[:, :T]), dev(vc_[:, :T]), dev(randn(rng, B, T, NH, HS))
    results = []
    for opts in ({}, dict(scale=0.5, softcap=0.0, window=T)):
        out, lse = nan_dev(q.shape), nan_dev((B, NH, T))
        kc.attention.attention_forward(out, lse, dev(q), k, v, 0, block_q=2,
                                       threads=32, **opts)
        grads = [nan_dev(q.shape), nan_dev(k.shape), nan_dev(v.shape)]
        kc.attention.attention_backward(*grads, dout, dev(q), k, v, out, lse, block_q=2,
                                        threads=32, **opts)
        results.append([host(a) for a in (out, lse, *grads)])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_attention_option_checks():
    q, k = dev(np.zeros((1, 2, 2, 4), F32)), dev(np.zeros((1, 2, 1, 4), F32))
    out, lse = nan_dev((1, 2, 2, 4)), nan_dev((1, 2, 2))
    with pytest.raises(ValueError, match="attention: scale must be None or a finite number > 0"):
        kc.attention.attention_forward(out, lse, q, k, k, 0, scale=-1.0)
    with pytest.raises(ValueError, match="attention: softcap must be a finite number >= 0"):
        kc.attention.attention_forward(out, lse, q, k, k, 0, softcap=float("inf"))
    with pytest.raises(ValueError, match=r"attention: window must be an integer >= 0"):
        kc.attention.attention_backward(q, k, k, q, q, k, k, q, lse, window=-2)


def test_backend_registers_geglu_and_softcap():
    """The CUDA backend exposes the new families as ops.geglu and ops.softcap; in the
    simulator they work in place on the numpy arrays that serve as device memory."""
    from llamatune.backend import OPS, get_backend
    assert {"geglu", "softcap"} <= set(OPS)
    if not kc.simulator_enabled():
        pytest.skip("a real GPU: the backend's arrays are CuPy arrays (test_cuda_e2e)")
    ops = get_backend("cuda").ops
    rng = np.random.default_rng(36)
    x = 20 * randn(rng, 2, 40)
    want = np.zeros_like(x)
    softcap.softcap_forward_ref(want, x, 10.0)
    ops.softcap.softcap_forward(x, x, 10.0)
    np.testing.assert_allclose(x, want, **TOL32)
    g, u = randn(rng, 2, 40), randn(rng, 2, 40)
    geglu.geglu_forward_ref(want, g, u)
    ops.geglu.geglu_forward(g, g, u)
    np.testing.assert_allclose(g, want, **TOL32)


# ------------------------------------------------- the real (non-simulated) compiler
_PTX_SCRIPT = """
import re, sys
from conftest_cuda import compile_all_ptx
try:
    ptx = compile_all_ptx()
except Exception as e:
    missing = ("DynamicLibNotFoundError", "NvvmSupportError", "NvrtcSupportError",
               "CudaSupportError")
    if type(e).__name__ not in missing:  # a real compile error: fail
        raise
    print("NO-TOOLKIT", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    sys.exit(0)
for name, text in ptx.items():
    print(name, "|", len(re.findall(r"\\bfma\\.rn\\.f32", text)), "|",
          len(re.findall(r"\\bmul\\.rn\\.f32", text)))
"""


def test_kernels_compile_to_ptx_without_fma_in_dequant():
    """Every kernel goes through numba-cuda's real pipeline (typing, lowering, NVVM)
    to PTX, which the simulator never exercises; the dequant kernels contain no
    fma.rn.f32 (fmul = __nv_fmul_rn keeps NVVM from contracting d*q + m). Needs
    NVVM + NVRTC (CUDA toolkit, or the nvidia-cuda-nvcc/nvrtc wheels via
    CUDA_HOME), not a GPU; skipped without them."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                      env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    if res.stdout.startswith("NO-TOOLKIT"):
        pytest.skip(f"no CUDA compiler libraries to build PTX with: {res.stdout.strip()}")
    rows = [line.split(" | ") for line in res.stdout.strip().splitlines()]
    # dequant (plain, gather) per type; 19 elementwise, norm, loss and optimizer kernels;
    # attention: softmax forward and backward x (plain, packed) x (plain, capped); starts
    assert len(rows) == 2 * len(kc.dequant.CUDA_TYPES) + 19 + 9
    for name, n_fma, n_mul in rows:
        if name.startswith("dequant"):
            assert n_fma == "0", name
            if "Q" in name:
                assert int(n_mul) >= 1, name
