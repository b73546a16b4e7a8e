"""dequant (kernels/dequant.py, kernels/cuda/dequant.py): every supported GGML type
bit for bit against gguf.quants.dequantize on the CPU and CUDA kernels (plain and
row gathers, every f16 bit pattern, every code under every scale of MXFP4, IQ4_NL and
IQ4_XS), the types without a kernel through gguf, the
reference models' tensors, the edges of the CUDA launch layout (one warp per
256-value unit of a row, WARPS units per thread block: rows of a single block,
partial units and thread blocks, many rows, row slices, repeated gathers, no write
outside `out`), and the argument checks."""
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from op_helpers import ALL_TYPES, CUDA, cases, random_tensor

from llamatune.kernels import dequant
from llamatune.kernels.dequant import NUMBA_TYPES, dequantize, dequantize_into, dequantize_rows_into

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"


def assert_bit_equal(actual, expected):
    np.testing.assert_array_equal(actual, expected)
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


def oracle(data, qtype, n_cols):
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(-1, n_cols)


def small_cols(qtype):
    # K-quants: 2 super-blocks per row; legacy blocks and floats: 96 values
    # (a partial thread block)
    return 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96


@pytest.mark.parametrize("b", cases())
def test_kernel_types(b):
    """The CUDA kernels cover exactly the CPU kernels' types: the floats, the legacy
    and K quants, MXFP4, IQ4_NL and IQ4_XS."""
    types = b.k.dequant.CUDA_TYPES if b.cuda else NUMBA_TYPES
    assert types == frozenset(int(t) for t in ALL_TYPES)


@pytest.mark.parametrize("b,qtype,n_rows,n_cols", cases(cpu=[(q, 7, 512) for q in ALL_TYPES],
                                                        cuda=[(q, 2, small_cols(q)) for q in ALL_TYPES]))
def test_dequantize_into_bit_exact(b, qtype, n_rows, n_cols):
    data = random_tensor(qtype, n_rows, n_cols)
    out = b.nan((n_rows, n_cols))
    b.k.dequant.dequantize_into(b.to(data), int(qtype), out)
    got = b.get(out)
    assert_bit_equal(got, oracle(data, qtype, n_cols))
    assert_bit_equal(got, dequantize(data, qtype, n_cols))


@pytest.mark.parametrize("b,qtype,n_rows,rows", cases(
    cpu=[(q, 7, (3, 0, 6, 3, 1)) for q in ALL_TYPES],
    cuda=[(q, 4, (3, 0, 3)) for q in (T.Q4_K, T.Q8_0)]))
def test_dequantize_rows_into_gather(b, qtype, n_rows, rows):
    n_cols = 512 if not b.cuda else small_cols(qtype)
    data = random_tensor(qtype, n_rows, n_cols, seed=1)
    rows = np.array(rows, np.int64)
    out = b.nan((len(rows), n_cols))
    b.k.dequant.dequantize_rows_into(b.to(data), qtype, b.to(rows), out)
    assert_bit_equal(b.get(out), dequantize(data, qtype, n_cols)[rows])
    if not b.cuda:  # no rows: nothing to do (the CPU gather of the embedding rows)
        empty = np.empty((0, n_cols), dtype=np.float32)
        dequantize_rows_into(data, qtype, np.zeros(0, dtype=np.int64), empty)


def _special_halves():
    """Zeros, subnormals (smallest, largest), normals at the edges, infs and NaN
    payloads, then random halves: 64 in all."""
    special = [0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x0155, 0x02AA, 0x03FF, 0x83FF,
               0x0400, 0x8400, 0x3C00, 0x3BFF, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7C01,
               0x7DFF, 0x7E00, 0x7FFF, 0xFC01, 0xFE00, 0xFFFF]
    rng = np.random.default_rng(0)
    return np.concatenate([special, rng.integers(0, 65536, 64 - len(special))]).astype(np.uint16).reshape(1, 64)


