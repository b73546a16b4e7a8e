"""fused (kernels/fused.py, kernels/cuda/fused.py) and lora (kernels/lora.py,
kernels/cuda/lora.py): the chains the GPU runs in one launch each. The CPU functions
(the separate kernels in sequence) and the CUDA kernels against the numpy references
on whole tensors; the fused backward (CPU and reference) and the adapter's products
against float64 finite differences; the argument checks."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import CPU, CUDA, F32, F64, FD_TOL, TOL32, cases, impls, randn, zeros32

from llamatune.kernels import fused, lora, rope

MODES = [rope.ROPE_NORM, rope.ROPE_NEOX]


def tables(rng, B, T, n_rot, per_row, dtype=F32):
    """cos, sin of random positions: (T, n_rot//2), or (B, T, n_rot//2) per row."""
    n = B * T if per_row else T
    cos, sin = np.zeros((n, n_rot // 2), F32), np.zeros((n, n_rot // 2), F32)
    rope.rope_cache(cos, sin, rng.integers(0, 4096, n).astype(np.int64), n_rot, 10000.0, 1.0, None)
    shape = (B, T, n_rot // 2) if per_row else (T, n_rot // 2)
    return cos.reshape(shape).astype(dtype), sin.reshape(shape).astype(dtype)


# (B, T, NH, NKV, D, n_rot), mode, per-row tables
SHAPES_CPU = [(2, 3, 4, 2, 8, 8), (1, 4, 2, 1, 10, 6)]
SHAPES_CUDA = [(1, 2, 2, 1, 6, 4)]


@pytest.mark.parametrize("b,shape,mode,per_row", cases(
    cpu=[(s, m, p) for s in SHAPES_CPU for m in MODES for p in (False, True)],
    cuda=[(s, m, p) for s in SHAPES_CUDA for m, p in ((rope.ROPE_NORM, False), (rope.ROPE_NEOX, True))]))
def test_rope_qk_matches_ref(b, shape, mode, per_row):
    B, T, NH, NKV, D, n_rot = shape
    rng = np.random.default_rng(1)
    q, k = randn(rng, B, T, NH, D), randn(rng, B, T, NKV, D)
    cos, sin = tables(rng, B, T, n_rot, per_row)
    want_q, want_k = q.copy(), k.copy()
    fused.rope_qk_forward_ref(want_q, want_k, cos, sin, n_rot, mode)
    qd, kd = b.to(q), b.to(k)
    b.k.fused.rope_qk_forward(qd, kd, b.to(cos), b.to(sin), n_rot, mode)
    np.testing.assert_allclose(b.get(qd), want_q, **TOL32)
    np.testing.assert_allclose(b.get(kd), want_k, **TOL32)
    b.k.fused.rope_qk_backward(qd, kd, b.to(cos), b.to(sin), n_rot, mode)   # R(-theta) R(theta) = 1
    np.testing.assert_allclose(b.get(qd), q, **TOL32)
    np.testing.assert_allclose(b.get(kd), k, **TOL32)


def norm_rope_inputs(rng, B, T, NH, NKV, D, dtype=F32):
    qp, kp = 3 * randn(rng, B, T, NH, D, dtype=dtype), 3 * randn(rng, B, T, NKV, D, dtype=dtype)
    wq, wk = 1 + randn(rng, D, dtype=dtype) / 4, 1 + randn(rng, D, dtype=dtype) / 4
    return qp, wq, kp, wk


@pytest.mark.parametrize("b,shape,mode,per_row", cases(
    cpu=[(s, m, p) for s in SHAPES_CPU for m in MODES for p in (False, True)],
    cuda=[(s, m, p) for s in SHAPES_CUDA for m, p in ((rope.ROPE_NEOX, False), (rope.ROPE_NORM, True))]))
def test_qk_norm_rope_matches_ref(b, shape, mode, per_row):
    """Forward (q, k, rstd) and backward (dqp, dkp, dw accumulated onto a start value,
    dq, dk rotated back in place) on whole tensors; outputs NaN-prefilled."""
    B, T, NH, NKV, D, n_rot = shape
    rng = np.random.default_rng(2)
    qp, wq, kp, wk = norm_rope_inputs(rng, B, T, NH, NKV, D)
    cos, sin = tables(rng, B, T, n_rot, per_row)
    eps = 1e-6
    NQ, NK = B * T * NH, B * T * NKV
    want = dict(q=np.zeros_like(qp), rq=zeros32(NQ), k=np.zeros_like(kp), rk=zeros32(NK))
    fused.qk_norm_rope_forward_ref(want["q"], want["rq"], qp, wq, want["k"], want["rk"], kp, wk, cos, sin, eps,
                                   n_rot, mode)
    q, rq, k, rk = b.nan(qp.shape), b.nan((NQ,)), b.nan(kp.shape), b.nan((NK,))
    cd, sd = b.to(cos), b.to(sin)
    b.k.fused.qk_norm_rope_forward(q, rq, b.to(qp), b.to(wq), k, rk, b.to(kp), b.to(wk), cd, sd, eps, n_rot, mode)
    for name, got in (("q", q), ("rq", rq), ("k", k), ("rk", rk)):
        np.testing.assert_allclose(b.get(got), want[name], **TOL32, err_msg=name)

    dq, dk = randn(rng, *qp.shape), randn(rng, *kp.shape)
    dw0q, dw0k = randn(rng, D), randn(rng, D)
    ref = dict(dqp=np.zeros_like(qp), dwq=dw0q.copy(), dq=dq.copy(), dkp=np.zeros_like(kp), dwk=dw0k.copy(),
               dk=dk.copy())
    fused.qk_norm_rope_backward_ref(ref["dqp"], ref["dwq"], ref["dq"], qp, wq, want["rq"], ref["dkp"], ref["dwk"],
                                    ref["dk"], kp, wk, want["rk"], cos, sin, n_rot, mode)
    got = dict(dqp=b.nan(qp.shape), dwq=b.to(dw0q), dq=b.to(dq), dkp=b.nan(kp.shape), dwk=b.to(dw0k), dk=b.to(dk))
    b.k.fused.qk_norm_rope_backward(got["dqp"], got["dwq"], got["dq"], b.to(qp), b.to(wq), b.to(want["rq"]),
                                    got["dkp"], got["dwk"], got["dk"], b.to(kp), b.to(wk), b.to(want["rk"]),
                                    cd, sd, n_rot, mode)
    for name in ref:
        np.testing.assert_allclose(b.get(got[name]), ref[name], rtol=1e-5, atol=1e-5, err_msg=name)
    frozen = dict(dqp=b.nan(qp.shape), dq=b.to(dq), dkp=b.nan(kp.shape), dk=b.to(dk))   # dw None: same dx
    b.k.fused.qk_norm_rope_backward(frozen["dqp"], None, frozen["dq"], b.to(qp), b.to(wq), b.to(want["rq"]),
                                    frozen["dkp"], None, frozen["dk"], b.to(kp), b.to(wk), b.to(want["rk"]),
                                    cd, sd, n_rot, mode)
    for name in frozen:
        np.testing.assert_array_equal(b.get(frozen[name]), b.get(got[name]), err_msg=name)


@pytest.mark.parametrize("fns", impls(fused, "qk_norm_rope_forward", "qk_norm_rope_backward"))
@pytest.mark.parametrize("mode", MODES)
def test_qk_norm_rope_fd(fns, mode):
    """L = sum(q * dq) + sum(k * dk): dqp, dkp, dwq, dwk against float64 finite differences."""
    forward, backward = fns
    B, T, NH, NKV, D, n_rot = 1, 3, 2, 1, 6, 4
    rng = np.random.default_rng(4)
    qp, wq, kp, wk = norm_rope_inputs(rng, B, T, NH, NKV, D, dtype=F64)
    cos, sin = tables(rng, B, T, n_rot, False, dtype=F64)
    dq, dk = randn(rng, *qp.shape, dtype=F64), randn(rng, *kp.shape, dtype=F64)
    q, k, rq, rk = np.zeros_like(qp), np.zeros_like(kp), np.zeros(B * T * NH), np.zeros(B * T * NKV)

    def loss(qp, wq, kp, wk):
        forward(q, rq, qp, wq, k, rk, kp, wk, cos, sin, 1e-6, n_rot, mode)
        return np.sum(q * dq) + np.sum(k * dk)

    loss(qp, wq, kp, wk)                                   # rstd of the unperturbed inputs
    g = dict(qp=np.zeros_like(qp), wq=np.zeros(D), kp=np.zeros_like(kp), wk=np.zeros(D))
    backward(g["qp"], g["wq"], dq.copy(), qp, wq, rq.copy(), g["kp"], g["wk"], dk.copy(), kp, wk, rk.copy(), cos, sin,
             n_rot, mode)
    print("fd max rel err", fd_check(loss, dict(qp=qp, wq=wq, kp=kp, wk=wk), g, **FD_TOL))


@pytest.mark.parametrize("b,N,C", cases(cpu=[(3, 8), (5, 33)], cuda=[(3, 6)]))
def test_add_rmsnorm_matches_ref(b, N, C):
    rng = np.random.default_rng(5)
    s, x, w = randn(rng, N, C), randn(rng, N, C), 1 + randn(rng, C) / 4
    want_s, want, want_r = s.copy(), zeros32(N, C), zeros32(N)
    fused.add_rmsnorm_forward_ref(want, want_r, want_s, x, w, 1e-5)
    sd, out, r = b.to(s), b.nan((N, C)), b.nan((N,))
    b.k.fused.add_rmsnorm_forward(out, r, sd, b.to(x), b.to(w), 1e-5)
    np.testing.assert_array_equal(b.get(sd), want_s)          # one float32 add, the same on both
    np.testing.assert_allclose(b.get(out), want, **TOL32)
    np.testing.assert_allclose(b.get(r), want_r, **TOL32)


@pytest.mark.parametrize("b,N,C", cases(cpu=[(3, 8), (5, 33)], cuda=[(3, 6)]))
def test_rmsnorm_backward_add_matches_ref(b, N, C):
    """dx and dw accumulated onto start values (the norm's own backward is proven by finite
    differences in test_op_rmsnorm)."""
    rng = np.random.default_rng(8)
    x, w, dout = randn(rng, N, C), 1 + randn(rng, C) / 4, randn(rng, N, C)
    rstd = (1 / np.sqrt((x * x).mean(axis=1) + 1e-5)).astype(F32)
    dx0, dw0 = randn(rng, N, C), randn(rng, C)
    want_dx, want_dw = dx0.copy(), dw0.copy()
    fused.rmsnorm_backward_add_ref(want_dx, want_dw, dout, x, w, rstd, zeros32(N, C))
    dx, dw = b.to(dx0), b.to(dw0)
    b.k.fused.rmsnorm_backward_add(dx, dw, b.to(dout), b.to(x), b.to(w), b.to(rstd), b.nan((N, C)))
    np.testing.assert_allclose(b.get(dx), want_dx, **TOL32)
    np.testing.assert_allclose(b.get(dw), want_dw, rtol=1e-5, atol=1e-5)
    dx_only = b.to(dx0)                                        # dw None: a frozen weight, the same dx
    b.k.fused.rmsnorm_backward_add(dx_only, None, b.to(dout), b.to(x), b.to(w), b.to(rstd), b.nan((N, C)))
    np.testing.assert_array_equal(b.get(dx_only), b.get(dx))


# ------------------------------------------------------------------ the adapter's products

def lora_inputs(rng, N, n_in, n_out, r, dtype=F32, masked=False):
    x, A, B = randn(rng, N, n_in, dtype=dtype), randn(rng, r, n_in, dtype=dtype), randn(rng, n_out, r, dtype=dtype)
    mask = ((rng.random((N, n_in)) > 0.3) / 0.7).astype(dtype) if masked else None
    return x, A, B, mask


@pytest.mark.parametrize("b,masked,merged", cases(cpu=[(False, False), (True, False), (False, True)],
                                                  cuda=[(False, False), (True, False), (False, True)]))
def test_lora_matches_ref(b, masked, merged):
    """lora_forward (y += s xa B^T) and lora_backward (dA, dB, dx accumulated onto start
    values; dx None when merged) against the float64-product references."""
    N, n_in, n_out, r, s = 5, 7, 6, 2, 1.5
    rng = np.random.default_rng(6)
    x, A, B, mask = lora_inputs(rng, N, n_in, n_out, r, masked=masked)
    xd = x if mask is None else x * mask
    xa = xd @ A.T
    y0, dy = randn(rng, N, n_out), randn(rng, N, n_out)
    want = y0.copy()
    lora.lora_forward_ref(want, xa, B, s, None)
    y = b.to(y0)
    b.k.lora.lora_forward(y, b.to(xa), b.to(B), s, b.nan((N, n_out)))
    np.testing.assert_allclose(b.get(y), want, **TOL32)

    start = dict(dA=randn(rng, r, n_in), dB=randn(rng, n_out, r), dx=None if merged else randn(rng, N, n_in))
    ref = {k: None if v is None else v.copy() for k, v in start.items()}
    lora.lora_backward_ref(ref["dA"], ref["dB"], ref["dx"], dy, xd, xa, A, B, s, None, mask)
    got = {k: None if v is None else b.to(v) for k, v in start.items()}
    b.k.lora.lora_backward(got["dA"], got["dB"], got["dx"], b.to(dy), b.to(xd), b.to(xa), b.to(A), b.to(B), s,
                           b.nan((N, n_in)), None if mask is None else b.to(mask))
    for name in ("dA", "dB") + (() if merged else ("dx",)):
        np.testing.assert_allclose(b.get(got[name]), ref[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("fns", impls(lora, "lora_forward", "lora_backward"))
@pytest.mark.parametrize("masked", [False, True])
def test_lora_fd(fns, masked):
    """L = sum(y * dy), y = y0 + s ((x*mask) A^T) B^T: dx, dA, dB against float64 finite differences."""
    forward, backward = fns
    N, n_in, n_out, r, s = 4, 5, 3, 2, 0.75
    rng = np.random.default_rng(7)
    x, A, B, mask = lora_inputs(rng, N, n_in, n_out, r, dtype=F64, masked=masked)
    dy, y0 = randn(rng, N, n_out, dtype=F64), randn(rng, N, n_out, dtype=F64)
    m = 1.0 if mask is None else mask

    def loss(x, A, B):
        y = y0.copy()
        forward(y, (x * m) @ A.T, B, s, np.zeros_like(y))
        return np.sum(y * dy)

    g = dict(x=np.zeros_like(x), A=np.zeros_like(A), B=np.zeros_like(B))
    backward(g["A"], g["B"], g["x"], dy, x * m, (x * m) @ A.T, A, B, s, np.zeros_like(x), mask)
    print("fd max rel err", fd_check(loss, dict(x=x, A=A, B=B), g, **FD_TOL))


def _cuda_rope_qk_odd_rot():
    CUDA.k.fused.rope_qk_forward(CUDA.nan((1, 2, 2, 6)), CUDA.nan((1, 2, 1, 6)), CUDA.nan((2, 2)),
                                 CUDA.nan((2, 2)), 5, rope.ROPE_NORM)


def _cuda_rope_qk_head_size():
    CUDA.k.fused.rope_qk_forward(CUDA.nan((1, 2, 2, 6)), CUDA.nan((1, 2, 1, 4)), CUDA.nan((2, 2)),
                                 CUDA.nan((2, 2)), 4, rope.ROPE_NORM)


def _cuda_norm_rope_rstd():
    z = CUDA.nan
    CUDA.k.fused.qk_norm_rope_forward(z((1, 2, 2, 6)), z((3,)), z((1, 2, 2, 6)), z((6,)), z((1, 2, 1, 6)), z((2,)),
                                      z((1, 2, 1, 6)), z((6,)), z((2, 2)), z((2, 2)), 1e-6, 4, rope.ROPE_NEOX)


def _cuda_add_rmsnorm_host():
    CUDA.k.fused.add_rmsnorm_forward(CUDA.nan((2, 3)), CUDA.nan((2,)), zeros32(2, 3), CUDA.nan((2, 3)),
                                     CUDA.nan((3,)), 1e-5)


def _cuda_rmsnorm_backward_add_dw():
    z = CUDA.nan
    CUDA.k.fused.rmsnorm_backward_add(z((2, 3)), z((2,)), z((2, 3)), z((2, 3)), z((3,)), z((2,)), z((2, 3)))


def _qk_norm_rope_one_dw(k):
    def call():
        z = k.to(zeros32(1, 2, 2, 6)), k.to(zeros32(1, 2, 1, 6))
        k.k.fused.qk_norm_rope_backward(z[0], k.to(zeros32(6)), z[0], z[0], k.to(zeros32(6)), k.to(zeros32(4)), z[1],
                                        None, z[1], z[1], k.to(zeros32(6)), k.to(zeros32(2)), k.to(zeros32(2, 2)),
                                        k.to(zeros32(2, 2)), 4, rope.ROPE_NEOX)
    return call


def _cuda_add_rmsnorm_eps():
    CUDA.k.fused.add_rmsnorm_forward(CUDA.nan((2, 3)), CUDA.nan((2,)), CUDA.nan((2, 3)), CUDA.nan((2, 3)),
                                     CUDA.nan((3,)), 0.0)


@pytest.mark.parametrize("b,call,match", cases(cpu=[
    (lambda: fused.rope_qk_forward(zeros32(1, 2, 2, 6), zeros32(1, 2, 1, 6), zeros32(2, 2), zeros32(2, 2), 5, 0),
     "n_rot must be even"),
    (lambda: fused.add_rmsnorm_forward(zeros32(2, 3), zeros32(2), zeros32(2, 3), zeros32(2, 3), zeros32(4), 1e-5),
     "rmsnorm: w must be"),
    (_qk_norm_rope_one_dw(CPU), "fused: dwq and dwk must both be arrays or both be None"),
], cuda=[
    (_qk_norm_rope_one_dw(CUDA), "fused: dwq and dwk must both be arrays or both be None"),
    (_cuda_rope_qk_odd_rot, "fused: n_rot must be even"),
    (_cuda_rope_qk_head_size, "fused: k must be a C-contiguous float32 device array of shape"),
    (_cuda_norm_rope_rstd, r"fused: rstd_q must be a C-contiguous float32 device array of shape \(4,\)"),
    (_cuda_add_rmsnorm_host, "fused: s must be a 2-D float32 device array, got a numpy host array"),
    (_cuda_add_rmsnorm_eps, "fused: eps must be > 0"),
    (_cuda_rmsnorm_backward_add_dw, r"fused: dw must be a C-contiguous float32 device array of shape \(3,\)"),
]))
def test_argument_checks_raise(b, call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.slow
@pytest.mark.cuda
def test_cuda_step_launches_the_fused_kernels():
    """bench/cuda_launches.py on a qwen3 micro model (simulator): a layer's forward launches the
    fused kernels and no separate rope or per-head norm, its LoRA products are one cuBLAS call
    each (no scale or add of their own), and the backward rotates and norms q, k in one launch
    and computes no gradient of the frozen norm weights."""
    import collections
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).parents[1] / "bench" / "cuda_launches.py"
    res = subprocess.run([sys.executable, str(script), "--arch", "qwen3", "--detail"], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    sites = collections.defaultdict(collections.Counter)      # phase -> (kind, name) -> launches
    for line in res.stdout.splitlines():
        parts = line.split()                                   # "  layer forward  kernel  1  site [name]"
        if line.startswith("  layer ") and len(parts) >= 5:
            sites[parts[1]][parts[2], parts[-1] if len(parts) > 5 else ""] += int(parts[3])
    kernels = {ph: {n: c for (k, n), c in s.items() if k == "kernel" and n != "kernel"} for ph, s in sites.items()}
    assert kernels["forward"] == {"_rmsnorm_forward_kernel": 1, "_qk_norm_rope_kernel": 1, "_add_rmsnorm_kernel": 1,
                                  "_swiglu_forward_kernel": 1}
    assert kernels["backward"]["_qk_norm_rope_dx_kernel"] == 1 and kernels["backward"]["_rmsnorm_dx_add_kernel"] == 2
    for separate in ("_rope_kernel", "_rmsnorm_dx_kernel", "_qk_norm_dw_kernel", "_rmsnorm_dw_kernel"):
        assert separate not in kernels["backward"]             # the norm weights are frozen: no dw
    gemms = sum(c for (k, n), c in sites["forward"].items() if n == "gemm")
    assert gemms == 7                                          # q, k, v, o, gate, up, down: one each
    assert not [n for (k, n), c in sites["forward"].items() if n == "multiply"]
