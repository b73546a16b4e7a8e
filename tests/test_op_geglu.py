"""geglu (kernels/geglu.py, kernels/cuda/geglu.py): h = gelu_tanh(g) * u, gemma's
gate. The CPU and CUDA kernels against the numpy reference on whole tensors (and in
place), the float32 forward against ggml's gelu, the backward (numba and reference)
against float64 finite differences, the argument checks, and both backends
registering the gemma ops (geglu, softcap)."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import CUDA, F32, F64, FD_TOL, TOL32, cases, check_gate, impls, randn, zeros32

from llamatune.kernels import geglu, softcap


@pytest.mark.parametrize("b,N,F,seed", cases(cpu=[(1, 1, 1), (3, 7, 1), (4, 33, 1)],
                                             cuda=[(3, 21, 4)]))
def test_geglu_matches_ref_and_in_place(b, N, F, seed):
    check_gate(b, "geglu", N, F, seed)


def test_geglu_is_ggml_gelu_tanh_times_up():
    """The float32 forward is ggml_gelu_f32(g) * u evaluated in ggml's operation order
    (checked in float32 numpy up to tanhf's rounding: one ulp of tanh near -1 is
    |x|/2 ulp(1) in 0.5 x (1 + tanh)), and GELU's known values hold."""
    f = F32
    g = np.array([[-12.0, -3.0, -1.0, -1e-3, 0.0, 0.5, 1.0, 2.0, 5.0, 12.0]], F32)
    u = np.ones_like(g)
    h = np.zeros_like(g)
    geglu.geglu_forward(h, g, u)
    ggml = f(0.5) * g * (f(1) + np.tanh(f(0.79788456080286535587989211986876) * g
                                        * (f(1) + f(0.044715) * g * g)))
    assert np.all(np.abs(h - ggml) <= np.abs(g) * np.finfo(F32).eps + 2e-7 * np.abs(ggml))
    assert h[0, 4] == 0 and h[0, 0] == 0 and h[0, -1] == 12
    np.testing.assert_allclose(h[0, 6], 0.8411920, rtol=1e-6)  # gelu_tanh(1)


def test_geglu_docstring_figures_for_ggml_table_lookup():
    """The figures the module docstring gives for ggml's GGML_GELU_FP16 table lookup
    (input rounded to float16, gelu of it rounded to float16, clamped outside
    +-10) against this kernel's exact formula."""
    x = np.linspace(-10, 10, 400001, dtype=F32)[None]
    exact = np.zeros_like(x)
    geglu.geglu_forward(exact, x, np.ones_like(x))
    x16 = x.astype(np.float16).astype(F32)
    table = np.zeros_like(x)
    geglu.geglu_forward(table, x16, np.ones_like(x))
    table = table.astype(np.float16).astype(F32)
    table[x <= -10], table[x >= 10] = 0, x[x >= 10]
    d = np.abs(table - exact)[0]
    x = x[0]
    assert d[(x > -3) & (x < 0)].max() <= 1.2e-4
    assert d[np.abs(x) < 1].max() <= 5.1e-4
    assert d[np.abs(x) < 4].max() <= 2.1e-3
    assert 3e-3 < d.max() <= 3.91e-3
    pos = x > 1e-3
    assert (d[pos] / exact[0, pos]).max() <= 1.0e-3


@pytest.mark.parametrize("fns", impls(geglu, "geglu_forward", "geglu_backward"))
def test_geglu_fd(fns):
    forward, backward = fns
    rng = np.random.default_rng(2)
    g, u, dh = 2 * randn(rng, 3, 6, dtype=F64), randn(rng, 3, 6, dtype=F64), randn(rng, 3, 6, dtype=F64)
    h = np.zeros_like(g)

    def loss(g, u):
        forward(h, g, u)
        return np.sum(h * dh)

    dg, du = np.zeros_like(g), np.zeros_like(g)
    backward(dg, du, dh, g, u)
    print("fd max rel err", fd_check(loss, {"g": g, "u": u}, {"g": dg, "u": du}, **FD_TOL))


def _cuda_forward_short_u():
    CUDA.k.geglu.geglu_forward(CUDA.nan((3, 21)), CUDA.to(zeros32(3, 21)), CUDA.to(zeros32(3, 21)[:, :5]))


@pytest.mark.parametrize("b,call,match", cases(cpu=[
    (lambda: geglu.geglu_forward(zeros32(2, 3), zeros32(6), zeros32(2, 3)), "geglu: g must be a 2-D"),
    (lambda: geglu.geglu_forward(zeros32(2, 3), zeros32(2, 3), zeros32(3, 2)), r"geglu: u must be .* \(2, 3\)"),
    (lambda: geglu.geglu_backward(zeros32(2, 3), np.zeros((2, 3)), zeros32(2, 3), zeros32(2, 3), zeros32(2, 3)),
     "geglu: du must be a C-contiguous float32"),
], cuda=[
    (_cuda_forward_short_u, "geglu: u must be a C-contiguous float32 device array"),
]))
def test_argument_checks_raise(b, call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("b", cases())
def test_backend_registers_geglu_and_softcap(b):
    """Each backend exposes gemma's ops as ops.geglu and ops.softcap; they work in
    place on the backend's arrays (in the CUDA simulator: numpy arrays)."""
    from llamatune.backend import OPS, cpu, get_backend
    assert {"geglu", "softcap"} <= set(OPS)
    if b.cuda:
        if not b.k.simulator_enabled():
            pytest.skip("a real GPU: the backend's arrays are CuPy arrays (test_cuda_e2e)")
        ops = get_backend("cuda").ops
    else:
        ops = cpu().ops
        assert ops.geglu is geglu and ops.softcap is softcap
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
