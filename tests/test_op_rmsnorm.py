"""rmsnorm (kernels/rmsnorm.py, kernels/cuda/rmsnorm.py): the CPU and CUDA kernels
against the numpy reference on whole tensors (dx overwritten, dw accumulated, in
place), the forward bit for bit against ggml's, the backward (numba and reference)
against float64 finite differences, the per-head q/k norm of qwen3/gemma3 on the
head view, and the argument checks."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import CUDA, F32, F64, FD_TOL, TOL32, cases, impls, randn, zeros32

from llamatune.kernels import rmsnorm


@pytest.mark.parametrize("b,N,C", cases(cpu=[(1, 1), (3, 5), (7, 130)],  # 130: three dw column blocks
                                        cuda=[(3, 40), (2, 300)]))  # 300 > 256 threads: strided rows
def test_rmsnorm_matches_ref(b, N, C):
    rng = np.random.default_rng(1)
    x, w, dout = randn(rng, N, C), randn(rng, C), randn(rng, N, C)
    out_ref, rstd_ref = np.zeros((N, C), F32), np.zeros(N, F32)
    rmsnorm.rmsnorm_forward_ref(out_ref, rstd_ref, x, w, 1e-5)
    out, rstd = b.nan((N, C)), b.nan(N)
    b.k.rmsnorm.rmsnorm_forward(out, rstd, b.to(x), b.to(w), 1e-5)
    # CPU: the same float ops but the sum order; CUDA: a tree sum
    np.testing.assert_allclose(b.get(rstd), rstd_ref, **(TOL32 if b.cuda else dict(rtol=1e-6)))
    np.testing.assert_allclose(b.get(out), out_ref, **TOL32)
    # dx is overwritten (NaN prefill), dw accumulated onto what is there (twice)
    dw0 = randn(rng, C)
    dx_ref, dw_ref = np.zeros((N, C), F32), dw0.copy()
    rmsnorm.rmsnorm_backward_ref(dx_ref, dw_ref, dout, x, w, b.get(rstd))
    dx, dw, args = b.nan((N, C)), b.to(dw0), (b.to(dout), b.to(x), b.to(w), rstd)
    b.k.rmsnorm.rmsnorm_backward(dx, dw, *args)
    np.testing.assert_allclose(b.get(dx), dx_ref, **TOL32)
    np.testing.assert_allclose(b.get(dw), dw_ref, **TOL32)
    b.k.rmsnorm.rmsnorm_backward(dx, dw, *args)
    rmsnorm.rmsnorm_backward_ref(dx_ref, dw_ref, dout, x, w, b.get(rstd))
    np.testing.assert_allclose(b.get(dw), dw_ref, **TOL32)
    xd = b.to(x)  # forward in place
    b.k.rmsnorm.rmsnorm_forward(xd, rstd, xd, b.to(w), 1e-5)
    np.testing.assert_array_equal(b.get(xd), b.get(out))


def test_rmsnorm_forward_mirrors_ggml_bit_for_bit():
    rng = np.random.default_rng(15)
    x, w, eps = randn(rng, 4, 33), randn(rng, 33), F32(1e-6)
    out, rstd = zeros32(4, 33), zeros32(4)
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


# ------------------------------------------------------------- per-head q/k RMSNorm

def per_head_norm_ref(x, w, eps):
    """qwen3 / gemma3 q_norm, k_norm: each head vector x[n, h] (head_dim,) normalised
    by its own RMS, times the (head_dim,) weight; in float64."""
    x = x.astype(F64)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


@pytest.mark.parametrize("b,N,NH,seed", cases(cpu=[(5, 3, 15)], cuda=[(3, 4, 32)]))
def test_per_head_rmsnorm_is_rmsnorm_on_the_head_view(b, N, NH, seed):
    """q (N, n_head, head_dim) viewed as (N * n_head, head_dim) with a (head_dim,)
    weight: the forward is the per-head norm; the backward's dw sums over tokens and
    heads."""
    rng = np.random.default_rng(seed)
    HD, eps = 8, 1e-6
    x, w, dout = randn(rng, N, NH, HD), randn(rng, HD), randn(rng, N, NH, HD)
    out, rstd = b.nan((N * NH, HD)), b.nan(N * NH)
    b.k.rmsnorm.rmsnorm_forward(out, rstd, b.to(x.reshape(N * NH, HD)), b.to(w), eps)
    np.testing.assert_allclose(b.get(out).reshape(N, NH, HD), per_head_norm_ref(x, w, eps), **TOL32)
    dx_ref, dw_ref = zeros32(N * NH, HD), zeros32(HD)
    rmsnorm.rmsnorm_backward_ref(dx_ref, dw_ref, dout.reshape(N * NH, HD), x.reshape(N * NH, HD),
                                 w, b.get(rstd))
    dx, dw = b.nan((N * NH, HD)), b.to(zeros32(HD))
    b.k.rmsnorm.rmsnorm_backward(dx, dw, b.to(dout.reshape(N * NH, HD)), b.to(x.reshape(N * NH, HD)),
                                 b.to(w), rstd)
    np.testing.assert_allclose(b.get(dx), dx_ref, **TOL32)
    # dw of the per-head form: sum over tokens and heads of dout * x / rms
    r = 1 / np.sqrt(np.mean(x.astype(F64) ** 2, axis=-1, keepdims=True) + eps)
    np.testing.assert_allclose(b.get(dw), np.sum(dout * x * r, axis=(0, 1)), **TOL32)


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

def _cuda_forward(x=(2, 4), w=4, eps=1e-5, dtype=F32):
    k, to = CUDA.k, CUDA.to
    return lambda: k.rmsnorm.rmsnorm_forward(CUDA.nan((2, 4)), CUDA.nan(2), to(np.zeros(x, dtype)),
                                             to(zeros32(w)), eps)


@pytest.mark.parametrize("b,call,match", cases(cpu=[
    (lambda: rmsnorm.rmsnorm_forward(zeros32(2, 3), zeros32(2), zeros32(2, 3, 1), zeros32(3), 1e-5),
     "x must be a 2-D"),
    (lambda: rmsnorm.rmsnorm_forward(zeros32(2, 3), zeros32(3), zeros32(2, 3), zeros32(3), 1e-5),
     r"rstd must be .* \(2,\)"),
    (lambda: rmsnorm.rmsnorm_forward(zeros32(2, 3), zeros32(2), zeros32(2, 3), zeros32(3), 0.0),
     "eps must be > 0"),
    (lambda: rmsnorm.rmsnorm_backward(zeros32(2, 3), np.zeros(3), zeros32(2, 3), zeros32(2, 3),
                                      zeros32(3), zeros32(2)), "dw must be a C-contiguous float32"),
], cuda=[
    (lambda: _cuda_forward(w=5)(), "w must be"),
    (lambda: _cuda_forward(eps=0.0)(), "eps"),
    (lambda: _cuda_forward(dtype=F64)(), "float32"),
]))
def test_argument_checks_raise(b, call, match):
    with pytest.raises(ValueError, match=match):
        call()
