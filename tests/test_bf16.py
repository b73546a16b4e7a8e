"""bf16 conversions (bit-exact against a numpy reference and hand-worked values), GGUF
dequantization straight to bf16, bf16 products through oneDNN within the rounding
bounds, and the compute-dtype resolver (with the library hidden)."""
import numpy as np
import pytest
from op_helpers import ALL_TYPES, random_tensor

from llamatune.errors import LlamatuneError
from llamatune.kernels import bf16, dequant
from llamatune.precision import compute_dtype

U = 2.0 ** -24  # float32 unit roundoff
UB = 2.0 ** -9  # bf16 unit roundoff (8 significant bits, round to nearest)

native = pytest.mark.skipif(not (bf16.cpu_bf16_flags() and bf16.available()),
                            reason="needs oneDNN (pip install 'llamatune[cpu-bf16]') and a CPU "
                                   "with avx512_bf16 or amx_bf16")
needs_library = pytest.mark.skipif(not bf16.available(), reason="needs oneDNN (pip install 'llamatune[cpu-bf16]')")


def bits(*u32):
    return np.array(u32, dtype=np.uint32).view(np.float32)


def special_values():
    """Every exponent with several mantissas, ties both ways, NaNs with payloads,
    infinities, zeros, subnormals, values that round up to infinity."""
    rng = np.random.default_rng(0)
    exps = np.arange(256, dtype=np.uint32) << 23
    mants = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0x18000, 0x10000, 0x7FFFFF, 0x7F8000,
                      0x7F7FFF], dtype=np.uint32)
    grid = (exps[:, None] | mants[None, :]).reshape(-1)
    randoms = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    u = np.concatenate([grid, grid | 0x80000000, randoms])
    return u.view(np.float32)


def test_to_bf16_hand_worked():
    x = bits(0x3F808000,   # 1 + 2^-8: a tie, to the even 1.0
             0x3F818000,   # 1 + 3*2^-8: a tie, up to the even 1 + 2^-6
             0x3F808001,   # just above the tie: up
             0x7F7FFFFF,   # largest float32: past bf16's largest, rounds to +inf
             0xFF800000,   # -inf
             0x7F800001,   # signalling NaN with a low payload: quiet NaN
             0xFFC12345,   # negative quiet NaN: sign and top payload kept
             0x00000001,   # smallest subnormal: rounds to +0
             0x00018000,   # subnormal tie, up to the even 0x0002
             0x80000000)   # -0
    expected = np.array([0x3F80, 0x3F82, 0x3F81, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0000,
                         0x0002, 0x8000], dtype=np.uint16)
    out = np.zeros(x.shape, np.uint16)
    bf16.to_bf16(out, x)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(bf16.to_bf16_ref(x), expected)


def test_to_bf16_matches_reference():
    x = special_values().reshape(2, -1)
    out = np.zeros(x.shape, np.uint16)
    bf16.to_bf16(out, x)
    np.testing.assert_array_equal(out, bf16.to_bf16_ref(x))
    # finite results are the nearest bf16: no other bf16 is closer
    finite = np.isfinite(x) & np.isfinite(bf16.from_bf16_ref(out))
    err = np.abs(bf16.from_bf16_ref(out)[finite].astype(np.float64) - x[finite])
    ulp = np.abs(bf16.from_bf16_ref(out[finite] | 1).astype(np.float64)
                 - bf16.from_bf16_ref(out[finite] & 0xFFFE))
    assert np.all(err <= ulp / 2)


def test_to_bf16_transposed():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((70, 131)).astype(np.float32)
    x[3, 5], x[60, 130] = np.nan, np.inf
    out = np.empty((131, 70), np.uint16)
    bf16.to_bf16_transposed(out, x)
    np.testing.assert_array_equal(out, bf16.to_bf16_ref(x).T)
    with pytest.raises(ValueError, match="out must be a C-contiguous uint16 array of shape"):
        bf16.to_bf16_transposed(np.empty((70, 131), np.uint16), x)
    with pytest.raises(ValueError, match="x must be a 2-D C-contiguous float32"):
        bf16.to_bf16_transposed(out, x[:, :70].T)


