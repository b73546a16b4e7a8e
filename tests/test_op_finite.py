"""The finite-scan kernel against its reference (gguf dequantization + np.isfinite), row for row."""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from llamatune.kernels.finite import SCAN_TYPES, nonfinite_rows, nonfinite_rows_into, nonfinite_rows_ref

from op_helpers import ALL_TYPES, SCALE_OFFSETS, random_tensor

# f16 bit patterns of +inf, -inf, a quiet nan, a nan with a payload
BAD_HALVES = [0x7C00, 0xFC00, 0x7E00, 0x7C01]


def kernel(data, qtype):
    out = np.empty(data.shape[0], np.bool_)
    nonfinite_rows_into(data, qtype, out)
    return out


def test_scan_types_cover_every_numba_type():
    from llamatune.kernels.dequant import NUMBA_TYPES
    assert SCAN_TYPES == NUMBA_TYPES


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_agree_with_reference(qtype):
    n_cols = 32 if qtype in (T.F32, T.F16, T.BF16) else 512     # random float rows: a mix of bad and good
    data = random_tensor(qtype, 256, n_cols, seed=1)
    got, want = kernel(data, qtype), nonfinite_rows_ref(data, qtype, n_cols)
    np.testing.assert_array_equal(got, want)
    if qtype in (T.F32, T.F16, T.BF16):       # random bytes: some rows hold inf/nan patterns, most do not
        assert 0 < want.sum() < len(want)
    else:                                     # finite random scales: every row finite
        assert not want.any()


@pytest.mark.parametrize("qtype", list(SCALE_OFFSETS), ids=lambda t: t.name)
def test_poisoned_scales_agree_with_reference(qtype):
    n_cols = 1024
    data = random_tensor(qtype, 64, n_cols, seed=2)
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_cols // block_size
    poisoned = rng.choice(64, size=12, replace=False)
    for k, row in enumerate(poisoned):
        block = n_blocks - 1 if k == 0 else rng.integers(n_blocks)      # the last block of a row too
        off = block * type_size + SCALE_OFFSETS[qtype][k % len(SCALE_OFFSETS[qtype])]
        data[row, off:off + 2] = np.array([BAD_HALVES[k % 4]], "<u2").view(np.uint8)
    want = np.zeros(64, bool)
    want[poisoned] = True
    np.testing.assert_array_equal(nonfinite_rows_ref(data, qtype, n_cols), want)
    np.testing.assert_array_equal(kernel(data, qtype), want)


@pytest.mark.parametrize("qtype,value", [(T.F32, np.float32(np.inf)), (T.F32, np.float32(np.nan)),
                                         (T.F16, np.float16(-np.inf)), (T.F16, np.float16(np.nan))],
                         ids=["f32-inf", "f32-nan", "f16-inf", "f16-nan"])
def test_poisoned_floats_agree_with_reference(qtype, value):
    x = np.random.default_rng(3).standard_normal((8, 64)).astype(value.dtype)
    x[5, 63] = value
    x[2, 0] = np.finfo(value.dtype).max                     # the largest finite value is finite
    raw = x.view(np.uint8)
    want = np.zeros(8, bool)
    want[5] = True
    np.testing.assert_array_equal(nonfinite_rows_ref(raw, qtype, 64), want)
    np.testing.assert_array_equal(kernel(raw, qtype), want)


def test_types_without_kernel_use_the_reference():
    # IQ4_NL (18-byte blocks: f16 d, 16 bytes of 4-bit indices) has no kernel; row 1 gets d = nan
    data = np.zeros((3, 2, 18), np.uint8)
    data[:, :, 0:2] = np.array([0.5], np.float16).view(np.uint8)
    data[1, 1, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    got = nonfinite_rows(data.reshape(3, 36), T.IQ4_NL, 64)
    np.testing.assert_array_equal(got, [False, True, False])


def test_argument_checks():
    with pytest.raises(ValueError, match="no finite-scan kernel for GGML type F64"):
        nonfinite_rows_into(np.zeros((1, 8), np.uint8), T.F64, np.empty(1, bool))
    with pytest.raises(ValueError, match="C-contiguous 2-D uint8"):
        nonfinite_rows_into(np.zeros((1, 8), np.float32), T.F32, np.empty(1, bool))
    with pytest.raises(ValueError, match="not whole blocks of 34"):
        nonfinite_rows_into(np.zeros((1, 35), np.uint8), T.Q8_0, np.empty(1, bool))
    with pytest.raises(ValueError, match=r"out must be a writeable bool array of shape \(1,\)"):
        nonfinite_rows_into(np.zeros((1, 34), np.uint8), T.Q8_0, np.empty(2, bool))
