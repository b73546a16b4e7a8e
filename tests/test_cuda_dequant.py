"""Edge cases of the CUDA dequantization launch layout (kernels/cuda/dequant.py: one
warp per 256-value unit of a row, WARPS units per thread block, a scale table in
shared memory): rows of a single block, rows ending in a partial unit or a partial
thread block, many rows, row slices of the data, gathers with repeated rows, and no
write outside `out`. Whole tensors are compared bit for bit with the CPU kernels
(themselves bit-exact with gguf, tests/test_dequant.py).

Runs on a GPU, else under numba's CUDA simulator, which runs every thread as Python
code: the shapes are tiny, but each one reaches a different edge of the layout.
"""
import numpy as np
import pytest
from conftest_cuda import cuda_or_skip

cuda = cuda_or_skip()

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from llamatune.kernels import dequant  # noqa: E402
from llamatune.kernels import cuda as kc  # noqa: E402
from test_dequant import ALL_TYPES, random_tensor  # noqa: E402

pytestmark = pytest.mark.cuda

UNIT = 256  # values per warp
SPAN = kc.dequant.WARPS * UNIT  # values per thread block
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


CASES = [(q, n) for q in ALL_TYPES for n in widths(q)]


def ids(case):
    return f"{case[0].name}-{case[1]}"


def guarded_out(n_rows, n_cols):
    """A device buffer of n_rows + 2 rows of sentinels, and its C-contiguous view of
    the middle n_rows rows (the kernel's out): the first and last rows catch writes
    before and after out."""
    buf = cuda.to_device(np.full((n_rows + 2, n_cols), SENTINEL, np.uint32).view(np.float32))
    return buf, buf[1:n_rows + 1]


def check_guarded(buf, want):
    got = buf.copy_to_host().view(np.uint32)
    assert (got[0] == SENTINEL).all() and (got[-1] == SENTINEL).all(), "wrote outside out"
    np.testing.assert_array_equal(got[1:-1], want.view(np.uint32))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_row_widths(case):
    qtype, n_cols = case
    data = random_tensor(qtype, 4, n_cols, seed=2)  # (at least 4 blocks: random_tensor)
    buf, out = guarded_out(4, n_cols)
    kc.dequant.dequantize_into(cuda.to_device(data), int(qtype), out)
    check_guarded(buf, dequant.dequantize(data, qtype, n_cols))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_gather_repeated_rows(case):
    qtype, n_cols = case
    data = random_tensor(qtype, 5, n_cols, seed=3)
    rows = np.array([4, 0, 4, 4, 2, 0], np.int64)
    buf, out = guarded_out(len(rows), n_cols)
    kc.dequant.dequantize_rows_into(cuda.to_device(data), int(qtype), cuda.to_device(rows), out)
    check_guarded(buf, dequant.dequantize(data, qtype, n_cols)[rows])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_many_rows(qtype):
    n_rows, n_cols = 70, GGML_QUANT_SIZES[qtype][0] * (1 if qtype == T.Q4_K else 2)
    data = random_tensor(qtype, n_rows, n_cols, seed=4)
    buf, out = guarded_out(n_rows, n_cols)
    kc.dequant.dequantize_into(cuda.to_device(data), int(qtype), out)
    check_guarded(buf, dequant.dequantize(data, qtype, n_cols))


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_row_slice_of_the_data(qtype):
    """Rows lo:hi of the stored bytes, as the weights' matrix_rows passes them (a Q6_K
    row of one super-block is 210 bytes: rows start at any even address)."""
    n_cols = GGML_QUANT_SIZES[qtype][0]
    data = random_tensor(qtype, 5, n_cols, seed=5)
    buf, out = guarded_out(3, n_cols)
    kc.dequant.dequantize_into(cuda.to_device(data)[1:4], int(qtype), out)
    check_guarded(buf, dequant.dequantize(data, qtype, n_cols)[1:4])