@pytest.mark.parametrize("b,halves", cases(cpu=[(np.arange(65536, dtype=np.uint16).reshape(128, 512),)],
                                           cuda=[(_special_halves(),)]))
def test_f16_bit_patterns(b, halves):
    """Halves (on the CPU all 65536: zeros, subnormals, normals, infs, NaN payloads)
    give numpy's float32 bits: the f16 scales of every quant type go through the same
    conversion."""
    out = b.nan(halves.shape)
    b.k.dequant.dequantize_into(b.to(halves.view(np.uint8)), int(T.F16), out)
    np.testing.assert_array_equal(b.get(out).view(np.uint32),
                                  halves.view(np.float16).astype(np.float32).view(np.uint32))


# ------------------------------------------------------------ every code and scale of the 4-bit codebook types

KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float64)
KV_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
CODES = (np.arange(16) | ((15 - np.arange(16)) << 4)).astype(np.uint8)  # every code in both nibbles
FINITE_HALVES = np.array([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 1.0, -0.5, 65504.0, -65504.0, 3e-3, -7e-4,
                          0.0123, 1e-6, -2.5e-5, 0.25, 17.0], np.float16)   # zeros, subnormals, extremes


def nibble_values(kv):
    """The 32 values of a block whose qs are CODES: low nibbles (j), then high (j + 16)."""
    return np.concatenate([kv[CODES & 15], kv[CODES >> 4]])


def mxfp4_every_scale():
    """256 blocks, block e with scale byte e and every code; expected kv * 2^(e-128) (exact
    in float64, rounded once: subnormal scales for e < 2, inf where it overflows)."""
    data = np.concatenate([np.arange(256, dtype=np.uint8)[:, None], np.tile(CODES, (256, 1))], axis=1)
    with np.errstate(over="ignore"):
        want = (np.ldexp(nibble_values(KV_MXFP4)[None], np.arange(256)[:, None] - 128)).astype(np.float32)
    return data.reshape(8, 32 * 17), want.reshape(8, 32 * 32)


def iq4_nl_every_scale():
    """16 blocks: d from FINITE_HALVES, every code; y = d * kv."""
    data = np.concatenate([FINITE_HALVES.view(np.uint8).reshape(16, 2), np.tile(CODES, (16, 1))], axis=1)
    want = FINITE_HALVES.astype(np.float32)[:, None] * nibble_values(KV_IQ4NL)[None]
    return data.reshape(2, 8 * 18), want.reshape(2, 8 * 32)


def iq4_xs_every_scale():
    """8 super-blocks, super-block s: d = FINITE_HALVES[s], its sub-block k the 6-bit
    scale ls = 8 s + k (all 64), every code; y = (d * (ls - 32)) * kv."""
    blocks = np.zeros((8, 136), np.uint8)
    want = np.zeros((8, 256), np.float32)
    for s in range(8):
        ls = 8 * s + np.arange(8)
        blocks[s, 0:2] = FINITE_HALVES[s:s + 1].view(np.uint8)
        blocks[s, 2:4] = np.array([sum(int((ls[k] >> 4) & 3) << (2 * k) for k in range(8))], "<u2").view(np.uint8)
        blocks[s, 4:8] = (ls[0::2] & 15) | ((ls[1::2] & 15) << 4)
        blocks[s, 8:] = np.tile(CODES, 8)
        dl = np.float32(FINITE_HALVES[s]) * (ls - 32).astype(np.float32)
        want[s] = (dl[:, None] * nibble_values(KV_IQ4NL)[None]).reshape(-1)
    return blocks.reshape(2, 4 * 136), want.reshape(2, 1024)


