"""qdot (kernels/qdot.py, kernels/qdot_ref.py): activation rows quantized per block and
multiplied with quantized weight rows as llama.cpp's CPU backend does. The numba kernels
bit for bit against the numpy references for every type, G = 1..16 rows, special rows
(zeros, ties, negative maxima, tiny and large values); q8_0 against gguf's quantizer;
the references' float order against literal transliterations of ggml's C for the bench
model's types (the 32-value types: its x86 kernels; the K-quants: its generic code); the
references' value against the float64 product of gguf's dequantized operands; a column
block as `out`; the reference models' tensors; the argument checks."""
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import njit
from op_helpers import random_tensor

from llamatune.kernels import qdot
from llamatune.kernels.qdot import QDOT_TYPES, qdot_into, quantize_rows
from llamatune.kernels.qdot_ref import ACTIVATION, BLOCK, qdot_ref, quantize_rows_ref, unpack_k, unpack_legacy

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
F32 = np.float32


def assert_bits(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


def activations(G: int, K: int, seed: int = 0) -> np.ndarray:
    """G rows of K values: normal rows, and (when G allows) a row of zeros with one
    non-zero block, a row of exact ties for the rounding (x * id = k + 1/2), a row whose
    largest value is negative, tiny values (f16-subnormal scales) and large ones."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((G, K)).astype(F32)
    special = [np.zeros(K, F32), np.tile(np.arange(-16, 16, dtype=F32) + F32(0.5), K // 32),
               -np.abs(x[0]) * F32(3), x[0] * F32(1e-6), x[0] * F32(3e3)]
    special[0][40:72] = x[0, 40:72]
    special[1][::32] = F32(127)                      # id = 1: the rest are ties
    for i, row in enumerate(special[: max(0, G - 1)]):
        x[i + 1] = row
    return x


def test_types():
    assert QDOT_TYPES == frozenset(int(t) for t in TYPES)


@pytest.mark.parametrize("kind", ["q8_0", "q8_1", "q8_K"])
def test_quantize_rows_bit_exact(kind):
    x = activations(6, 512)
    got, ref = quantize_rows(x, kind), quantize_rows_ref(x, kind)
    for a, b in zip(got, ref):
        assert_bits(a, b)
    if kind == "q8_K":                                # the zero block quantizes to zeros, d 0
        assert (got.qs[1, :32] == 0).all() and got.d[1, 1] == 0
    assert not np.array_equal(got.qs[1], np.zeros_like(got.qs[1]))


def test_quantize_q8_0_ref_matches_gguf():
    x = activations(6, 512)
    blocks = gguf.quants.quantize(x, T.Q8_0).reshape(6, 16, 34)
    ref = quantize_rows_ref(x, "q8_0")
    assert_bits(ref.qs, blocks[..., 2:].view(np.int8).reshape(6, 512))
    assert_bits(ref.d, blocks[..., :2].copy().view(np.float16)[..., 0].astype(F32))


def test_q8_1_sum_and_q8_K_bsums():
    """q8_1's s is f16(sum(qs) d), q8_K's bsums the sums of 16 quants, d = 1/iscale."""
    x = activations(4, 256)
    q1, qk = quantize_rows_ref(x, "q8_1"), quantize_rows_ref(x, "q8_K")
    d_unrounded = np.abs(x.reshape(4, 8, 32)).max(-1) / F32(127)
    assert_bits(q1.s, (q1.qs.reshape(4, 8, 32).sum(-1).astype(F32) * d_unrounded).astype(np.float16).astype(F32))
    np.testing.assert_array_equal(qk.bsums, qk.qs.reshape(4, 16, 16).astype(np.int32).sum(-1))
    assert qk.qs.max() <= 127 and qk.qs.min() >= -127


@njit
def _round_all(v, out):
    for i in range(v.shape[0]):
        out[i] = qdot._round_f16(v[i])


def test_round_f16_matches_numpy():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x477FEFFF, 0x477FF000, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x7F800000,
                      0x80000000, 0x477FE000, 0x3F801000, 0x3F803000], np.uint32)
    v = np.concatenate([bits, edges, edges | np.uint32(0x80000000)]).view(F32)
    v = v[~np.isnan(v)]
    out = np.empty_like(v)
    _round_all(v, out)
    with np.errstate(over="ignore"):
        assert_bits(out, v.astype(np.float16).astype(F32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("G", [1, 3, 16])
def test_qdot_bit_exact(qtype, G):
    K = 512
    data = random_tensor(qtype, 37, K)
    x = activations(G, K, seed=G)
    out = np.full((G, 37), np.nan, F32)
    qdot_into(out, x, data, qtype)
    assert_bits(out, qdot_ref(x, data, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_qdot_one_row_special_rows(qtype):
    """A decode step's one-row kernels (their own code: `_legacy_rows` with one row,
    `_k_row`) on each special row: zeros, ties, negative maxima, tiny and large values."""
    K = 768
    data = random_tensor(qtype, 19, K, seed=7)
    x = activations(6, K, seed=11)
    for g in range(6):
        out = np.full((1, 19), np.nan, F32)
        qdot_into(out, x[g:g + 1], data, qtype)
        assert_bits(out, qdot_ref(x[g:g + 1], data, qtype))


@pytest.mark.parametrize("qtype", TYPES[:5], ids=lambda t: t.name)
@pytest.mark.parametrize("G", [1, 9])
def test_qdot_bit_exact_partial_groups(qtype, G):
    """K of 13 blocks (an odd count; the bench model's 896 is 28) and G = 9 (a second
    group of eight rows, padded)."""
    K = 32 * 13
    data = random_tensor(qtype, 21, K, seed=5)
    x = activations(G, K, seed=G + 3)
    out = np.full((G, 21), np.nan, F32)
    qdot_into(out, x, data, qtype)
    assert_bits(out, qdot_ref(x, data, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_ref_is_the_dequantized_product(qtype):
    """The reference's value: the float64 product of gguf's dequantized W and the
    dequantized activation blocks (q8_1 types: their m term takes s, f16-rounded, so 1e-3)."""
    K = 512
    data = random_tensor(qtype, 9, K)
    x = activations(3, K)
    xq = quantize_rows_ref(x, ACTIVATION[int(qtype)])
    bs = BLOCK[ACTIVATION[int(qtype)]]
    xd = (xq.qs.reshape(3, -1, bs) * xq.d[..., None].astype(np.float64)).reshape(3, K)
    W = np.asarray(gguf.quants.dequantize(data, qtype), np.float64).reshape(9, K)
    expected = xd @ W.T
    tol = 1e-3 if qtype in (T.Q4_1, T.Q5_1) else 2e-5
    np.testing.assert_allclose(qdot_ref(x, data, qtype), expected, rtol=0, atol=tol * np.abs(expected).max())


def _c_q5_0(xq, data):
    """ggml_vec_dot_q5_0_q8_0's AVX2 kernel (arch/x86/quants.c), step for step with a
    multiply and an add for its fused multiply-add (one row pair): eight lanes of four
    consecutive products, accumulated per block in float lanes, then hsum_float_8."""
    w, dx, _ = unpack_legacy(data[None], T.Q5_0)
    acc = [F32(0)] * 8
    for ib in range(w.shape[1]):
        d = F32(dx[0, ib] * xq.d[0, ib])
        for lane in range(8):
            q = sum(int(w[0, ib, 4 * lane + j]) * int(xq.qs[0, 32 * ib + 4 * lane + j]) for j in range(4))
            acc[lane] = F32(acc[lane] + F32(d * F32(q)))
    res = [F32(acc[i] + acc[i + 4]) for i in range(4)]               # _mm256_extractf128_ps + add
    res = [F32(res[0] + res[2]), F32(res[1] + res[3])]               # + _mm_movehl_ps
    return F32(res[0] + res[1])                                      # + _mm_movehdup_ps


def _c_q4_k(xq, data):
    """ggml_vec_dot_q4_K_q8_K_generic, statement for statement (one row pair)."""
    w, sc16, mn16, dx, dminx = unpack_k(data[None], T.Q4_K)
    sums = [F32(0)] * 8
    sumf = F32(0)
    for i in range(w.shape[1]):
        aux32 = [0] * 8
        q8, a = xq.qs[0, 256 * i:256 * i + 256].astype(np.int64), w[0, i]
        sumi = sum(int(xq.bsums[0, 16 * i + j]) * int(mn16[0, i, j]) for j in range(16))
        for j in range(16):                        # QK_K/32 sub-blocks, each twice 16 values
            for k in range(2):
                for l in range(8):
                    p = 16 * j + 8 * k + l
                    aux32[l] += int(sc16[0, i, j]) * int(q8[p] * a[p])
        d = F32(dx[0, i] * xq.d[0, i])
        for l in range(8):
            sums[l] = F32(sums[l] + F32(d * F32(aux32[l])))
        dmin = F32(dminx[0, i] * xq.d[0, i])
        sumf = F32(sumf - F32(dmin * F32(sumi)))
    for l in range(8):
        sumf = F32(sumf + sums[l])
    return sumf


@pytest.mark.parametrize("qtype,c_dot", [(T.Q5_0, _c_q5_0), (T.Q4_K, _c_q4_k)], ids=["Q5_0", "Q4_K"])
def test_ref_order_is_ggmls(qtype, c_dot):
    """Q5_0 in the order of ggml's x86 kernel, Q4_K in its generic C order."""
    K = 768
    data = random_tensor(qtype, 4, K, seed=3)
    x = activations(2, K, seed=4)
    ref = qdot_ref(x, data, qtype)
    for g in range(2):
        xq = quantize_rows_ref(x[g:g + 1], ACTIVATION[int(qtype)])
        for n in range(4):
            assert_bits(ref[g, n:n + 1], np.array([c_dot(xq, data[n])], F32))