def test_to_bf16_of_a_column_slice():
    x = special_values()[:40 * 64].reshape(40, 64)
    out = np.zeros((40, 24), np.uint16)
    bf16.to_bf16(out, x[:, 30:54])
    np.testing.assert_array_equal(out, bf16.to_bf16_ref(x[:, 30:54]))


def test_from_bf16_every_pattern_and_round_trip():
    h = np.arange(2 ** 16, dtype=np.uint16)
    out = np.zeros(h.shape, np.float32)
    bf16.from_bf16(out, h)
    np.testing.assert_array_equal(out.view(np.uint32), h.astype(np.uint32) << 16)
    np.testing.assert_array_equal(out.view(np.uint32), bf16.from_bf16_ref(h).view(np.uint32))
    back = np.zeros(h.shape, np.uint16)
    bf16.to_bf16(back, out)
    nan = np.isnan(out)
    np.testing.assert_array_equal(back[~nan], h[~nan])  # exact for every non-NaN
    np.testing.assert_array_equal(back[nan], h[nan] | 0x40)  # NaNs come back quiet


def test_conversion_argument_checks():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="to_bf16: x must be a C-contiguous float32 array .or 2-D with contiguous rows."):
        bf16.to_bf16(np.zeros((2, 3), np.uint16), x.astype(np.float64))
    with pytest.raises(ValueError, match="to_bf16: x must be a C-contiguous float32"):
        bf16.to_bf16(np.zeros((3, 2), np.uint16), x.T)
    with pytest.raises(ValueError, match=r"to_bf16: out must be a C-contiguous uint16 array of shape \(2, 3\)"):
        bf16.to_bf16(np.zeros((3, 2), np.uint16), x)
    with pytest.raises(ValueError, match="from_bf16: x must be a C-contiguous uint16"):
        bf16.from_bf16(x, x)
    out = np.zeros((2, 3), np.uint16)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="to_bf16: out must be writeable"):
        bf16.to_bf16(out, x)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_to_bf16_bit_identical(qtype):
    n_rows, n_cols = 7, 512
    data = random_tensor(qtype, n_rows, n_cols)
    f32 = np.zeros((n_rows, n_cols), np.float32)
    dequant.dequantize_into(data, int(qtype), f32)
    out = np.zeros((n_rows, n_cols), np.uint16)
    bf16.dequantize_into(data, int(qtype), out)
    np.testing.assert_array_equal(out, bf16.to_bf16_ref(f32))
    rows = np.array([6, 0, 3, 3], np.int64)                # the gather kernels' uint16 versions
    gathered = np.zeros((4, n_cols), np.uint16)
    dequant.dequantize_rows_into(data, int(qtype), rows, gathered)
    np.testing.assert_array_equal(gathered, bf16.to_bf16_ref(f32[rows]))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_into_wider_rows(qtype):
    """With n_cols, the kernels write the first n_cols of each wider row (the weight of a
    product whose K axis carries an adapter's parts) and leave the rest as it was."""
    n_rows, n_cols, extra = 7, 512, 32
    data = random_tensor(qtype, n_rows, n_cols)
    want = np.zeros((n_rows, n_cols), np.uint16)
    bf16.dequantize_into(data, int(qtype), want)
    out = np.full((n_rows, n_cols + extra), 0xBEEF, np.uint16)
    bf16.dequantize_into(data, int(qtype), out, n_cols)
    np.testing.assert_array_equal(out[:, :n_cols], want)
    assert (out[:, n_cols:] == 0xBEEF).all()
    f32 = np.full((n_rows, n_cols + extra), 7.0, np.float32)
    dequant.dequantize_into(data, int(qtype), f32, n_cols)
    np.testing.assert_array_equal(bf16.to_bf16_ref(f32[:, :n_cols]), want)
    assert (f32[:, n_cols:] == 7.0).all()


