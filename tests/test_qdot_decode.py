"""The runner's decode steps on the quantized blocks (models/infer.py, kernels/qdot.py):
a step of one token per sequence (at most Runner.QDOT_MAX_ROWS sequences) multiplies
the quantized weights on their blocks; prefill, longer inputs and wider batches keep the
float32 path bit for bit; batched rows equal single decodes bit for bit; the logits
stay within the activation quantization's error of the float32 path."""
import copy

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from conftest import write_tiny_model
from llamatune.kernels.qdot_ref import ACTIVATION, BLOCK, quantize_rows_ref
from llamatune.models.infer import KVCache, Runner
from llamatune.models.model import Model

K_DIMS = dict(n_embd=256, n_ff=512, head_dim=64, n_rot=64, n_head=4, n_head_kv=2)   # whole 256-value blocks


@pytest.fixture(scope="module", params=[QType.Q8_0, QType.Q4_K, QType.Q5_0], ids=lambda t: t.name)
def prefilled(request, tmp_path_factory, tiny_vocab):
    dims = K_DIMS if request.param == QType.Q4_K else {}
    path = write_tiny_model(tmp_path_factory.mktemp("qdot") / "m.gguf", tiny_vocab, outtype=request.param, **dims)
    model = Model(path)
    assert {int(t.qtype) for _, t in model.weights.all_matrices()} == {int(request.param)}
    runner = Runner(model)
    cache = KVCache.empty(model, 1, 12)
    runner.forward(np.arange(3, 11)[None], cache)
    return runner, cache, request.param


def step(runner, cache, rows, quantized, tokens=(5,)):
    c = copy.deepcopy(cache)
    c.k = [np.repeat(k, rows, axis=0) for k in c.k]
    c.v = [np.repeat(v, rows, axis=0) for v in c.v]
    runner.quantized_decode = quantized
    try:
        return runner.forward(np.tile(np.asarray(tokens), (rows, 1)), c)
    finally:
        runner.quantized_decode = True


def test_decode_step_runs_on_the_quantized_blocks(prefilled):
    runner, cache, _ = prefilled
    q, f32 = step(runner, cache, 1, True)[0, -1], step(runner, cache, 1, False)[0, -1]
    rel = np.abs(q - f32).max() / np.abs(f32).max()
    assert 0 < rel < 5e-2          # another path, within 8-bit activations' error (q8_K: one scale per 256)
    assert q.argmax() == f32.argmax()


def test_decode_step_is_the_float32_path_on_rounded_activations(prefilled, monkeypatch):
    """What the quantized step computes: the float32 path's products with each input row
    rounded to its q8_0 / q8_K blocks (the numpy reference's quantizer), to float32 noise."""
    runner, cache, qtype = prefilled
    q = step(runner, cache, 1, True)[0, -1]
    f32_product = Runner.base_product

    def rounded(self, y, x, W):
        kind = ACTIVATION[int(qtype)]             # every matrix of these models has the one type
        xq = quantize_rows_ref(x, kind)
        blocks = xq.qs.reshape(x.shape[0], -1, BLOCK[kind]).astype(np.float32) * xq.d[..., None]
        f32_product(self, y, blocks.reshape(x.shape), W)
    monkeypatch.setattr(Runner, "base_product", rounded)
    emulated = step(runner, cache, 1, False)[0, -1]
    assert np.abs(q - emulated).max() < 1e-5 * np.abs(emulated).max()


def test_batched_decode_rows_equal_single_decode(prefilled):
    runner, cache, _ = prefilled
    one = step(runner, cache, 1, True)[0]
    many = step(runner, cache, Runner.QDOT_MAX_ROWS, True)
    for row in many:
        np.testing.assert_array_equal(row.view(np.uint32), one.view(np.uint32))


@pytest.mark.parametrize("rows,tokens", [(1, (5, 6)), (Runner.QDOT_MAX_ROWS + 1, (5,))], ids=["prefill", "wide"])
def test_other_steps_keep_the_float32_path(prefilled, rows, tokens):
    runner, cache, _ = prefilled
    a, b = step(runner, cache, rows, True, tokens), step(runner, cache, rows, False, tokens)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
