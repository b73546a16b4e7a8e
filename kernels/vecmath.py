"""A vectorizable float32 exp, tanh and row max for the CPU kernels' inner loops.

numba has no SVML on these machines, so `np.exp` in a loop is a scalar libm call
(2-3 ns each) and keeps LLVM from vectorizing the loop around it. `expf(x)` is
Cephes' expf written branch-free: x = n ln2 + r (ln2 in two parts), exp(r) by a
degree-7 polynomial, times 2^n built from its exponent bits. It is within 3 ulp
of exp for float32 (tests/test_op_vecmath.py) and LLVM turns a loop of it into SIMD
code (about 0.4 ns per element). x is clamped to [-87, 88] so 2^n stays a normal
number: exp(-87) = 1.6e-38 stands in for anything smaller, which weighs nothing
beside a softmax row's max term (exp(0) = 1) or in 1 + exp(-x).
float64 keeps np.exp (the finite-difference checks run in float64).

`tanhf(x)` is Cephes' tanhf written branch-free: the odd polynomial x + x z P(z)
(z = x^2) where |x| < 0.625, else 1 - 2 / (expf(2|x|) + 1) with x's sign; both are
computed and one selected, so LLVM vectorizes it (within 1.2 ulp of tanh over
[-100, 100], against 1.3 for numpy's float32 tanh; 1.3 ns an element on one Zen 3
core, against 18.5 for libm's tanhf in a numba loop). NaN and -0 stay themselves,
+-inf gives +-1. A loop that calls it needs numba's `error_model="numpy"` (implied by
`parallel=True`): under the default model every division gets a zero check, which
keeps LLVM from vectorizing the loop. float64 keeps np.tanh.

`row_max(a, lo, hi)` is the max of a[lo:hi] in eight independent chains, which
LLVM vectorizes (a plain `max` loop is one serial chain: 4 cycles a element).

expf is used by the softmax of attention, the training cross-entropy and the SwiGLU
gate; tanhf by the GEGLU gate and the soft-capping of scores and logits.
The evaluation cross-entropy (perplexity) keeps libm's expf, as llama-perplexity.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

FASTMATH = {"reassoc", "nsz", "contract"}  # lets LLVM vectorize sums (reassociation) in these loops


@intrinsic
def _i32_as_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


def _float32_polynomial(numpy_fn):
    """Decorator: the decorated float32 code becomes fn(x) inside numba kernels for
    float32 x; any other x, and calls outside numba, get numpy_fn."""
    def register(f32):
        def fn(x):
            return numpy_fn(x)

        @overload(fn, inline="always")     # into the caller's numba IR: LLVM sees the loop whole
        def _overload(x):
            return f32 if x == types.float32 else (lambda x: numpy_fn(x))

        fn.__name__, fn.__qualname__, fn.__doc__ = f32.__name__, f32.__qualname__, f32.__doc__
        return fn
    return register


@_float32_polynomial(np.exp)
def expf(x):
    """exp(x): float32 by a vectorizable polynomial, else np.exp (inside numba kernels)."""
    f = np.float32
    x = min(max(x, f(-87.0)), f(88.0))
    n = np.floor(x * f(1.44269504088896341) + f(0.5))
    r = x - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)
    p = f(1.9875691500e-4)
    p = p * r + f(1.3981999507e-3)
    p = p * r + f(8.3334519073e-3)
    p = p * r + f(4.1665795894e-2)
    p = p * r + f(1.6666665459e-1)
    p = p * r + f(5.0000001201e-1)
    p = p * r * r + r + f(1.0)
    return p * _i32_as_f32((np.int32(n) + np.int32(127)) << np.int32(23))


@_float32_polynomial(np.tanh)
def tanhf(x):
    """tanh(x): float32 by a vectorizable polynomial / expf, else np.tanh (inside numba kernels)."""
    f = np.float32
    z = x * x
    p = f(-5.70498872745e-3)
    p = p * z + f(2.06390887954e-2)
    p = p * z + f(-5.37397155531e-2)
    p = p * z + f(1.33314422036e-1)
    p = p * z + f(-3.33332819422e-1)
    small = x + x * z * p  # |x| < 0.625
    a = abs(x)
    big = f(1.0) - f(2.0) / (expf(a + a) + f(1.0))  # expf clamps: 1 for |x| > 44
    big = big if x >= f(0.0) else -big
    t = small if a < f(0.625) else big
    return t if x == x and x != f(0.0) else x  # NaN stays NaN, -0 stays -0


@njit(inline="always")
def row_max(a, lo, hi):
    # max of a[lo:hi] (hi > lo, both uint64: unsigned indices carry no negative-index
    # wraparound, which would stop LLVM from vectorizing): eight independent chains
    u = np.uint64
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = a[lo]
    end8 = lo + (hi - lo) // u(8) * u(8)
    for j in range(lo, end8, 8):
        m0 = max(m0, a[j])
        m1 = max(m1, a[j + u(1)])
        m2 = max(m2, a[j + u(2)])
        m3 = max(m3, a[j + u(3)])
        m4 = max(m4, a[j + u(4)])
        m5 = max(m5, a[j + u(5)])
        m6 = max(m6, a[j + u(6)])
        m7 = max(m7, a[j + u(7)])
    m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    for j in range(end8, hi):
        m = max(m, a[j])
    return m
