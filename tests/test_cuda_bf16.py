"""A GPU's bf16 products (kernels/cuda/bf16.py): the rounding kernel bit for bit against
the CPU's reference, dequantization straight to bf16, the products object on the rounded
operands, and a training step with bf16 products against the float32 step within bf16's
tolerances. Without a GPU in numba's simulator, the products emulated in numpy on the
rounded operands (blas.py; its own tests: test_op_blas.py)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from op_helpers import CUDA, random_tensor

from llamatune.kernels import bf16 as host_bf16
from llamatune.kernels.dequant import dequantize

pytestmark = pytest.mark.cuda
b = CUDA


def u16(shape):
    """A fresh uint16 device array of bits no result has (a NaN's)."""
    return b.to(np.full(shape, 0x7FC1, np.uint16))


def special_floats(rng, n=200):
    bits = np.array([0, 0x80000000, 1, 0x007FFFFF, 0x00800000, 0x3F800000, 0x3F808000, 0x3F818000,
                     0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                     0xFFFFFFFF, 0x7FBFFFFF], np.uint32)
    return np.concatenate([bits.view(np.float32), rng.standard_normal(n - bits.size).astype(np.float32) * 3])


def test_to_bf16_bit_exact_with_the_cpus_reference():
    """Round to nearest even, ties, overflow to inf, NaNs kept quiet with their sign; a
    column block (strided) input."""
    x = special_floats(np.random.default_rng(0)).reshape(8, 25)
    out = u16((8, 25))
    b.k.bf16.to_bf16(out, b.to(x))
    np.testing.assert_array_equal(b.get(out), host_bf16.to_bf16_ref(x))
    wide = b.to(np.random.default_rng(1).standard_normal((5, 40)).astype(np.float32))
    block = u16((5, 12))
    b.k.bf16.to_bf16(block, wide[:, 20:32])
    np.testing.assert_array_equal(b.get(block), host_bf16.to_bf16_ref(b.get(wide)[:, 20:32]))


def test_to_bf16_rows_past_the_grid_loop(monkeypatch):
    """More rows than the grid's y extent (65535 on a GPU; 2 here): each block loops over
    rows gridDim.y apart."""
    monkeypatch.setattr(b.k.bf16, "MAX_GRID_Y", 2)
    x = np.random.default_rng(2).standard_normal((5, 40)).astype(np.float32)
    out = u16((5, 40))
    b.k.bf16.to_bf16(out, b.to(x))
    np.testing.assert_array_equal(b.get(out), host_bf16.to_bf16_ref(x))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16])
def test_dequantize_straight_to_bf16(qtype):
    n_cols = 512 if qtype == T.Q4_K else 96          # two units of 256 values, or a partial one
    data = random_tensor(qtype, 2, n_cols, seed=3)
    out = u16((2, n_cols))
    b.k.dequant.dequantize_into(b.to(data), int(qtype), out)
    np.testing.assert_array_equal(b.get(out), host_bf16.to_bf16_ref(dequantize(data, qtype, n_cols)))