def test_out_may_be_a_column_block():
    data = random_tensor(T.Q6_K, 20, 256)
    x = activations(2, 256)
    wide = np.full((2, 50), 7.0, F32)
    qdot_into(wide[:, 10:30], x, data, T.Q6_K)
    assert_bits(wide[:, 10:30].copy(), qdot_ref(x, data, T.Q6_K))
    assert (wide[:, :10] == 7).all() and (wide[:, 30:] == 7).all()


def test_reference_model_tensors():
    path = MODELS / "tiny-Q4_K_M.gguf"
    if not path.exists():
        pytest.skip(f"{path} not found")
    r = gguf.GGUFReader(path)
    seen = set()
    for t in r.tensors:
        if int(t.tensor_type) not in QDOT_TYPES or len(t.shape) != 2 or t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        K = int(t.shape[0])
        data = np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)[:24])
        x = activations(2, K)
        out = np.empty((2, 24), F32)
        qdot_into(out, x, data, int(t.tensor_type))
        assert_bits(out, qdot_ref(x, data, int(t.tensor_type)))
    assert seen


def test_argument_checks():
    data = random_tensor(T.Q4_K, 4, 256)
    x = np.ones((1, 256), F32)
    with pytest.raises(ValueError, match="no quantized dot product for GGML type F32"):
        qdot_into(np.empty((1, 4), F32), x, data, T.F32)
    with pytest.raises(ValueError, match="no quantized dot product for GGML type id 99"):
        qdot_into(np.empty((1, 4), F32), x, data, 99)
    with pytest.raises(ValueError, match="K 128 is not a multiple of block size 256"):
        qdot_into(np.empty((1, 4), F32), np.ones((1, 128), F32), data, T.Q4_K)
    with pytest.raises(ValueError, match=r"data must be C-contiguous uint8 \(N, 288\) for K 512"):
        qdot_into(np.empty((1, 4), F32), np.ones((1, 512), F32), data, T.Q4_K)
    with pytest.raises(ValueError, match=r"out must be a writeable float32 array of shape \(1, 4\)"):
        qdot_into(np.empty((1, 5), F32), x, data, T.Q4_K)
    with pytest.raises(ValueError, match="x must be a 2-D float32 array"):
        qdot_into(np.empty((1, 4), F32), x.astype(np.float64), data, T.Q4_K)
    with pytest.raises(ValueError, match="activation blocks 'q4_0'"):
        quantize_rows(x, "q4_0")
    with pytest.raises(ValueError, match="rows a multiple of 256"):
        quantize_rows(np.ones((1, 96), F32), "q8_K")
    with pytest.raises(ValueError, match="no quantized dot product"):
        qdot_ref(x, data, T.F16)


