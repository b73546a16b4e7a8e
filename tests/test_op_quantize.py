"""Tests of llamatune.kernels.quantize: K-quant round-trip error, fidelity to
llama.cpp's llama-quantize output, and dispatch of the other types to gguf-py."""
import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from llamatune.kernels.quantize import QUANTIZABLE, _fp16, _nearest_int, quantize

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]

# Max per-block RMS error / block RMS over the blocks of rt_data() (gaussian,
# outlier and constant rows). Measured max (mean over gaussian blocks):
# Q2_K 0.319 (0.293), Q3_K 0.175 (0.151), Q4_K 0.106 (0.071), Q5_K 0.054 (0.036),
# Q6_K 0.039 (0.018); the max comes from the outlier rows, where the outlier
# widens the block's range (the constant 1e-3 row of Q6_K: 0.023, its f16 super-
# scale d ~ 2e-7 being subnormal).
REL_RMS_BOUND = {T.Q2_K: 0.35, T.Q3_K: 0.20, T.Q4_K: 0.12, T.Q5_K: 0.06, T.Q6_K: 0.045}


def dequant(q, qtype, shape):
    return np.asarray(gguf.quants.dequantize(q, qtype), dtype=np.float32).reshape(shape)


def rt_data():
    """22 x 512 rows: 16 gaussian, 4 with 40x outliers, constants of both signs."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((16, 512)) * 0.02
    o = rng.standard_normal((4, 512)) * 0.02
    o[:, ::61] *= 40
    c = np.array([[0.25], [-0.125], [1e-3], [-3.0]]) * np.ones((1, 512))
    return np.concatenate([g, o, c]).astype(np.float32)


# ------------------------------------------------------------------ helpers
def test_fp16_matches_numpy_rounding():
    """_fp16 = GGML_FP32_TO_FP16 (round to nearest even) incl. ties, subnormals,
    overflow; its value is the half's exact float32."""
    rng = np.random.default_rng(1)
    ties = (np.arange(1, 2048, dtype=np.float32) + np.float32(0.5)) * np.float32(2 ** -10)
    vals = np.concatenate([
        rng.standard_normal(500) * 10.0 ** rng.integers(-9, 6, 500),
        ties, ties * np.float32(2 ** -24), -ties * np.float32(2 ** -14),  # normal + subnormal ties
        [0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 2 ** -25, 2 ** -25 * 1.0001, 1e-30],
    ]).astype(np.float32)
    for v in vals:
        h, f = _fp16(v)
        with np.errstate(over="ignore"):
            ref = np.float32(v).astype(np.float16)
        assert h == int(ref.view(np.uint16)), v
        assert np.float32(f).view(np.uint32) == ref.astype(np.float32).view(np.uint32), v


def test_nearest_int_is_round_half_even():
    vals = np.concatenate([np.arange(-40, 40) * 0.25, [1e5 + 0.5, -4194303.0, 0.49999997]])
    for v in vals.astype(np.float32):
        assert _nearest_int(v) == int(np.rint(v)), v


