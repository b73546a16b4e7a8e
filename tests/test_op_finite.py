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
    # IQ2_XXS (66-byte blocks of 256: f16 d, 64 bytes of grid indices, signs and scales)
    # has no kernel; row 1 gets d = nan
    assert int(T.IQ2_XXS) not in SCAN_TYPES
    data = np.zeros((3, 2, 66), np.uint8)
    data[:, :, 0:2] = np.array([0.5], np.float16).view(np.uint8)
    data[1, 1, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    got = nonfinite_rows(data.reshape(3, 132), T.IQ2_XXS, 512)
    np.testing.assert_array_equal(got, [False, True, False])


def test_mxfp4_every_code_and_scale_byte():
    """MXFP4's scale is 2^(e-128), never inf or nan; a value overflows only for scale
    bytes e >= 253 with a large enough code: one block per (e, code) pair, a row each,
    the code in the first high nibble and then in the last low nibble (the other codes 0)."""
    e = np.repeat(np.arange(256, dtype=np.uint8), 16)
    code = np.tile(np.arange(16, dtype=np.uint8), 256)
    high, low = np.zeros((4096, 17), np.uint8), np.zeros((4096, 17), np.uint8)
    high[:, 0], high[:, 1] = e, code << 4
    low[:, 0], low[:, 16] = e, code
    kv = np.abs(np.array([0, 1, 2, 3, 4, 6, 8, 12] * 2))
    overflows = kv[code] * 2.0 ** (e.astype(np.int64) - 128) >= 2.0 ** 128
    assert overflows.sum() == 4 + 8 + 12                 # e = 253: |kv| >= 8; 254: >= 4; 255: >= 2
    for blocks in (high, low):
        want = nonfinite_rows_ref(blocks, T.MXFP4, 32)
        np.testing.assert_array_equal(want, overflows)
        np.testing.assert_array_equal(kernel(blocks, T.MXFP4), want)
