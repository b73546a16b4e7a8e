"""vecmath (kernels/vecmath.py): the vectorized float32 exp of the softmax kernels
and tanh of the gate and softcap kernels, against float64 numpy in ulps over the
ranges they serve, their special values, and the SIMD loop LLVM makes of them."""
import numpy as np
from op_helpers import F32, F64

from llamatune.kernels import vecmath


def test_float32_exp_of_the_softmax_kernels():
    """The vectorized float32 exp is within 3 ulp of exp over the range the softmax
    uses (s - max <= 0), and flushes below -87 to exp(-87) instead of 0."""
    from numba import njit

    @njit
    def exp_all(x, out):
        for i in range(x.size):
            out[i] = vecmath.expf(x[i])

    x = np.concatenate([-np.geomspace(1e-8, 87.0, 20000), [0.0, -1e-30]]).astype(F32)
    got = np.empty_like(x)
    exp_all(x, got)
    want = np.exp(x.astype(F64))
    ulp = np.abs(got - want) / np.spacing(want.astype(F32)).astype(F64)
    assert ulp.max() <= 3
    exp_all(np.array([-88.0, -1e4], F32), got[:2])
    np.testing.assert_array_equal(got[:2], F32(np.exp(F32(-87.0))))


def test_float32_tanh_of_the_gate_and_softcap_kernels():
    """The vectorized float32 tanh is within 1.2 ulp of tanh on both sides of its
    0.625 switch and out to saturation; -0 stays -0, +-inf gives +-1, NaN stays NaN;
    and a loop of it is vectorized (LLVM vector types in the float32 loop)."""
    from numba import njit

    @njit(error_model="numpy")
    def tanh_all(x, out):
        for i in range(x.size):
            out[i] = vecmath.tanhf(x[i])

    x = np.geomspace(1e-30, 100.0, 200000).astype(F32)
    x = np.concatenate([x, [F32(0.625), np.nextafter(F32(0.625), F32(0)), F32(1e-45)]])
    x = np.concatenate([x, -x])
    got = np.empty_like(x)
    tanh_all(x, got)
    want = np.tanh(x.astype(F64))
    ulp = np.abs(got - want) / np.spacing(np.abs(want).astype(F32)).astype(F64)
    assert ulp.max() <= 1.2
    special = np.array([-0.0, np.inf, -np.inf, np.nan], F32)
    out = np.empty_like(special)
    tanh_all(special, out)
    assert np.signbit(out[0]) and out[0] == 0 and out[1] == 1 and out[2] == -1 and np.isnan(out[3])
    ir = next(iter(tanh_all.inspect_llvm().values()))
    assert "x float>" in ir                       # a vector loop, not a scalar libm call
