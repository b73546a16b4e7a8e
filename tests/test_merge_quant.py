"""Tests of the merge's quantizers: the importance-weighted quantizers
(kernels/quantize_weighted.py, llama.cpp's quantize_row_*_impl) and the
error-compensating one (kernels/compensate.py) against its numpy reference."""
import hashlib

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from llamatune.kernels.compensate import (damped, inverse_cholesky, lower_cholesky_inverse, lower_inverse,
                                          quantize_compensated, quantize_compensated_ref)
from llamatune.kernels.dequant import dequantize
from llamatune.kernels.quantize import quantize
from llamatune.kernels.quantize_weighted import WEIGHTED, quantize_weighted
from test_op_quantize import rt_data

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def weights(n=512, seed=3):
    qw = (np.random.default_rng(seed).random(n) ** 3 * 5).astype(np.float32)
    qw[7] = 0
    return qw


# sha256[:16] of quantize_<type>(rt_data(), ..., weights()) from ggml-quants.c built with
# gcc -O3 -ffp-contract=off (its quantize_row_*_impl code, stubs for ggml_row_size etc.);
# the port also matched that build on every block of 64 x 512 heavy-tailed rows per type.
GOLDEN_SHA256 = {T.Q4_0: "984b25ec6bb2a89b", T.Q4_1: "a866049404a3f61f", T.Q5_0: "37ef48dd7005d32f",
                 T.Q5_1: "1701d553e188d0ab", T.Q2_K: "c09b72f6adefa71d", T.Q3_K: "664eead70684c964",
                 T.Q4_K: "1d7ef4a8416dedda", T.Q5_K: "f6100df57c4574b7", T.Q6_K: "0686ecba8a566646"}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_weighted_matches_c_reference_bytes(qtype):
    q = quantize_weighted(rt_data(), qtype, weights())
    assert hashlib.sha256(q.tobytes()).hexdigest()[:16] == GOLDEN_SHA256[qtype]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_weighted_lowers_the_weighted_error(qtype):
    """With skewed importances the weighted quantizer's importance-weighted error is
    lower than the plain quantizer's on every block-aligned row group."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((32, 512)) * 0.02).astype(np.float32)
    qw = np.exp(rng.standard_normal(512) * 2).astype(np.float32)
    err = {}
    for name, q in (("plain", quantize(x, qtype)), ("weighted", quantize_weighted(x, qtype, qw))):
        err[name] = ((dequantize(q, qtype, 512) - x) ** 2 * qw).sum()
    assert err["weighted"] < 0.9 * err["plain"], err


def test_weighted_falls_back_and_checks():
    x = rt_data()
    np.testing.assert_array_equal(quantize_weighted(x, T.Q4_K, None), quantize(x, T.Q4_K))
    np.testing.assert_array_equal(quantize_weighted(x, T.Q8_0, weights()), quantize(x, T.Q8_0))
    assert WEIGHTED == frozenset(TYPES) | {T.IQ4_NL, T.IQ4_XS}      # (tests/test_quantize_iq4.py)
    with pytest.raises(ValueError, match="256 importance weights for 512 columns"):
        quantize_weighted(x, T.Q4_0, weights(256))
    bad = weights()
    bad[3] = -1
    with pytest.raises(ValueError, match="finite and non-negative"):
        quantize_weighted(x, T.Q4_0, bad)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_weighted(x[:, :96], T.Q4_K, weights(96))
    # the legacy types' sigma2 override: the row's own mean x^2 gives the same bytes
    sig = np.zeros(len(x), np.float32)
    for i, row in enumerate(x):                      # C's order: a float32 sum, left to right
        for v in row:
            sig[i] += v * v
    sig /= np.float32(512)
    np.testing.assert_array_equal(quantize_weighted(x, T.Q5_0, weights(), sig),
                                  quantize_weighted(x, T.Q5_0, weights()))


# ------------------------------------------------------------------ compensation
def correlated(n_in, n_tok=2000, seed=0):
    """Inputs with strongly correlated, unequal columns, and their second moment."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((n_in, n_in)) / np.sqrt(n_in) + np.eye(n_in)
    x = rng.standard_normal((n_tok, n_in)) @ mix * np.exp(rng.standard_normal(n_in))
    x[:, 5] = 0                                           # one dead input
    return x, x.T @ x / n_tok


def test_inverse_cholesky():
    _, h = correlated(300)                                  # 300: the triangular inverse recurses
    u = inverse_cholesky(h)
    np.testing.assert_array_equal(u, np.triu(u))
    np.testing.assert_allclose(u.T @ u @ damped(h), np.eye(300), atol=1e-8)
    m = np.linalg.cholesky(damped(h))
    np.testing.assert_allclose(lower_cholesky_inverse(damped(h)) @ m, np.eye(300), atol=1e-10)
    inv = lower_inverse(m)                                   # the GPTQ loop's group inverses
    np.testing.assert_array_equal(inv, np.tril(inv))
    np.testing.assert_allclose(inv @ m, np.eye(300), atol=1e-10)
    u32 = inverse_cholesky(h, dtype=np.float32)               # export's factor, as GPTQ's
    assert u32.dtype == np.float32
    np.testing.assert_array_equal(u32, np.triu(u32))
    np.testing.assert_allclose(u32.astype(np.float64).T @ u32 @ damped(h), np.eye(300), atol=2e-3)


