"""The shared finite-difference checker (tests/fdcheck.py) that proves every
backward of the test_op_*.py files: it accepts true gradients, rejects a gradient
0.1% off in one element, restores what it perturbs, and checks its arguments."""
import numpy as np
import pytest
from fdcheck import fd_check
from op_helpers import F32, F64, randn


def test_fd_check_accepts_true_and_rejects_wrong_gradients():
    rng = np.random.default_rng(14)
    x, y = randn(rng, 4, 5, dtype=F64), randn(rng, 7, dtype=F64)

    def loss(x, y, scale):  # scale: a non-array input that passes through
        return scale * (np.sum(x**3) + np.sum(np.sin(y)))

    x0 = x.copy()
    err = fd_check(loss, {"x": x, "y": y, "scale": 2.0}, {"x": 6 * x**2, "y": 2 * np.cos(y)},
                   rtol=1e-7, atol=1e-9, n_probe=5)
    assert err <= 1e-7
    np.testing.assert_array_equal(x, x0)  # perturbations restored
    wrong = 6 * x**2
    wrong[3, 4] *= 1.001  # one element off by 0.1%
    with pytest.raises(AssertionError, match="gradient of 'x'"):
        fd_check(loss, {"x": x, "y": y, "scale": 2.0}, {"x": wrong}, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("call,match", [
    (lambda: fd_check(lambda x: 0.0, {"x": np.zeros(2, F32)}, {"x": np.zeros(2, F32)}),
     "must be a C-contiguous float64"),
    (lambda: fd_check(lambda x: 0.0, {"x": np.zeros(2)}, {"x": np.zeros(3)}), r"has shape \(3,\), input has \(2,\)"),
    (lambda: fd_check(lambda x: 0.0, {"x": np.zeros(2)}, {"x": np.zeros(2)}, rtol=0), "rtol must be > 0"),
], ids=["must be a C-contiguous float64", r"has shape \(3,\), input has \(2,\)", "rtol must be > 0"])
def test_argument_checks_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
