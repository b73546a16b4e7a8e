"""swiglu (kernels/swiglu.py, kernels/cuda/swiglu.py): h = silu(g) * u. The CPU and
CUDA kernels against the numpy reference on whole tensors (and in place), the
backward (numba and reference) against float64 finite differences, and the
argument checks."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import CUDA, F64, FD_TOL, cases, check_gate, impls, randn, zeros32

from llamatune.kernels import swiglu


@pytest.mark.parametrize("b,N,F,seed", cases(cpu=[(1, 1, 8), (3, 7, 8), (4, 33, 8)],
                                             cuda=[(3, 21, 4)]))
def test_swiglu_matches_ref_and_in_place(b, N, F, seed):
    check_gate(b, "swiglu", N, F, seed)


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


def _cuda_forward_strided_u():
    CUDA.k.swiglu.swiglu_forward(CUDA.nan((3, 21)), CUDA.to(zeros32(3, 21)), CUDA.to(zeros32(3, 21)[:, :5]))


@pytest.mark.parametrize("b,call,match", cases(cpu=[
    (lambda: swiglu.swiglu_forward(zeros32(2, 3), zeros32(6), zeros32(2, 3)), "g must be a 2-D"),
    (lambda: swiglu.swiglu_backward(zeros32(2, 3), zeros32(3, 2), zeros32(2, 3), zeros32(2, 3),
                                    zeros32(2, 3)), "du must be"),
], cuda=[
    (_cuda_forward_strided_u, "swiglu: u must be a C-contiguous float32 device array"),
]))
def test_argument_checks_raise(b, call, match):
    with pytest.raises(ValueError, match=match):
        call()