EVERY_SCALE = {T.MXFP4: mxfp4_every_scale, T.IQ4_NL: iq4_nl_every_scale, T.IQ4_XS: iq4_xs_every_scale}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # the CUDA simulator's numpy
@pytest.mark.parametrize("b,qtype", cases(cpu=[(q,) for q in EVERY_SCALE], cuda=[(q,) for q in EVERY_SCALE]))
def test_codebook_types_every_code_and_scale(b, qtype):
    """Every 4-bit code under every scale (MXFP4: all 256 scale bytes, including the
    subnormal ones and those that overflow to inf; IQ4_XS: all 64 sub-block scales;
    IQ4_NL and IQ4_XS: f16 zeros, subnormals and extremes) against the formula of
    ggml's dequantize_row_*, and bit for bit against gguf."""
    data, want = EVERY_SCALE[qtype]()
    out = b.nan(want.shape)
    b.k.dequant.dequantize_into(b.to(data), int(qtype), out)
    with np.errstate(over="ignore"):
        expected = oracle(data, qtype, want.shape[1])
    got = b.get(out)
    assert_bit_equal(got, want)
    assert_bit_equal(got, expected)


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


# ------------------------------------------------------------------ the CUDA launch layout

UNIT = 256  # values per warp
WARPS = 4   # warps per thread block, as in kernels/cuda/dequant.py (checked below); known
            # here without importing numba.cuda, which the CPU cases never do
SPAN = WARPS * UNIT  # values per thread block
SENTINEL = np.uint32(0x7FC0DEAD)  # a NaN no kernel writes


def widths(qtype):
    """Row widths reaching each edge: a single block; for legacy blocks and floats a
    unit and a bit (the second warp's unit is partial); a thread block and a bit
    (the second thread block has one busy warp, partial but for K-quants)."""
    block = GGML_QUANT_SIZES[qtype][0]
    if block == 256:
        return [256, SPAN + 256]
    if block == 32:
        return [32, UNIT + 32, SPAN + 64]
    return [1, UNIT + 3, SPAN + 37]


LAYOUT_CASES = [(q, n) for q in ALL_TYPES for n in widths(q)]


def layout_id(case):
    return f"{case[0].name}-{case[1]}"


def guarded_out(n_rows, n_cols):
    """A device buffer of n_rows + 2 rows of sentinels, and its C-contiguous view of
    the middle n_rows rows (the kernel's out): the first and last rows catch writes
    before and after out."""
    buf = CUDA.to(np.full((n_rows + 2, n_cols), SENTINEL, np.uint32).view(np.float32))
    return buf, buf[1:n_rows + 1]


def check_guarded(buf, want):
    got = CUDA.get(buf).view(np.uint32)
    assert (got[0] == SENTINEL).all() and (got[-1] == SENTINEL).all(), "wrote outside out"
    np.testing.assert_array_equal(got[1:-1], want.view(np.uint32))


@pytest.mark.cuda
def test_cuda_layout_constants():
    """The row widths above reach the edges of the kernels' thread blocks."""
    assert CUDA.k.dequant.WARPS == WARPS


@pytest.mark.cuda
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=layout_id)
def test_cuda_row_widths(case):
    qtype, n_cols = case
    data = random_tensor(qtype, 4, n_cols, seed=2)  # (at least 4 blocks: random_tensor)
    buf, out = guarded_out(4, n_cols)
    CUDA.k.dequant.dequantize_into(CUDA.to(data), int(qtype), out)
    check_guarded(buf, dequant.dequantize(data, qtype, n_cols))


@pytest.mark.cuda
@pytest.mark.parametrize("case", [c if c[0] in (T.Q4_K, T.Q4_0, T.F32) else pytest.param(c, marks=pytest.mark.slow)
                                  for c in LAYOUT_CASES], ids=layout_id)        # (3-4 s each simulated)
def test_cuda_gather_repeated_rows(case):
    qtype, n_cols = case
    data = random_tensor(qtype, 5, n_cols, seed=3)
    rows = np.array([4, 0, 4, 4, 2, 0], np.int64)
    buf, out = guarded_out(len(rows), n_cols)
    CUDA.k.dequant.dequantize_rows_into(CUDA.to(data), int(qtype), CUDA.to(rows), out)
    check_guarded(buf, dequant.dequantize(data, qtype, n_cols)[rows])


