"""cuBLAS products (kernels/cuda/blas.py: cublasGemmEx, float32 or bf16 operands) in every
layout the graph hands them, with the scale and add of their epilogue, and the checks that
refuse what cuBLAS would misread, on numba's simulator as on a GPU: numpy host arrays,
views strided both ways, wrong dtypes; numba's own device arrays are taken. The kernels'
C-contiguity check follows numpy's rule for every kind of device array."""
from __future__ import annotations

import types

import numpy as np
import pytest
from op_helpers import CUDA

from llamatune.kernels import bf16 as host_bf16

pytestmark = pytest.mark.cuda
b = CUDA


def u16(shape):
    return b.to(np.full(shape, 0x7FC1, np.uint16))


def _layouts(rng, M, K, N):
    """(name, a, b, out) host arrays: C operands, a transposed a (column-major), a column
    block of a wider b, a column block of a wider out."""
    a, bb = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    return [("C", a, bb, None), ("a^T", np.ascontiguousarray(a.T).T, bb, None),
            ("b block", a, np.concatenate([bb, bb], axis=1)[:, N:], None),
            ("out block", a, bb, (slice(None), slice(3, 3 + N)))]


def _device_operand(x):
    """x on the device with its layout: a transposed view stays a transposed view, a column
    block a block of a device copy of the wider array."""
    if x.flags.f_contiguous and not x.flags.c_contiguous:
        return b.to(np.ascontiguousarray(x.T)).T
    if not x.flags.c_contiguous:
        base = x.base if x.base is not None else x
        lo = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 4
        return b.to(base)[:, lo:lo + x.shape[1]]
    return b.to(x)


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_gemm_layouts_scale_and_add(bf16):
    """out = alpha a b + beta out for every layout: float32 products to float32 rounding,
    bf16 ones exact to float32 accumulation on the bf16-rounded operands."""
    rng = np.random.default_rng(4)
    M, K, N = 5, 33, 7
    for name, a, bb, out_block in _layouts(rng, M, K, N):
        start = rng.standard_normal((M, N + 6)).astype(np.float32)
        da, db = _device_operand(a), _device_operand(bb)
        if bf16:
            a64, b64 = (host_bf16.from_bf16_ref(host_bf16.to_bf16_ref(np.ascontiguousarray(x))).astype(np.float64)
                        for x in (a, bb))
            da, db = (_to_bits(x) for x in (da, db))
        else:
            a64, b64 = a.astype(np.float64), bb.astype(np.float64)
        dout_full = b.to(start)
        dout = dout_full[out_block] if out_block else dout_full[:, :N]
        want_full = start.astype(np.float64)
        sl = out_block or (slice(None), slice(0, N))
        want_full[sl] = 0.5 * (a64 @ b64) + 2.0 * want_full[sl]
        gemm = b.k.blas.gemm_bf16 if bf16 else b.k.blas.gemm
        gemm(dout, da, db, 0.5, 2.0)
        scale = np.abs(a64) @ np.abs(b64)
        got = b.get(dout_full).astype(np.float64)
        assert np.all(np.abs(got[sl] - want_full[sl]) <= 1e-5 * (scale + np.abs(want_full[sl]))), name
        rest = np.ones(start.shape, bool)
        rest[sl] = False
        np.testing.assert_array_equal(got[rest], start[rest], err_msg=f"{name}: written outside out")


def _to_bits(x):
    """A device float32 matrix's bf16 bits in the same layout (C, or a transposed view)."""
    t = not _c_order(x)
    src = x.T if t else x
    out = u16(src.shape)
    b.k.bf16.to_bf16(out, src)
    return out.T if t else out


def _c_order(x):
    return x.strides[-1] == x.dtype.itemsize


def test_gemm_refuses_what_cublas_cannot_take():
    """A numpy host array (CuPy would copy it and lose the result), a view strided both
    ways, a wrong dtype: ValueErrors on the simulator as on a GPU; numba's own device
    arrays are taken (a zero-copy CuPy view on a GPU)."""
    from numba import cuda
    a = np.ones((4, 6), np.float32)
    out = b.to(np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="gemm: a must be a device array, got a numpy host array"):
        b.k.blas.gemm(out, a, b.to(np.ones((6, 4), np.float32)))
    wide = b.to(np.ones((8, 12), np.float32))
    with pytest.raises(ValueError, match=r"gemm: a \(4, 6\) with strides .* cuBLAS cannot read it"):
        b.k.blas.gemm(out, wide[::2, ::2], b.to(np.ones((6, 4), np.float32)))
    with pytest.raises(ValueError, match="gemm_bf16: b must be a 2-D uint16 matrix"):
        b.k.blas.gemm_bf16(out, b.to(np.ones((4, 6), np.uint16)), b.to(np.ones((6, 4), np.float32)))
    with pytest.raises(ValueError, match="lora: y must be a device array"):
        b.k.lora.lora_forward(np.zeros((4, 4), np.float32), b.to(np.ones((4, 2), np.float32)),
                              b.to(np.ones((4, 2), np.float32)), 1.0, None)
    b.k.blas.gemm(out, cuda.to_device(a), cuda.to_device(np.full((6, 4), 2, np.float32)))
    np.testing.assert_array_equal(b.get(out), np.full((4, 4), 12, np.float32))


def test_contiguity_is_numpys_rule_for_every_kind_of_array():
    """The kernels' C-contiguity check reads shapes and strides as numpy does, so a new
    axis (stride 0, length 1) passes on a GPU as in the simulator, and a column block
    fails in both."""
    from llamatune.kernels.cuda._common import _contiguous
    base = np.zeros((4, 6), np.float32)
    views = [base, base[None], base[:, None], base[:1], base[:, :3], base.T, base[::2], np.zeros((0, 3))[:, :1],
             np.arange(64).astype(np.uint16)[None].view(np.uint8)]
    for v in views:
        fake = types.SimpleNamespace(shape=v.shape, strides=v.strides, dtype=v.dtype)
        assert _contiguous(fake) == v.flags.c_contiguous, (v.shape, v.strides)