def test_to_bf16_rows_and_the_split_parts():
    """to_bf16_rows rounds into the first columns of wider rows; split_into writes a
    float32 operand's three bf16 parts (hi, lo = bf16(v - hi)) in the order of its side
    and zeros to the end of the rows; split_rows_into stacks them as rows. hi + lo gives
    v to 2^-16 of |v| (v's lowest bits are all that is lost)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 40)).astype(np.float32) * np.float32(3.0)
    out = np.full((9, 40 + 24), 0x1234, np.uint16)
    bf16.to_bf16_rows(out, x)
    np.testing.assert_array_equal(out[:, :40], bf16.to_bf16_ref(x))
    assert (out[:, 40:] == 0x1234).all()
    v = rng.standard_normal((9, 5)).astype(np.float32) * np.float32(1e-3)
    hi, lo = bf16.split_ref(v)
    np.testing.assert_allclose(bf16.from_bf16_ref(hi).astype(np.float64) + bf16.from_bf16_ref(lo), v,
                               rtol=2.0 ** -16, atol=0)
    assert np.abs(bf16.from_bf16_ref(lo)).max() > 0
    wide = np.full((9, 40 + 32), 0x1234, np.uint16)
    bf16.to_bf16_rows(wide, x)
    for side, order in (("a", (hi, hi, lo)), ("b", (hi, lo, hi))):
        bf16.split_into(wide, v, 40, side)
        np.testing.assert_array_equal(wide[:, :40], bf16.to_bf16_ref(x))
        np.testing.assert_array_equal(wide[:, 40:55], np.concatenate(order, axis=1))
        assert (wide[:, 55:] == 0).all()
    rows = np.full((20 + 32, 4), 0x1234, np.uint16)
    bf16.split_rows_into(rows, np.ascontiguousarray(v[:4].T), 20, "b")   # (5, 4) stacked under 20 rows
    vt = np.ascontiguousarray(v[:4].T)
    h, l_ = bf16.split_ref(vt)
    np.testing.assert_array_equal(rows[20:35], np.concatenate((h, l_, h), axis=0))
    assert (rows[:20] == 0x1234).all() and (rows[35:] == 0).all()
    with pytest.raises(ValueError, match="room for 3 x 5 columns from column 60"):
        bf16.split_into(wide, v, 60, "a")
    with pytest.raises(ValueError, match="at least 40 wide"):
        bf16.to_bf16_rows(np.zeros((9, 39), np.uint16), x)


def test_dequantize_to_bf16_argument_checks():
    data = random_tensor(dequant.T.Q8_0, 2, 64)
    with pytest.raises(ValueError, match="out must be a writeable C-contiguous 2-D uint16"):
        bf16.dequantize_into(data, int(dequant.T.Q8_0), np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match=r"data must be 2-D with 3 rows, got shape \(2, 68\)"):
        bf16.dequantize_into(data, int(dequant.T.Q8_0), np.zeros((3, 64), np.uint16))


def product_bounds(a32, b32, trans_b):
    """|out - exact| bounds of a bf16 product with float32 accumulation, elementwise:
    against the same bf16 inputs multiplied exactly (the products of bf16 values are
    exact in float32, K float32 additions: (K+1) U sum|a~||b~|), and against numpy's
    float32 product of the unrounded inputs (each input off by at most UB of itself:
    (2 UB + UB^2) sum|a||b|, plus the float32 sums on both sides)."""
    K = a32.shape[1]

    def mag(a, b):
        return np.abs(a.astype(np.float64)) @ np.abs(b.T if trans_b else b).astype(np.float64)
    rounded = mag(bf16.from_bf16_ref(bf16.to_bf16_ref(a32)), bf16.from_bf16_ref(bf16.to_bf16_ref(b32)))
    unrounded = mag(a32, b32)
    same = (K + 1) * U * rounded
    return same, same + ((2 * UB + UB * UB) + (K + 1) * U) * unrounded


@native
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("M,K,N", [(37, 100, 53), (64, 1024, 96), (1, 8, 1)])
def test_gemm_within_bf16_bounds(M, K, N, trans_b):
    rng = np.random.default_rng(M + K + N)
    a32 = (rng.standard_normal((M, K)) * np.exp(rng.uniform(-3, 3, (M, 1)))).astype(np.float32)
    b32 = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    a, b = bf16.to_bf16_ref(a32), bf16.to_bf16_ref(b32)
    out = np.full((M, N), np.nan, np.float32)
    bf16.gemm(out, a, b, trans_b=trans_b)
    exact = bf16.gemm_ref(a, b, trans_b=trans_b)
    bound_same, bound_f32 = product_bounds(a32, b32, trans_b)
    assert np.all(np.abs(out - exact) <= bound_same)
    f32 = a32 @ (b32.T if trans_b else b32)  # numpy's float32 product of the unrounded inputs
    assert np.all(np.abs(out - f32) <= bound_f32)
    # the bound is not vacuous: bf16 inputs do move the result by more than float32 sums would
    assert np.abs(out - f32).max() > 2 * (K + 1) * U * np.abs(f32).max() or K < 16

    acc = rng.standard_normal((M, N)).astype(np.float32)
    out = acc.copy()
    bf16.gemm(out, a, b, trans_b=trans_b, accumulate=True)
    assert np.all(np.abs(out - (acc + exact)) <= bound_same + U * np.abs(acc + exact) + U * np.abs(acc))


@native
def test_gemm_row_strided_operands():
    """a, b and out as column slices of wider arrays (the head writes logits[:, lo:hi])."""
    rng = np.random.default_rng(3)
    a_wide = bf16.to_bf16_ref(rng.standard_normal((20, 70)))
    b_wide = bf16.to_bf16_ref(rng.standard_normal((30, 50)))
    a, b = a_wide[:, 5:45], b_wide[:, 10:50]          # (20, 40) and (30, 40): b transposed
    out_wide = np.full((20, 90), 7.0, np.float32)
    bf16.gemm(out_wide[:, 20:50], a, b, trans_b=True)
    exact = bf16.gemm_ref(np.ascontiguousarray(a), np.ascontiguousarray(b), trans_b=True)
    bound, _ = product_bounds(bf16.from_bf16_ref(a), bf16.from_bf16_ref(b), True)
    assert np.all(np.abs(out_wide[:, 20:50] - exact) <= bound)
    np.testing.assert_array_equal(out_wide[:, :20], 7.0)  # nothing written outside the slice
    np.testing.assert_array_equal(out_wide[:, 50:], 7.0)


@native
def test_gemm_empty_and_zero_k():
    out = np.full((3, 2), 5.0, np.float32)
    bf16.gemm(out, np.zeros((3, 0), np.uint16), np.zeros((0, 2), np.uint16))
    np.testing.assert_array_equal(out, np.zeros((3, 2), np.float32))
    out[...] = 5.0
    bf16.gemm(out, np.zeros((3, 0), np.uint16), np.zeros((2, 0), np.uint16), trans_b=True, accumulate=True)
    np.testing.assert_array_equal(out, np.full((3, 2), 5.0, np.float32))
    bf16.gemm(np.zeros((0, 2), np.float32), np.zeros((0, 4), np.uint16), np.zeros((4, 2), np.uint16))


@native
def test_gemm_runs_on_numbas_thread_count():
    """oneDNN and numba share GNU OpenMP's pool: a product first makes OpenMP's
    thread count numba's."""
    import numba
    before = numba.get_num_threads()
    a = bf16.to_bf16_ref(np.ones((4, 4)))
    try:
        for n in sorted({1, before}):
            numba.set_num_threads(n)
            out = np.zeros((4, 4), np.float32)
            bf16.gemm(out, a, a)
            np.testing.assert_array_equal(out, np.full((4, 4), 4.0, np.float32))
            assert bf16._library().gomp.omp_get_max_threads() == n
    finally:
        numba.set_num_threads(before)


