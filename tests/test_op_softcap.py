"""softcap (kernels/softcap.py, kernels/cuda/softcap.py): y = cap * tanh(x / cap),
gemma2's final logit soft-capping. The CPU and CUDA kernels against the numpy
reference on whole tensors (and in place, as on the logits chunk), the float32
forward against ggml's three ops, the backward (numba and reference) against
float64 finite differences, and the argument checks."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import CUDA, F32, F64, FD_TOL, TOL32, cases, impls, randn, zeros32

from llamatune.kernels import softcap


@pytest.mark.parametrize("b,shape,scale,seed", cases(
    cpu=[((1, 1), 40, 3), ((3, 50), 40, 3), ((2, 3, 7), 40, 3)],
    cuda=[((2, 300), 50, 31)]))  # 600 values: three thread blocks, the last partial
def test_softcap_matches_ref_and_in_place(b, shape, scale, seed):
    rng = np.random.default_rng(seed)
    x, dy, cap = scale * randn(rng, *shape), randn(rng, *shape), 30.0
    want, dx_ref = np.zeros_like(x), np.zeros_like(x)
    softcap.softcap_forward_ref(want, x, cap)
    softcap.softcap_backward_ref(dx_ref, dy, want, cap)
    y, dx = b.nan(shape), b.nan(shape)
    b.k.softcap.softcap_forward(y, b.to(x), cap)
    np.testing.assert_allclose(b.get(y), want, **TOL32)
    assert np.abs(b.get(y)).max() <= cap
    b.k.softcap.softcap_backward(dx, b.to(dy), y, cap)
    np.testing.assert_allclose(b.get(dx), dx_ref, **TOL32)
    xi, dyi = b.to(x), b.to(dy)  # in place, as the logits chunk is capped
    b.k.softcap.softcap_forward(xi, xi, cap)
    np.testing.assert_array_equal(b.get(xi), b.get(y))
    b.k.softcap.softcap_backward(dyi, dyi, xi, cap)
    np.testing.assert_array_equal(b.get(dyi), b.get(dx))


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


def _cuda_forward(y=None, x=None, cap=30.0):
    def call():
        xd = CUDA.to(zeros32(2, 300))
        CUDA.k.softcap.softcap_forward(CUDA.nan((2, 300)) if y is None else y(),
                                       xd if x is None else x(), cap)
    return call


@pytest.mark.parametrize("b,call,match", cases(cpu=[
    (lambda: softcap.softcap_forward(zeros32(2, 3), zeros32(2, 3), 0.0), "softcap: cap must be a finite number > 0"),
    (lambda: softcap.softcap_forward(zeros32(2, 3), zeros32(2, 3), float("inf")), "cap must be a finite"),
    (lambda: softcap.softcap_forward(zeros32(2, 3), np.zeros((2, 3), np.int32), 1.0),
     r"softcap: x must be a C-contiguous float32 array of shape \(2, 3\), got int32"),
    (lambda: softcap.softcap_forward(np.zeros(3, np.int32), zeros32(3), 1.0),
     "softcap: y must be a float32 or float64 array"),
    (lambda: softcap.softcap_forward(zeros32(2, 4), zeros32(2, 3), 1.0), r"softcap: x must be .* \(2, 4\)"),
    (lambda: softcap.softcap_backward(zeros32(2, 3), zeros32(2, 3), zeros32(2, 3)[:, ::2], 1.0),
     "softcap: y must be a C-contiguous"),
    (lambda: softcap.softcap_forward([1.0], zeros32(1), 1.0), "softcap: y must be a float32 or float64 array"),
], cuda=[
    (_cuda_forward(cap=-1.0), "softcap: cap must be a finite number > 0"),
    (_cuda_forward(x=lambda: zeros32(2, 300)), "softcap: x must be a C-contiguous float32 device array"),  # host
    (_cuda_forward(y=lambda: CUDA.to(np.zeros((2, 300)))), "softcap: y must be a float32 device array"),
]))
def test_argument_checks_raise(b, call, match):
    with pytest.raises(ValueError, match=match):
        call()