@pytest.mark.parametrize("qtype,n_in", [(T.Q4_0, 256), (T.Q8_0, 256), (T.Q4_K, 1024), (T.Q3_K, 768)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_compensated_matches_reference(qtype, n_in):
    x, h = correlated(n_in)
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((12, n_in)) * 0.05).astype(np.float32)
    qw = np.diagonal(h).astype(np.float32)
    base = quantize(w + rng.standard_normal(w.shape).astype(np.float32) * 0.003, qtype)
    u = inverse_cholesky(h)
    for b in (None, base):
        ref = quantize_compensated_ref(w, qtype, h, qw, b)
        np.testing.assert_array_equal(quantize_compensated(w, qtype, u, qw, b, leaf=512), ref)
        np.testing.assert_array_equal(quantize_compensated(w, qtype, u, qw, b, leaf=n_in), ref)
        work = w.astype(u.dtype)                        # the default spans, w used as the work array
        np.testing.assert_array_equal(quantize_compensated(work, qtype, u, qw, b, overwrite=True), ref)


@pytest.mark.parametrize("qtype,sizes", [(T.Q4_0, (256, 96, 160)), (T.Q4_K, (512, 256))],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_block_diagonal_matches_reference(qtype, sizes):
    """Factors of H's diagonal blocks (damped by the whole H's mean diagonal) give the
    reference's codes on H with everything off those blocks zeroed."""
    n_in = sum(sizes)
    _, h = correlated(n_in)
    h[3, 3] = 0                                            # a dead input: damped() makes it 1
    cuts = np.cumsum((0,) + sizes)
    blocks = [h[a:b, a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    masked = np.zeros_like(h)
    for (a, b), blk in zip(zip(cuts[:-1], cuts[1:]), blocks):
        masked[a:b, a:b] = blk
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((10, n_in)) * 0.05).astype(np.float32)
    qw = np.diagonal(h).astype(np.float32)
    base = quantize(w + rng.standard_normal(w.shape).astype(np.float32) * 0.003, qtype)
    u = inverse_cholesky(blocks)
    assert [x.shape[0] for x in u] == list(sizes)
    for b in (None, base):
        np.testing.assert_array_equal(quantize_compensated(w, qtype, u, qw, b, leaf=128),
                                      quantize_compensated_ref(w, qtype, masked, qw, b))
    assert not np.array_equal(quantize_compensated(w, qtype, u, qw), quantize_compensated_ref(w, qtype, h, qw))
    with pytest.raises(ValueError, match="do not tile"):
        quantize_compensated(w, qtype, u[:-1], qw)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_compensation_lowers_the_output_error(qtype):
    """The output error ||(W - Q) x||^2 on the data that H came from: plain > weighted
    (diagonal of H) > compensated (whole H)."""
    x, h = correlated(512)
    w = (np.random.default_rng(2).standard_normal((64, 512)) * 0.05).astype(np.float32)
    qw = np.diagonal(h).astype(np.float32)

    def out_err(q):
        return float(np.sum(((dequantize(q, qtype, 512) - w) @ x.T) ** 2))
    plain = out_err(quantize(w, qtype))
    weighted = out_err(quantize_weighted(w, qtype, qw))
    comp = out_err(quantize_compensated(w, qtype, inverse_cholesky(h), qw))
    assert comp < 0.8 * weighted < 0.8 * plain, (plain, weighted, comp)
    comp32 = out_err(quantize_compensated(w, qtype, inverse_cholesky(h, dtype=np.float32), qw))   # f32 updates
    assert abs(comp32 - comp) < 0.02 * comp, (comp, comp32)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q2_K, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_unchanged_weight_keeps_its_bytes(qtype):
    """A target equal to the base's dequantized codes gives back the base's bytes
    (K-quant codes are not a fixed point of their quantizer, so this needs the base)."""
    _, h = correlated(512)
    rng = np.random.default_rng(4)
    base = quantize((rng.standard_normal((16, 512)) * 0.05).astype(np.float32), qtype)
    w = dequantize(base, qtype, 512)
    u = inverse_cholesky(h)
    np.testing.assert_array_equal(quantize_compensated(w, qtype, u, np.diagonal(h), base), base)
    np.testing.assert_array_equal(quantize_compensated(w, qtype, np.eye(512), None, base), base)
    np.testing.assert_array_equal(quantize_compensated(w, qtype, np.ones(512), None, base), base)


def test_diagonal_u_equals_the_diagonal_matrix():
    """u given as its diagonal (no cross terms) is the same computation as the matrix."""
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((8, 512)) * 0.05).astype(np.float32)
    d = np.exp(rng.standard_normal(512))
    base = quantize(w + rng.standard_normal(w.shape).astype(np.float32) * 0.01, T.Q4_K)
    for qtype, b in ((T.Q4_K, base), (T.Q5_0, None)):
        np.testing.assert_array_equal(quantize_compensated(w, qtype, d, d.astype(np.float32), b),
                                      quantize_compensated(w, qtype, np.diag(d), d.astype(np.float32), b))


def test_compensated_checks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_compensated(np.zeros((2, 96), np.float32), T.Q4_K, np.eye(96))
    with pytest.raises(ValueError, match="base codes of shape"):
        quantize_compensated(np.zeros((2, 256), np.float32), T.Q4_K, np.eye(256),
                             base=np.zeros((2, 10), np.uint8))
    with pytest.raises(ValueError, match="not positive definite"):
        inverse_cholesky(np.array([[1.0, 2.0], [2.0, 1.0]]), damp=0.0)