@needs_library
@pytest.mark.parametrize("n_out", [4864, 896, 7])
def test_gemm_f32_accumulates(n_out):
    """float32 inputs: out += xa @ B^T for an adapter's rank-r factors (an adapter's forward),
    against numpy's product and add, whole tensors, within float32 rounding."""
    rng = np.random.default_rng(n_out)
    xa = rng.standard_normal((300, 8)).astype(np.float32)
    b = rng.standard_normal((n_out, 8)).astype(np.float32)
    y0 = rng.standard_normal((300, n_out)).astype(np.float32)
    y = y0.copy()
    bf16.gemm(y, xa, b, trans_b=True, accumulate=True)
    want = y0.astype(np.float64) + xa.astype(np.float64) @ b.T.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    bf16.gemm(y, xa, b, trans_b=True)                      # written, not added
    np.testing.assert_allclose(y, xa.astype(np.float64) @ b.T.astype(np.float64), rtol=1e-5, atol=1e-5)


@needs_library
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gemm_trans_a(accumulate, trans_b):
    """a held as (K, M) and used as a^T (the adapters' xa^T dy, dxa^T xd), float32 and
    bf16 inputs, written and added, against numpy on whole tensors."""
    rng = np.random.default_rng(3 + 2 * accumulate + trans_b)
    K, M, N = 257, 8, 96
    a32 = rng.standard_normal((K, M)).astype(np.float32)
    b32 = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    B64 = (b32.T if trans_b else b32).astype(np.float64)
    out0 = rng.standard_normal((M, N)).astype(np.float32)
    out = out0.copy()
    bf16.gemm(out, a32, b32, trans_a=True, trans_b=trans_b, accumulate=accumulate)
    want = a32.T.astype(np.float64) @ B64 + (out0 if accumulate else 0)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    a16, b16 = bf16.to_bf16_ref(a32), bf16.to_bf16_ref(b32)
    out = out0.copy()
    bf16.gemm(out, a16, b16, trans_a=True, trans_b=trans_b, accumulate=accumulate)
    exact = bf16.gemm_ref(np.ascontiguousarray(a16.T), b16, trans_b=trans_b) + (out0 if accumulate else 0)
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-4)