def test_bf16_products_match_the_rounded_operands():
    """CudaBf16Products: a @ W^T with W as bf16 bits, a @ W with a float32 W, the add, a
    shared input rounded once, a column block out: each the float32-accumulated product
    of the bf16-rounded operands."""
    from llamatune.backend import get_backend
    from llamatune.models.products import make_products
    from llamatune.precision import policy
    backend = get_backend("cuda")
    rng = np.random.default_rng(5)
    x, W = rng.standard_normal((6, 40)).astype(np.float32), rng.standard_normal((9, 40)).astype(np.float32)
    r = lambda v: host_bf16.from_bf16_ref(host_bf16.to_bf16_ref(v)).astype(np.float64)   # noqa: E731
    products = make_products(backend, policy("bf16", "cuda"))
    assert products.dtype == "bf16" and products.bf16_for(1)
    dx, dW = backend.to_device(x), backend.to_device(W)
    W16 = backend.xp.empty(W.shape, np.uint16)
    backend.ops.bf16.to_bf16(W16, dW)
    logits = backend.xp.zeros((6, 20), np.float32)
    with products.shared_input(dx):
        products(logits[:, 5:14], dx, W16, trans_b=True)
    want = r(x) @ r(W).T
    got = backend.to_host(logits)
    np.testing.assert_allclose(got[:, 5:14], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[:, :5].any() and not got[:, 14:].any()
    y = backend.to_device(rng.standard_normal((6, 40)).astype(np.float32))
    start = backend.to_host(y).astype(np.float64)
    g = backend.to_device(rng.standard_normal((6, 9)).astype(np.float32))
    products.add(y, g, dW, False)                          # y += g W, W float32: rounded here
    want = start + r(backend.to_host(g)) @ r(W)
    np.testing.assert_allclose(backend.to_host(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_a_training_step_with_bf16_products_is_the_f32_step_within_bf16s_rounding(micro_model):
    """One LoRA step of the micro model on the CUDA backend with bf16 products against the
    CPU's float32 step: the loss within 1 %, the adapters' gradient within 2 % of its
    largest element (the CPU bf16 tests' bounds), and not equal (the products ran in bf16)."""
    from llamatune.backend import cpu, get_backend
    from llamatune.models.model import Model
    from llamatune.models.weights import FrozenBase
    from llamatune.precision import policy
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    model = Model(micro_model)
    cfg = model.config
    targets = lora_targets(cfg, {k: 2 for k in ("attn_q", "attn_v", "ffn_down", "ffn_up")}, 2.0, tied=False)
    rng = np.random.default_rng(0)
    inputs, labels = rng.integers(0, cfg.n_vocab, (2, 1, 6))
    w = np.full((1, 6), 1 / 6, np.float32)
    results = []
    for backend, dtype in ((cpu(), "f32"), (get_backend("cuda"), "bf16")):
        params = ParamBuffer(lora_specs(targets))
        init_lora(params, targets, np.random.default_rng(1))
        params.data += np.random.default_rng(2).normal(0, 0.05, params.size).astype(np.float32)
        if backend.name != "cpu":
            params.to_device(backend)
        g = StepExecutor(cfg, FrozenBase(model, backend), params, targets, 1, 6, backend=backend,
                  policy=policy(dtype, backend.name))
        assert g.products.dtype == dtype
        results.append((g.step(inputs, labels, w), params.host(params.grad).copy()))
    (l32, g32), (l16, g16) = results
    assert l16 == pytest.approx(l32, rel=1e-2)
    np.testing.assert_allclose(g16, g32, rtol=0, atol=2e-2 * np.abs(g32).max())
    assert not np.array_equal(g16, g32)


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory, tiny_vocab):
    from conftest import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("cuda-bf16") / "micro.gguf", tiny_vocab, n_embd=16, n_ff=24,
                            head_dim=4, n_rot=4, n_layer=1)


@pytest.mark.slow
def test_finetune_with_bf16_products_on_the_cuda_backend_resumes_on_a_cpu_without_bf16(micro_model, tmp_path,
                                                                                      monkeypatch):
    """The CLI's path: --device cuda --compute-dtype bf16 trains and the checkpoint records
    bf16; a resume with auto on a CPU without native bf16 runs in f32 (what auto picks
    there) instead of refusing, and its checkpoint records f32."""
    from conftest import TEXT
    from llamatune.commands.finetune import finetune
    from llamatune.options import FinetuneOptions
    from llamatune.train import checkpoint as ckpt
    (tmp_path / "t.txt").write_text(TEXT)
    common = dict(model_base=micro_model, train_data=tmp_path / "t.txt", ctx=6, batch=1, lora_r=2, warmup=1,
                  save_every=0, checkpoint_out=tmp_path / "chk-ITERATION.gguf",
                  lora_out=tmp_path / "adapter-ITERATION.gguf")
    res = finetune(FinetuneOptions(device="cuda", compute_dtype="bf16", adam_iter=2, **common), quiet=True)
    assert res.state.iteration == 2 and np.isfinite(res.losses).all()
    assert ckpt.load(tmp_path / "chk-LATEST.gguf").options["compute_dtype"] == "bf16"
    monkeypatch.setattr(host_bf16, "cpu_bf16_flags", lambda *a: [])
    res = finetune(FinetuneOptions(device="cpu", adam_iter=3, checkpoint_in=tmp_path / "chk-LATEST.gguf", **common),
                   quiet=True)
    assert res.state.iteration == 3 and np.isfinite(res.losses[-1])
    assert ckpt.load(tmp_path / "chk-LATEST.gguf").options["compute_dtype"] == "f32"