@pytest.mark.slow
def test_portable_products_bit_exact(tmp_path):
    """The kernels compiled without vpmaddwd, vpdpbusd, vpmaddubsw and F16C (numba told
    of a generic CPU: `_pairs`', `_lanes8`'s, `_madd_ubs`', `_madd_wd`'s and `_half`'s
    portable forms) give the reference's bits too, one row and eight."""
    import os
    import subprocess
    import sys
    code = ("import numpy as np, sys; sys.path.insert(0, %r)\n"
            "from op_helpers import random_tensor\n"
            "from llamatune.kernels import qdot\n"
            "from llamatune.kernels.qdot_ref import qdot_ref\n"
            "assert not (qdot._PMADDWD or qdot._VNNI or qdot._AVX2 or qdot._F16C)\n"
            "for t in (2, 3, 6, 8, 12, 13, 14):\n"
            "    for G in (1, 8):\n"
            "        d = random_tensor(t, 9, 256 * 3, seed=t)\n"
            "        x = np.random.default_rng(G).standard_normal((G, 256 * 3)).astype(np.float32)\n"
            "        out = np.empty((G, 9), np.float32)\n"
            "        qdot.qdot_into(out, x, d, t)\n"
            "        assert np.array_equal(out.view(np.int32), qdot_ref(x, d, t).view(np.int32)), (t, G)\n"
            % str(Path(__file__).parent))
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
