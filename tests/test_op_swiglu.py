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


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gate_keeps_and_reads_bf16_inputs(name):
    """Training with bf16 products keeps g and u as bf16 bits: the forward given g16, u16
    stores to_bf16(g), to_bf16(u) there and computes h from those rounded values (the
    reference on them, whole tensors; the kernel on the rounded floats bit for bit); the
    forward (a recompute) and the backward reading the bits equal them read as floats."""
    from llamatune.kernels import bf16, geglu
    mod = swiglu if name == "swiglu" else geglu
    fwd, bwd = getattr(mod, f"{name}_forward"), getattr(mod, f"{name}_backward")
    rng = np.random.default_rng(11)
    N, F = 37, 300
    g, u, dout = (3 * randn(rng, N, F) for _ in range(3))
    g16, u16 = np.zeros((N, F), np.uint16), np.zeros((N, F), np.uint16)
    h = zeros32(N, F)
    fwd(h, g, u, g16, u16)
    np.testing.assert_array_equal(g16, bf16.to_bf16_ref(g))
    np.testing.assert_array_equal(u16, bf16.to_bf16_ref(u))
    gr, ur = bf16.from_bf16_ref(g16), bf16.from_bf16_ref(u16)
    want = zeros32(N, F)
    getattr(mod, f"{name}_forward_ref")(want, gr.astype(F64), ur.astype(F64))
    np.testing.assert_allclose(h, want, rtol=2e-6, atol=1e-6)
    for a, b_ in ((g16, u16), (gr, ur)):
        again = zeros32(N, F)
        fwd(again, a, b_)
        np.testing.assert_array_equal(again, h)
    grads = []
    for a, b_ in ((g16, u16), (gr, ur)):
        dg, du = zeros32(N, F), zeros32(N, F)
        bwd(dg, du, dout, a, b_)
        grads.append((dg, du))
    np.testing.assert_array_equal(grads[0][0], grads[1][0])
    np.testing.assert_array_equal(grads[0][1], grads[1][1])
    with pytest.raises(ValueError, match="g16 and u16 go together"):
        fwd(h, g, u, g16, None)
    with pytest.raises(ValueError, match="must be a C-contiguous uint16"):
        fwd(h, g, u, g16, np.zeros((N, F), np.float32))
