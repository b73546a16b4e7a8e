"""A vectorizable float32 exp and row max for the CPU kernels' inner loops.

numba has no SVML on these machines, so `np.exp` in a loop is a scalar libm call
(2-3 ns each) and keeps LLVM from vectorizing the loop around it. `expf(x)` is
Cephes' expf written branch-free: x = n ln2 + r (ln2 in two parts), exp(r) by a
degree-7 polynomial, times 2^n built from its exponent bits. It is within 3 ulp
of exp for float32 (tests/test_kernels.py) and LLVM turns a loop of it into SIMD
code (about 0.4 ns per element). x is clamped to [-87, 88] so 2^n stays a normal
number: exp(-87) = 1.6e-38 stands in for anything smaller, which weighs nothing
beside a softmax row's max term (exp(0) = 1) or in 1 + exp(-x).
float64 keeps np.exp (the finite-difference checks run in float64).

`row_max(a, lo, hi)` is the max of a[lo:hi] in eight independent chains, which
LLVM vectorizes (a plain `max` loop is one serial chain: 4 cycles a element).

Used by the softmax of attention, the training cross-entropy and the SwiGLU gate.
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


def expf(x):
    """exp(x): float32 by a vectorizable polynomial, else np.exp (inside numba kernels)."""
    return np.exp(x)


@overload(expf)
def _expf_overload(x):
    if x != types.float32:
        return lambda x: np.exp(x)

    def exp_f32(x):
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
    return exp_f32


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
