"""The optimizer kernels (kernels/optim.py, kernels/cuda/optim.py): AdamW on the CPU
(numba and reference) and CUDA kernels against a hand-written float64 loop; SGD,
the global gradient norm, scaling and clipping against the references; and the
argument checks. (The learning-rate schedule is tested in test_optimizer.py.)"""
import math

import numpy as np
import pytest
from op_helpers import CUDA, F32, F64, TOL32, cases, randn, zeros32

from llamatune.kernels import optim


@pytest.mark.parametrize("b,n,ref", cases(cpu=[(37, False), (37, True)],
                                          cuda=[(300, False)]))  # 300: two blocks, the second partial
def test_adamw_two_steps_match_hand_written_loop(b, n, ref):
    update = optim.adamw_update_ref if ref else b.k.optim.adamw_update
    rng = np.random.default_rng(12)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    p0, grads = randn(rng, n), [randn(rng, n), randn(rng, n)]
    m0, v0 = 0.1 * randn(rng, n), np.abs(randn(rng, n))  # moments of earlier steps
    p, m, v = b.to(p0), b.to(m0), b.to(v0)
    for t in (1, 2):
        update(p, b.to(grads[t - 1]), m, v, lr, b1, b2, eps, wd, t)
    want, mw, vw = p0.astype(F64), m0.astype(F64), v0.astype(F64)
    for t in (1, 2):
        g = grads[t - 1].astype(F64)
        mw = b1 * mw + (1 - b1) * g
        vw = b2 * vw + (1 - b2) * g * g
        mhat, vhat = mw / (1 - b1**t), vw / (1 - b2**t)
        want = want - lr * (mhat / (np.sqrt(vhat) + eps) + wd * want)
    np.testing.assert_allclose(b.get(p), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(b.get(m), mw, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(b.get(v), vw, rtol=1e-6, atol=1e-10)


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


@pytest.mark.cuda
def test_cuda_sgd_norm_scale_clip():
    """The CUDA twins: the norm goes into a float64 device buffer (accumulated over
    segments), and clipping reads it there."""
    kc, dev, host = CUDA.k, CUDA.to, CUDA.get
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


FLAT4 = [zeros32(3)] * 4


def _cuda_adamw_step0():
    x = CUDA.to(zeros32(300))
    CUDA.k.optim.adamw_update(x, x, CUDA.to(zeros32(300)), CUDA.to(zeros32(300)),
                              1e-2, 0.9, 0.999, 1e-8, 0.1, 0)


@pytest.mark.parametrize("b,call,match", cases(cpu=[
    (lambda: optim.sgd_update(np.zeros(3, np.int32), zeros32(3), 0.1, 0.0), "must be float32 or float64"),
    (lambda: optim.sgd_update(zeros32(3), zeros32(4), 0.1, 0.0), "g must be a contiguous 1-D"),
    (lambda: optim.adamw_update(*FLAT4, 0.1, 0.9, 0.999, 1e-8, 0.0, 0), "step t must be an integer >= 1"),
    (lambda: optim.adamw_update(*FLAT4, 0.1, 1.0, 0.999, 1e-8, 0.0, 1), r"betas must lie in \[0, 1\)"),
], cuda=[
    (_cuda_adamw_step0, "step t"),
]))
def test_argument_checks_raise(b, call, match):
    with pytest.raises(ValueError, match=match):
        call()