def test_gemm_argument_checks():
    a, b = np.zeros((3, 4), np.uint16), np.zeros((4, 5), np.uint16)
    with pytest.raises(ValueError, match="gemm: a must be a 2-D uint16 .bf16. array with contiguous rows, "
                                         "or both float32"):
        bf16.gemm(np.zeros((3, 5), np.float32), a.astype(np.float64), b)
    with pytest.raises(ValueError, match=r"gemm: b must be .* \(float32 when a is\)"):
        bf16.gemm(np.zeros((3, 5), np.float32), a.astype(np.float32), b)
    with pytest.raises(ValueError, match="gemm: b must be a 2-D uint16 .bf16. array with contiguous rows"):
        bf16.gemm(np.zeros((3, 5), np.float32), a, np.zeros((5, 4), np.uint16).T)
    with pytest.raises(ValueError, match=r"gemm: a is \(3, 4\) but b is \(4, 5\) \(transposed\)"):
        bf16.gemm(np.zeros((3, 4), np.float32), a, b, trans_b=True)
    with pytest.raises(ValueError, match=r"gemm: a is \(3, 4\) \(transposed\) but b is \(4, 5\)"):
        bf16.gemm(np.zeros((4, 5), np.float32), a, b, trans_a=True)
    with pytest.raises(ValueError, match=r"gemm: out must be a writeable float32 array of shape \(3, 5\) "
                                         r"with contiguous rows \(or uint16 .*\), got float32 \(5, 3\)"):
        bf16.gemm(np.zeros((5, 3), np.float32), a, b)
    with pytest.raises(ValueError, match=r"gemm: out must be .*got uint16 \(3, 5\)"):
        bf16.gemm(np.zeros((3, 5), np.uint16), a, b, accumulate=True)      # a bf16 sum would round twice


