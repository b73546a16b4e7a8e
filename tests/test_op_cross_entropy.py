"""cross_entropy (kernels/cross_entropy.py, kernels/cuda/cross_entropy.py): the CPU
and CUDA kernels against the numpy reference on whole tensors (ignored targets,
weight 0, in place, the fused forward+backward), the backward (numba and
reference) against float64 finite differences, and the argument checks."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import F32, F64, FD_TOL, TOL32, cases, impls, randn, zeros32

from llamatune.kernels import cross_entropy


def ce_case(rng, dtype=F32):
    N, V = 6, 11
    logits = 3 * randn(rng, N, V, dtype=dtype)
    targets = np.array([0, 10, -1, 4, 4, -1], np.int64)
    weights = np.array([0.5, 1.0, 1.0, 0.0, 0.25, 0.0], dtype)  # weight 0 on row 3
    return logits, targets, weights


def ce_case_wide(rng):
    N, V = 5, 300  # V > 256 threads: strided rows
    logits = 3 * randn(rng, N, V)
    targets = np.array([0, 299, -1, 4, 17], np.int64)
    weights = np.array([0.5, 1.0, 1.0, 0.0, 0.25], F32)  # weight 0 on row 3
    return logits, targets, weights


@pytest.mark.parametrize("b,make,seed", cases(cpu=[(ce_case, 10)], cuda=[(ce_case_wide, 10)]))
def test_cross_entropy_matches_ref_and_in_place(b, make, seed):
    logits, targets, weights = make(np.random.default_rng(seed))
    N = len(targets)
    want = np.zeros(N, F32)
    cross_entropy.cross_entropy_forward_ref(want, logits, targets)
    losses, ld, td, wd = b.nan(N), b.to(logits), b.to(targets), b.to(weights)
    b.k.cross_entropy.cross_entropy_forward(losses, ld, td)
    got = b.get(losses)
    np.testing.assert_allclose(got, want, **TOL32)
    assert not got[targets < 0].any()  # target -1
    p = np.exp(logits[0] - logits[0].max())
    np.testing.assert_allclose(got[0], np.log(p.sum()) - np.log(p[0]), rtol=1e-5)
    dl_ref = np.zeros_like(logits)
    cross_entropy.cross_entropy_backward_ref(dl_ref, logits, targets, weights)
    dl = b.nan(logits.shape)
    b.k.cross_entropy.cross_entropy_backward(dl, ld, td, wd)
    g = b.get(dl)
    np.testing.assert_allclose(g, dl_ref, **TOL32)
    assert not g[(targets < 0) | (weights == 0)].any()  # target -1 or weight 0
    np.testing.assert_allclose(g.sum(axis=1), 0, atol=1e-6)
    b.k.cross_entropy.cross_entropy_backward(ld, ld, td, wd)  # in place
    np.testing.assert_array_equal(b.get(ld), g)
    fl, fd = b.nan(N), b.to(logits)  # fused, in place
    b.k.cross_entropy.cross_entropy_forward_backward(fl, fd, fd, td, wd)
    if b.cuda:  # the forward's own row reduction: the same bits
        np.testing.assert_array_equal(b.get(fl), got)
    else:       # a reassociated row sum: to rounding (see the test below)
        np.testing.assert_allclose(b.get(fl), got, rtol=1e-6)
    np.testing.assert_array_equal(b.get(fd), g)


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


CE_T = np.zeros(2, np.int64)


CHECKS = [
    (lambda: cross_entropy.cross_entropy_forward(zeros32(2), zeros32(2), CE_T), "logits must be a 2-D"),
    (lambda: cross_entropy.cross_entropy_forward(zeros32(2), zeros32(2, 3), np.array([0, 3])),
     "target 3 out of range"),
    (lambda: cross_entropy.cross_entropy_forward(zeros32(2), zeros32(2, 3), CE_T.astype(np.int32)),
     "targets must be"),
    (lambda: cross_entropy.cross_entropy_backward(zeros32(2, 3), zeros32(2, 3), CE_T, np.zeros(2)),
     "weights must be a C-contiguous float32"),
]


@pytest.mark.parametrize("call,match", CHECKS, ids=[m for _, m in CHECKS])
def test_argument_checks_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("n,V,width", [(6, 11, 4), (7, 100, 32), (33, 3001, 512), (40, 2000, 2000)])
def test_cross_entropy_blocked_matches_ref(n, V, width):
    """Column-blocked logits (a ragged last block, one block): the losses of the reference
    to float rounding, and the gradient's bf16 bits over the logits within one bf16 step
    of the reference's rounded float64 gradient, on the whole (n, V) gradient; ignored
    targets and weight 0 give zero rows."""
    from llamatune.kernels.bf16 import from_bf16_ref
    rng = np.random.default_rng(n)
    logits = (3 * rng.standard_normal(n * V)).astype(F32)
    targets = rng.integers(0, V, n)
    targets[1::5] = -1
    targets[0] = V - 1                                   # in the last (ragged) block
    weights = rng.random(n).astype(F32)
    weights[2] = 0.0
    want_losses = np.zeros(n, F32)
    want = cross_entropy.cross_entropy_blocked_ref(want_losses, logits.copy(), width, targets, weights)
    losses = np.full(n, np.nan, F32)
    cross_entropy.cross_entropy_blocked(losses, logits, width, targets, weights)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6, atol=2e-6)
    got = np.concatenate([cross_entropy.column_block_grad(logits, n, lo, min(V, lo + width))
                          for lo in range(0, V, width)], axis=1)
    g, r = from_bf16_ref(got).astype(np.float64), from_bf16_ref(want).astype(np.float64)
    assert (np.abs(g - r) <= np.abs(r) * 2.0**-7).all()
    assert not got[targets < 0].any() and not got[2].any()
    assert (got[targets >= 0].view(np.int16) != 0).any()


def test_cross_entropy_blocked_losses_alone_and_checks():
    rng = np.random.default_rng(3)
    n, V, width = 5, 70, 16
    logits = rng.standard_normal(n * V).astype(F32)
    targets, weights = rng.integers(0, V, n), np.ones(n, F32)
    want = np.zeros(n, F32)
    cross_entropy.cross_entropy_forward_ref(want, cross_entropy.unblock(logits, n, width), targets)
    keep, losses = logits.copy(), np.zeros(n, F32)
    cross_entropy.cross_entropy_blocked(losses, logits, width, targets, weights, grad=False)
    np.testing.assert_allclose(losses, want, rtol=2e-6)
    np.testing.assert_array_equal(logits, keep)          # no gradient: the logits untouched
    with pytest.raises(ValueError, match="blocked logits must be a flat"):
        cross_entropy.cross_entropy_blocked(losses, logits.reshape(n, V), width, targets, weights)
    with pytest.raises(ValueError, match="out of range"):
        cross_entropy.cross_entropy_blocked(losses, logits, width, np.full(n, V, np.int64), weights)
    with pytest.raises(ValueError, match="width must be"):
        cross_entropy.cross_entropy_blocked(losses, logits, 0, targets, weights)