# ----------------------------------------------------------- K-quant round trip
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quant_round_trip(qtype):
    x = rt_data()
    q = quantize(x, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    assert q.dtype == np.uint8 and q.shape == (x.shape[0], x.shape[1] // block_size * type_size)
    err = (dequant(q, qtype, x.shape) - x).reshape(-1, 256)
    rel = np.sqrt((err ** 2).mean(1) / (x.reshape(-1, 256) ** 2).mean(1))
    assert rel.max() < REL_RMS_BOUND[qtype], rel.max()

    zeros = np.zeros((3, 512), np.float32)
    assert np.all(dequant(quantize(zeros, qtype), qtype, zeros.shape) == 0)
    # a zero row among others is still exact, and rows are independent
    x[5] = 0
    q2 = quantize(x, qtype)
    assert np.all(dequant(q2[5:6], qtype, (1, 512)) == 0)
    np.testing.assert_array_equal(np.delete(q2, 5, 0), np.delete(q, 5, 0))


# sha256 (first 16 hex digits) of quantize_row_qX_K_ref's output for rt_data(), from
# a C build of llama.cpp's ggml-quants.c reference code (gcc -O3 -ffp-contract=off);
# the port also matched that build on every block of 20k blocks of stress data
# (scales 1e-6..1e3, heavy tails, one-signed, grid-valued and sparse rows).
GOLDEN_SHA256 = {T.Q2_K: "8f74f2395911d3b9", T.Q3_K: "38e6c46611497e88",
                 T.Q4_K: "306b0ee4ae979a8e", T.Q5_K: "32e5de63dedcc451",
                 T.Q6_K: "4e2e031d5c4b1593"}


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quant_matches_c_reference_bytes(qtype):
    digest = hashlib.sha256(quantize(rt_data(), qtype).tobytes()).hexdigest()[:16]
    assert digest == GOLDEN_SHA256[qtype]


# ------------------------------------------------------------ llama.cpp files
# Re-quantizing llama-quantize's dequantized tensors (first ROWS rows of every
# K-quant tensor in tiny-Q4_K_M.gguf and tiny-Q2_K.gguf). llama-quantize without an
# imatrix runs quantize_qX_K(..., NULL) -> quantize_row_qX_K_ref, the functions
# ported here. A dequantized block is not always a fixed point of those algorithms,
# so value-identical is the measure, bytes are reported. Measured on all rows:
#   type  bit-identical blocks   value-identical blocks
#   Q2_K  0.9888 of 39680        0.9888
#   Q3_K  0.5349 of  4608        0.5354
#   Q4_K  0.9996 of 42496        0.9996
#   Q6_K  0.6330 of 65792        0.9993 (same values, other (d, scale, q) signs)
# Q3_K: make_q3_quants' refinement sweeps are not idempotent; on fresh gaussian
# data the port's own quantize -> dequantize -> quantize keeps 0.55 of Q3_K blocks
# too (Q2_K 0.99, Q4_K 1.0, Q5_K 0.91, Q6_K 1.0 by value), so 0.535 is the
# algorithm, not a porting error. (Against a C build of the same _ref code compiled
# with -ffp-contract=off, this port is byte-identical on every block; a GCC
# -march=native build, which fuses a*b+c into FMAs, matches llama-quantize's Q2_K
# blocks only 0.83 of the time, so the model files came from a non-FMA build.)
ROWS = 256
MIN_VALUE_IDENTICAL = {T.Q2_K: 0.97, T.Q3_K: 0.45, T.Q4_K: 0.995, T.Q6_K: 0.995}


def _model_tensors():
    for name in ("tiny-Q4_K_M.gguf", "tiny-Q2_K.gguf"):
        path = MODELS / name
        if not path.exists():
            pytest.skip(f"{path} not present (llama.cpp reference models)")
        for t in gguf.GGUFReader(path).tensors:
            if t.tensor_type in K_TYPES:
                q = np.asarray(t.data)
                yield t.tensor_type, q.reshape(-1, q.shape[-1])[:ROWS]


def test_fidelity_to_llama_quantize():
    stats = {}
    for qtype, q in _model_tensors():
        type_size = GGML_QUANT_SIZES[qtype][1]
        x = dequant(q, qtype, (q.shape[0], -1))
        q2 = quantize(x, qtype)
        s = stats.setdefault(qtype, np.zeros(3, np.int64))
        s[0] += (q2.reshape(-1, type_size) == q.reshape(-1, type_size)).all(1).sum()
        s[1] += (dequant(q2, qtype, x.shape).reshape(-1, 256) == x.reshape(-1, 256)).all(1).sum()
        s[2] += x.size // 256
    assert set(stats) == set(MIN_VALUE_IDENTICAL)
    report = {t.name: f"bytes {b / n:.4f} values {v / n:.4f} of {n}" for t, (b, v, n) in stats.items()}
    print(report)
    for qtype, (_, v, n) in stats.items():
        assert v / n >= MIN_VALUE_IDENTICAL[qtype], report


# --------------------------------------------------------------- gguf dispatch
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4],
                         ids=lambda t: t.name)
def test_gguf_types_dispatch(qtype):
    x = rt_data()[:, :256]
    q = quantize(x, qtype)
    ref = np.ascontiguousarray(gguf.quants.quantize(x, qtype)).view(np.uint8).reshape(x.shape[0], -1)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    assert q.dtype == np.uint8 and q.shape == (x.shape[0], 256 // block_size * type_size)
    np.testing.assert_array_equal(q, ref)


def test_quantizable_and_errors():
    assert QUANTIZABLE == frozenset(K_TYPES) | {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1,
                                                T.Q5_0, T.Q5_1, T.MXFP4, T.IQ4_NL, T.IQ4_XS}
    x = np.zeros((2, 256), np.float32)
    for bad in (T.IQ2_XXS, T.Q8_K, T.TQ1_0, T.IQ3_S):
        with pytest.raises(ValueError, match=bad.name):
            quantize(x, bad)
    with pytest.raises(ValueError, match="Q4_K.*multiple of 256"):
        quantize(np.zeros((2, 96), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros(256, np.float32), T.Q6_K)
    np.testing.assert_array_equal(quantize(x, "Q4_K"), quantize(x, int(T.Q4_K)))