@native
@pytest.mark.parametrize("trans_b", [False, True])
def test_gemm_stored_as_bf16_is_the_rounded_float32_product(trans_b):
    """A uint16 out gets the float32 product rounded to nearest even as oneDNN stores it:
    bit for bit to_bf16 of the float32 out, on the whole tensor (rows apart too)."""
    rng = np.random.default_rng(5)
    a = bf16.to_bf16_ref(rng.standard_normal((70, 96)).astype(np.float32))
    b = bf16.to_bf16_ref(rng.standard_normal((40, 96) if trans_b else (96, 40)).astype(np.float32))
    f32 = np.empty((70, 40), np.float32)
    bf16.gemm(f32, a, b, trans_b=trans_b)
    out = np.full((70, 48), 0x7777, np.uint16)
    bf16.gemm(out[:, :40], a, b, trans_b=trans_b)
    np.testing.assert_array_equal(out[:, :40], bf16.to_bf16_ref(f32))
    assert (out[:, 40:] == 0x7777).all()


@pytest.fixture
def hidden_library(monkeypatch):
    """oneDNN as if not installed: the loader finds nothing, the found-once state reset."""
    monkeypatch.setattr(bf16, "_STATE", {})
    monkeypatch.setattr(bf16, "_library_paths", lambda: ["/nonexistent/libdnnl.so.3"])


def test_fallback_when_library_hidden(hidden_library):
    assert not bf16.available()
    assert bf16.unavailable_reason().startswith(
        "oneDNN (libdnnl.so.3) is not installed: pip install 'llamatune[cpu-bf16]'")
    with pytest.raises(bf16.Unavailable, match="oneDNN .* is not installed"):
        bf16.gemm(np.zeros((1, 1), np.float32), np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.uint16))
    dtype, why = compute_dtype("auto")
    assert dtype == "f32" and why.startswith("f32 products: ")
    with pytest.raises(LlamatuneError, match=r"--compute-dtype bf16: (oneDNN .* is not installed|this CPU has no native bf16)"):
        compute_dtype("bf16")


def test_compute_dtype_without_cpu_support(monkeypatch):
    monkeypatch.setattr(bf16, "cpu_bf16_flags", lambda cpuinfo="/proc/cpuinfo": [])
    assert compute_dtype("auto") == (
        "f32", "f32 products: this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16)")
    with pytest.raises(LlamatuneError, match="--compute-dtype bf16: this CPU has no native bf16"):
        compute_dtype("bf16")
    assert compute_dtype("f32") == ("f32", "f32 products as asked")
    with pytest.raises(LlamatuneError, match="--compute-dtype: unknown value 'f16' .choose one of auto, f32, tf32, bf16."):
        compute_dtype("f16")


@native
def test_compute_dtype_native():
    assert compute_dtype("auto")[0] == "bf16"
    dtype, why = compute_dtype("bf16")
    assert dtype == "bf16" and why.startswith("bf16 products (oneDNN 3.") and why.endswith(" as asked")


def test_cpu_flags_from_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor : 0\nflags : fpu avx2 amx_bf16 avx512_bf16 amx_tile\n")
    assert bf16.cpu_bf16_flags(str(f)) == ["avx512_bf16", "amx_bf16"]
    f.write_text("processor : 0\nflags : fpu avx2\n")
    assert bf16.cpu_bf16_flags(str(f)) == []
    assert bf16.cpu_bf16_flags(str(tmp_path / "missing")) == []


