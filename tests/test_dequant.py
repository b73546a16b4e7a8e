"""Bit-exact tests of the numba dequantization kernels against gguf.quants.dequantize."""
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from llamatune.kernels.dequant import (
    NUMBA_TYPES, dequantize, dequantize_into, dequantize_rows_into,
)

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"

# byte offsets of the f16 scale fields (d / dmin / m) inside one block
SCALE_OFFSETS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
ALL_TYPES = FLOAT_TYPES + list(SCALE_OFFSETS)


def random_tensor(qtype, n_rows, n_cols, seed=0):
    """Random bytes (n_rows, row_bytes); for quants the f16 scale fields get finite
    values, including a few subnormals and signed zeros."""
    rng = np.random.default_rng(seed + int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_cols // block_size
    data = rng.integers(0, 256, size=(n_rows, n_blocks, type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS.get(qtype, []):
        scales = (rng.standard_normal((n_rows, n_blocks)) * 0.05).astype(np.float16)
        flat = scales.reshape(-1)
        flat[:4] = np.array([0.0, -0.0, 6e-8, -3e-6], dtype=np.float16)  # zeros, subnormals
        data[:, :, off:off + 2] = scales.view(np.uint8).reshape(n_rows, n_blocks, 2)
    return data.reshape(n_rows, n_blocks * type_size)


def assert_bit_equal(actual, expected):
    np.testing.assert_array_equal(actual, expected)
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


def oracle(data, qtype, n_cols):
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(-1, n_cols)


def test_numba_types():
    assert NUMBA_TYPES == frozenset(int(t) for t in ALL_TYPES)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_into_bit_exact(qtype):
    n_rows, n_cols = 7, 512
    data = random_tensor(qtype, n_rows, n_cols)
    out = np.full((n_rows, n_cols), np.nan, dtype=np.float32)
    dequantize_into(data, int(qtype), out)
    assert_bit_equal(out, oracle(data, qtype, n_cols))


def test_every_half_bit_pattern():
    """All 65536 halves (zeros, subnormals, normals, infs, NaN payloads) give numpy's
    float32 bits: the f16 scales of every quant type go through the same conversion."""
    halves = np.arange(65536, dtype=np.uint16).reshape(128, 512)
    out = np.empty(halves.shape, np.float32)
    dequantize_into(halves.view(np.uint8), int(T.F16), out)
    np.testing.assert_array_equal(out.view(np.uint32), halves.view(np.float16).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_into_gather(qtype):
    n_rows, n_cols = 7, 512
    data = random_tensor(qtype, n_rows, n_cols, seed=1)
    rows = np.array([3, 0, 6, 3, 1], dtype=np.int64)
    out = np.empty((len(rows), n_cols), dtype=np.float32)
    dequantize_rows_into(data, qtype, rows, out)
    assert_bit_equal(out, dequantize(data, qtype, n_cols)[rows])
    empty = np.empty((0, n_cols), dtype=np.float32)
    dequantize_rows_into(data, qtype, np.zeros(0, dtype=np.int64), empty)


def test_f16_all_bit_patterns():
    """Every half value (subnormals, inf, NaN payloads) converts like numpy."""
    data = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(64, 2048)
    assert_bit_equal(dequantize(data, T.F16, 1024), oracle(data, T.F16, 1024))


def test_dequantize_accepts_typed_views():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float16)
    assert_bit_equal(dequantize(x, T.F16, 64), x.astype(np.float32))
    y = x.astype(np.float32)
    assert_bit_equal(dequantize(y, T.F32, 64), y)


def test_fallback_to_gguf():
    data = random_tensor(T.TQ2_0, 2, 256)
    assert int(T.TQ2_0) not in NUMBA_TYPES
    assert_bit_equal(dequantize(data, T.TQ2_0, 256), oracle(data, T.TQ2_0, 256))


def test_unsupported_type_raises():
    data = np.zeros((1, 66), dtype=np.uint8)
    out = np.empty((1, 256), dtype=np.float32)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize_into(data, int(T.IQ2_XXS), out)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize_rows_into(data, T.IQ2_XXS, np.zeros(1, dtype=np.int64), out)
    with pytest.raises(ValueError, match="Q8_K"):  # gguf-py cannot dequantize it either
        dequantize(np.zeros((1, 292), dtype=np.uint8), T.Q8_K, 256)
    with pytest.raises(ValueError, match="unknown GGML tensor type id 12345"):
        dequantize_into(data, 12345, out)


def test_argument_checks():
    data = random_tensor(T.Q8_0, 2, 64)
    with pytest.raises(ValueError, match="bytes"):
        dequantize_into(data, T.Q8_0, np.empty((2, 96), dtype=np.float32))
    with pytest.raises(ValueError, match="float32"):
        dequantize_into(data, T.Q8_0, np.empty((2, 64), dtype=np.float64))
    with pytest.raises(ValueError, match="rows"):
        dequantize_into(data, T.Q8_0, np.empty((3, 64), dtype=np.float32))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_into(data[:, :34], T.Q8_0, np.empty((2, 32), dtype=np.float32))
    with pytest.raises(IndexError):
        dequantize_rows_into(data, T.Q8_0, np.array([2], dtype=np.int64),
                             np.empty((1, 64), dtype=np.float32))
    with pytest.raises(ValueError, match="int64"):
        dequantize_rows_into(data, T.Q8_0, np.array([0], dtype=np.int32),
                             np.empty((1, 64), dtype=np.float32))


@pytest.mark.parametrize("name", ["tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny-Q2_K.gguf"])
def test_model_tensors_bit_exact(name):
    path = MODELS / name
    if not path.exists():
        pytest.skip(f"reference model {path} not present")
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        n_cols = int(t.shape[0])
        raw = t.data.view(np.uint8).reshape(-1, t.n_bytes // int(np.prod(t.shape[1:])))
        out = np.empty((raw.shape[0], n_cols), dtype=np.float32)
        dequantize_into(raw, int(t.tensor_type), out)
        try:
            assert_bit_equal(out, oracle(t.data, t.tensor_type, n_cols))
        except AssertionError as e:
            raise AssertionError(f"{name}: tensor {t.name} ({t.tensor_type.name})") from e