@pytest.mark.cuda
@pytest.mark.slow                                  # 5-11 s each under the simulator
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_cuda_many_rows(qtype):
    n_rows, n_cols = 70, GGML_QUANT_SIZES[qtype][0] * (1 if qtype == T.Q4_K else 2)
    data = random_tensor(qtype, n_rows, n_cols, seed=4)
    buf, out = guarded_out(n_rows, n_cols)
    CUDA.k.dequant.dequantize_into(CUDA.to(data), int(qtype), out)
    check_guarded(buf, dequant.dequantize(data, qtype, n_cols))


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_cuda_row_slice_of_the_data(qtype):
    """Rows lo:hi of the stored bytes, as the weights' matrix_rows passes them (a Q6_K
    row of one super-block is 210 bytes: rows start at any even address)."""
    n_cols = GGML_QUANT_SIZES[qtype][0]
    data = random_tensor(qtype, 5, n_cols, seed=5)
    buf, out = guarded_out(3, n_cols)
    CUDA.k.dequant.dequantize_into(CUDA.to(data)[1:4], int(qtype), out)
    check_guarded(buf, dequant.dequantize(data, qtype, n_cols)[1:4])


# ------------------------------------------------------------------ argument checks

def _cpu(qtype=T.Q8_0, out=(2, 64), dtype=np.float32, cols=None):
    data = random_tensor(T.Q8_0, 2, 64)
    data = data if cols is None else data[:, :cols]
    return lambda: dequantize_into(data, qtype, np.empty(out, dtype=dtype))


def _cpu_rows(rows, out=(1, 64)):
    data = random_tensor(T.Q8_0, 2, 64)
    return lambda: dequantize_rows_into(data, T.Q8_0, rows, np.empty(out, dtype=np.float32))


def _cuda(qtype=T.Q8_0, rows=2, on_host=False):
    def call():
        data = random_tensor(T.Q8_0, 2, 64)
        CUDA.k.dequant.dequantize_into(data if on_host else CUDA.to(data), qtype, CUDA.nan((rows, 64)))
    return call


@pytest.mark.parametrize("b,call,exc,match", cases(cpu=[
    (_cpu(out=(2, 96)), ValueError, "bytes"),
    (_cpu(dtype=np.float64), ValueError, "float32"),
    (_cpu(out=(3, 64)), ValueError, "rows"),
    (_cpu(out=(2, 32), cols=34), ValueError, "uint8"),
    (_cpu_rows(np.array([2], dtype=np.int64)), IndexError, None),
    (_cpu_rows(np.array([0], dtype=np.int32)), ValueError, "int64"),
    (lambda: dequantize_into(np.zeros((1, 66), np.uint8), int(T.IQ2_XXS), np.empty((1, 256), np.float32)),
     ValueError, "IQ2_XXS"),
    (lambda: dequantize_rows_into(np.zeros((1, 66), np.uint8), T.IQ2_XXS, np.zeros(1, dtype=np.int64),
                                  np.empty((1, 256), np.float32)), ValueError, "IQ2_XXS"),
    (lambda: dequantize(np.zeros((1, 292), dtype=np.uint8), T.Q8_K, 256),  # gguf-py cannot either
     ValueError, "Q8_K"),
    (lambda: dequantize_into(np.zeros((1, 66), np.uint8), 12345, np.empty((1, 256), np.float32)),
     ValueError, "unknown GGML tensor type id 12345"),
], cuda=[
    (_cuda(on_host=True), ValueError, "device array"),
    (_cuda(qtype=T.Q4_0), ValueError, "bytes"),
    (_cuda(rows=3), ValueError, "rows"),
    (_cuda(qtype=T.IQ2_XXS), ValueError, "no CUDA"),
]))
def test_argument_checks_raise(b, call, exc, match):
    with pytest.raises(exc, match=match):
        call()