def test_lora_ops_f32_is_the_backends():
    """f32 products keep the backend's own adapter kernels (numpy's bit-exact sums)."""
    from llamatune.kernels import lora
    from llamatune.precision import F32
    assert F32.lora(lora) is lora


@needs_library
@pytest.mark.parametrize("masked,merged,strided", [(False, False, False), (True, False, False),
                                                   (False, True, False), (False, False, True)])
def test_lora_ops_onednn(masked, merged, strided):
    """bf16 products' adapter kernels (oneDNN float32): lora_xa, lora_forward and
    lora_backward against the float64 references on whole tensors, dA, dB, dx accumulated onto start
    values (dx None when merged; y, dA a strided view when strided)."""
    from llamatune.kernels import lora
    from llamatune.precision import ComputePolicy
    ops = ComputePolicy("bf16", lora_kernels="onednn").lora(lora)
    N, n_in, n_out, r, s = 300, 96, 160, 8, 0.75
    rng = np.random.default_rng(11)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    x, A, B, dy = f(N, n_in), f(r, n_in), f(n_out, r), f(N, n_out)
    mask = ((rng.random((N, n_in)) > 0.3) / 0.7).astype(np.float32) if masked else None
    xd = x if mask is None else x * mask
    xa = xd @ A.T
    got_xa = np.full((N, r), np.nan, np.float32)
    ops.lora_xa(got_xa, xd, A)
    np.testing.assert_allclose(got_xa, xd.astype(np.float64) @ A.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    y0 = f(N, n_out + 5)[:, 2:2 + n_out] if strided else f(N, n_out)
    want = y0.astype(np.float64)
    lora.lora_forward_ref(want, xa, B, s, None)
    y = y0.copy(order="K") if not strided else y0
    ops.lora_forward(y, xa, B, s, np.full((N, n_out), np.nan, np.float32))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)

    dA0 = f(r, n_in + 3)[:, :n_in] if strided else f(r, n_in)
    start = dict(dA=dA0, dB=f(n_out, r), dx=None if merged else f(N, n_in))
    ref = {k: None if v is None else v.astype(np.float64) for k, v in start.items()}
    lora.lora_backward_ref(ref["dA"], ref["dB"], ref["dx"], dy, xd, xa, A, B, s, None, mask)
    got = {k: None if v is None else v.copy() for k, v in start.items()}
    ops.lora_backward(got["dA"], got["dB"], got["dx"], dy, xd, xa, A, B, s,
                      np.full((N, n_in), np.nan, np.float32), mask)
    for name in ("dA", "dB") + (() if merged else ("dx",)):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("dtype", ["f32", pytest.param("bf16", marks=needs_library)])
@pytest.mark.parametrize("strided", [False, True])
def test_products_add(dtype, strided):
    """Products.add, out += a @ W (the backward's dx += dy W): f32 products are numpy's
    product and add bit for bit; bf16 products (a weight in bf16 bits) add the bf16
    product in oneDNN's pass over out, or through a block where out is strided."""
    from llamatune.models.products import Products
    from llamatune.precision import ComputePolicy
    rng = np.random.default_rng(8)
    a = rng.standard_normal((64, 48)).astype(np.float32)
    W = rng.standard_normal((48, 40)).astype(np.float32)
    wide = rng.standard_normal((64, 50)).astype(np.float32)
    out0 = wide[:, 3:43] if strided else np.ascontiguousarray(wide[:, :40])
    out = out0.copy() if not strided else wide.copy()[:, 3:43]
    p = Products(np, ComputePolicy(dtype))
    if dtype == "f32":
        p.add(out, a, W, False, np.empty((64, 40), np.float32))
        np.testing.assert_array_equal(out, out0 + a @ W)
        return
    p.add(out, a, bf16.to_bf16_ref(W), False, np.empty((64, 40), np.float32))
    exact = out0.astype(np.float64) + bf16.gemm_ref(bf16.to_bf16_ref(a), bf16.to_bf16_ref(W))
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5)
