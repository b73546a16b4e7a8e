"""--compute-dtype: where bf16 runs, what it falls back to, and that a bf16 run trains
like the f32 one (the base's products in bf16, everything else f32)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from llamatune import precision
from llamatune.commands.finetune import finetune
from llamatune.errors import LlamatuneError
from llamatune.kernels import attention, attention_bf16, bf16
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.train import checkpoint as ckpt
from test_finetune import options

NATIVE = bool(bf16.cpu_bf16_flags()) and bf16.available()
needs_bf16 = pytest.mark.skipif(not NATIVE, reason="this CPU has no native bf16 or oneDNN is not installed "
                                                    "(pip install -e '.[cpu-bf16]')")


def test_resolve_on_gpus_and_for_trained_weights():
    assert precision.resolve("auto", "cuda", capability=(9, 0)) == (
        "bf16", "bf16 products on the GPU (compute capability 9.0), float32 sums (cuBLAS)")
    assert precision.resolve("auto", "cuda", capability=(7, 5)) == (
        "f32", "f32 products on the GPU (compute capability 7.5): bf16 needs compute capability 8.0")
    assert precision.resolve("auto", "cuda") == (
        "f32", "f32 products on the GPU (capability unknown): bf16 needs compute capability 8.0")
    assert precision.resolve("bf16", "cuda")[0] == "bf16"            # the simulator: emulated products
    assert precision.resolve("tf32", "cuda", capability=(9, 0)) == ("tf32", "tf32 products on the GPU as asked")
    assert precision.resolve("auto", "cuda", trainable=True, capability=(9, 0))[0] == "f32"
    assert precision.resolve("tf32", "cuda", trainable=True)[0] == "tf32"
    assert precision.resolve("auto", "cpu", trainable=True) == ("f32", "f32 products for weights that are trained")
    assert precision.resolve("f32") == ("f32", "f32 products as asked")
    with pytest.raises(LlamatuneError, match=r"^--compute-dtype bf16: this GPU \(compute capability 7.5\) has no "
                                             r"bf16 tensor cores \(8.0 or newer\)$"):
        precision.resolve("bf16", "cuda", capability=(7, 5))
    assert precision.resolve("tf32", "cpu") == ("f32", "f32 products: TF32 is a GPU's tensor-core mode")
    with pytest.raises(LlamatuneError, match=r"^--compute-dtype bf16: .* not for weights that are trained$"):
        precision.resolve("bf16", "cpu", trainable=True)
    with pytest.raises(LlamatuneError, match=r"^--compute-dtype bf16: .* not for weights that are trained$"):
        precision.resolve("bf16", "cuda", trainable=True)
    with pytest.raises(LlamatuneError, match=r"^--compute-dtype: unknown value 'bf8' \(choose one of auto, f32, "
                                             r"tf32, bf16\)$"):
        precision.resolve("bf8")


def test_the_policy_is_decided_once_from_the_dtype():
    """precision.policy: f32 merges adapters into dequantized copies and keeps the backend's
    kernels; a trained base, a GPU or merge-aware training change what they must; the
    policy is frozen."""
    f32 = precision.policy("f32")
    assert f32 == dataclasses.replace(precision.F32, why="f32 products as asked")
    assert precision.policy("auto", "cuda").dtype == "f32" and precision.policy("auto", trainable=True).dtype == "f32"
    assert precision.policy("f32", merge_aware=True).merge_aware
    with pytest.raises(dataclasses.FrozenInstanceError):
        f32.dtype = "bf16"
    with pytest.raises(ValueError, match="f32 or bf16"):
        precision.ComputePolicy("f16")


@needs_bf16
def test_the_bf16_policy_carries_adapters_in_the_products_but_for_merge_aware():
    b16 = precision.policy("bf16")
    assert (b16.dtype, b16.merge_adapters, b16.adapters_in_products) == ("bf16", False, True)
    assert (b16.attention_kernels, b16.lora_kernels) == ("bf16", "onednn")
    assert b16.bf16_for(precision.BF16_MIN_ROWS) and not b16.bf16_for(precision.BF16_MIN_ROWS - 1)
    assert not precision.policy("bf16", merge_aware=True).adapters_in_products


def test_without_the_library_auto_falls_back_and_bf16_is_an_error(monkeypatch):
    monkeypatch.setattr(bf16, "cpu_bf16_flags", lambda *a: ["amx_bf16"])
    monkeypatch.setattr(bf16, "available", lambda: False)
    monkeypatch.setattr(bf16, "unavailable_reason", lambda: "oneDNN not found")
    assert precision.resolve("auto") == ("f32", "f32 products: oneDNN not found")
    with pytest.raises(LlamatuneError, match=r"^--compute-dtype bf16: oneDNN not found$"):
        precision.resolve("bf16")


@needs_bf16
def test_a_bf16_run_trains_like_the_f32_run_and_resumes_in_bf16(tmp_path, tiny_model):
    """Losses of 6 steps within 1 % of f32's at every step, the adapter within 2 % (relative
    norm); the checkpoint records bf16 and a resume with auto keeps it."""
    runs = {}
    for dtype in ("f32", "bf16"):
        d = tmp_path / dtype
        d.mkdir()
        runs[dtype] = finetune(options(d, tiny_model, adam_iter=6, lora_dropout=0.0, compute_dtype=dtype),
                               quiet=True)
    f32, b16 = np.array(runs["f32"].losses), np.array(runs["bf16"].losses)
    np.testing.assert_allclose(b16, f32, rtol=1e-2)
    assert not np.array_equal(b16, f32)                       # the products did run in bf16
    a, b = (ckpt.load(tmp_path / d / "chk-LATEST.gguf") for d in ("f32", "bf16"))
    assert a.options["compute_dtype"] == "f32" and b.options["compute_dtype"] == "bf16"
    recorded = json.loads(b.file.get_str("llamatune.compute"))          # the policy the run used, whole
    assert recorded == precision.policy("bf16").record() | {"why": recorded["why"]} and recorded["dtype"] == "bf16"
    res = finetune(options(tmp_path / "bf16", tiny_model, adam_iter=7, lora_dropout=0.0, compute_dtype="auto",
                           checkpoint_in=tmp_path / "bf16" / "chk-LATEST.gguf"), quiet=True)
    assert res.state.iteration == 7
    assert ckpt.load(tmp_path / "bf16" / "chk-LATEST.gguf").options["compute_dtype"] == "bf16"
    with pytest.raises(LlamatuneError, match=r"cannot resume with changed options: --compute-dtype 'bf16' -> 'f32'"):
        finetune(options(tmp_path / "bf16", tiny_model, adam_iter=8, lora_dropout=0.0, compute_dtype="f32",
                         checkpoint_in=tmp_path / "bf16" / "chk-LATEST.gguf"), quiet=True)


@needs_bf16
def test_bf16_inference_logits_within_bf16_rounding(tiny_model):
    tokens = np.random.default_rng(0).integers(0, 400, (2, 24))
    model = Model(tiny_model)
    f32, b16 = Runner(model).forward(tokens), Runner(model, policy=precision.policy("bf16")).forward(tokens)
    err = np.abs(b16 - f32).max()
    assert 0 < err < 2e-2 * np.abs(f32).max()


def batch(cfg, seed: int, B: int, T: int):
    """Random inputs and targets of B rows of T tokens, every token weighted alike."""
    rng = np.random.default_rng(seed)
    inputs, targets = rng.integers(0, cfg.n_vocab, (B, T)), rng.integers(0, cfg.n_vocab, (B, T))
    return inputs, targets, np.full((B, T), 1 / (B * T), np.float32)


def adapted_graph(model, kinds, B: int, T: int, mode: str = "selective", dtype: str = "bf16"):
    """(graph, params): a training graph of `model` with rank-4 adapters on `kinds`, their
    factors moved off their initialisation (B = 0) so that every adapter matters."""
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    targets = lora_targets(model.config, {k: 4 for k in kinds}, 4.0, tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    params.data[...] += np.random.default_rng(1).normal(0, 0.05, params.size).astype(np.float32)
    return StepExecutor(model.config, FrozenBase(model), params, targets, B, T, mode, policy=precision.policy(dtype)), params


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0", "F16"])
def test_weights_dequantized_straight_to_bf16_equal_the_rounded_f32_expansion(tmp_path, tiny_vocab, qtype):
    """Dequantizer.block_bf16 (every matrix whole, and head row blocks) is to_bf16 of the
    f32 expansion bit for bit: for F32, for the numba dequantizers and their fallback."""
    from gguf import GGMLQuantizationType as QType
    from conftest import write_tiny_model
    model = Model(write_tiny_model(tmp_path / f"tiny-{qtype}.gguf", tiny_vocab, getattr(QType, qtype), n_embd=64,
                                   n_ff=96))
    deq = model.dequantizer
    for name, t in model.weights.all_matrices():
        if t is model.weights.token_embd and t is not model.weights.output:
            continue
        spans = [(0, t.n_rows)] if t.n_rows * t.n_cols <= deq.size else [(0, deq.head_rows), (5, 5 + deq.head_rows)]
        for lo, hi in spans:
            want = bf16.to_bf16_ref(np.array(deq.block(t, lo, hi)))
            np.testing.assert_array_equal(deq.block_bf16(t, lo, hi), want, err_msg=f"{name} rows {lo}:{hi}")


@needs_bf16
def test_bf16_weights_and_shared_inputs_change_no_bit(tiny_model, monkeypatch):
    """The bf16 forward with weights dequantized straight to bf16 and q/k/v (gate/up)
    rounding their input once gives the logits of rounding every operand at every product."""
    import contextlib
    from llamatune.models.forward import Forward
    from llamatune.models.products import Products
    tokens = np.random.default_rng(1).integers(0, 400, (2, 20))
    model = Model(tiny_model)
    fast = Runner(model, policy=precision.policy("bf16")).forward(tokens)
    monkeypatch.setattr(Products, "shared_input", lambda self, x, extension=0: contextlib.nullcontext())
    monkeypatch.setattr(Forward, "weight", lambda self, name, N: self.weights.matrix(name))
    monkeypatch.setattr(Forward, "weight_rows", lambda self, name, lo, hi, N: self.weights.matrix_rows(name, lo, hi))
    plain = Runner(model, policy=precision.policy("bf16")).forward(tokens)
    np.testing.assert_array_equal(fast, plain)


@needs_bf16
def test_bf16_decode_steps_multiply_in_f32(tiny_model):
    """With bf16 products, a forward of fewer than BF16_MIN_ROWS tokens (a decode step)
    runs the f32 products: its logits are the f32 runner's bit for bit."""
    from llamatune.precision import BF16_MIN_ROWS
    tokens = np.random.default_rng(2).integers(0, 400, (1, BF16_MIN_ROWS - 1))
    model = Model(tiny_model)
    bf16_products = precision.policy("bf16")
    np.testing.assert_array_equal(Runner(model, policy=bf16_products).forward(tokens), Runner(model).forward(tokens))
    long = np.random.default_rng(2).integers(0, 400, (1, BF16_MIN_ROWS))
    assert not np.array_equal(Runner(model, policy=bf16_products).forward(long), Runner(model).forward(long))


def test_bf16_product_into_a_column_block():
    """A strided `out` (the head's logit blocks) gets through a contiguous block the same
    bits as a contiguous `out`, and the columns around it are left as they were."""
    from llamatune.models.products import Products
    if not bf16.available():
        pytest.skip(f"no oneDNN: {bf16.unavailable_reason()}")
    rng = np.random.default_rng(5)
    a = rng.standard_normal((40, 64)).astype(np.float32)
    W = rng.standard_normal((24, 64)).astype(np.float32)
    products = Products(np, precision.ComputePolicy("bf16"))
    want = products(np.empty((40, 24), np.float32), a, W, trans_b=True).copy()
    wide = rng.standard_normal((40, 50)).astype(np.float32)
    before = wide.copy()
    products(wide[:, 13:37], a, W, trans_b=True)
    np.testing.assert_array_equal(wide[:, 13:37], want)
    np.testing.assert_array_equal(wide[:, :13], before[:, :13])
    np.testing.assert_array_equal(wide[:, 37:], before[:, 37:])


@needs_bf16
def test_bf16_inference_applies_adapters_as_f32_does(tiny_model):
    """Runtime adapters under bf16 products (their rank-r products through oneDNN's
    float32 kernels, Products.lora_ops): the change they make to the logits is the f32
    runner's within bf16 rounding (an adapter dropped or mis-scaled moves it by 10x that)."""
    from llamatune.formats.adapter import RuntimeAdapters
    model = Model(tiny_model)
    rng = np.random.default_rng(4)
    adapters = RuntimeAdapters()
    for name, t in model.weights.all_matrices():
        if name.startswith("blk."):
            adapters.add(name, rng.standard_normal((4, t.n_cols)).astype(np.float32) * 0.05,
                         rng.standard_normal((t.n_rows, 4)).astype(np.float32) * 0.05, 1.5)
    tokens = rng.integers(0, 400, (2, 24))
    base32, base16 = Runner(model).forward(tokens), Runner(model, policy=precision.policy("bf16")).forward(tokens)
    with32 = Runner(model, adapters).forward(tokens)
    with16 = Runner(model, adapters, policy=precision.policy("bf16")).forward(tokens)
    shift32, shift16 = with32 - base32, with16 - base16
    assert np.abs(shift32).max() > 10 * 1e-2 * np.abs(with32).max()     # the adapters do something
    np.testing.assert_allclose(shift16, shift32, atol=1e-2 * np.abs(with32).max())   # 0.012 of 2.5 measured
    assert np.abs(with16 - with32).max() < 2e-2 * np.abs(with32).max()


@needs_bf16
def test_bf16_head_in_column_blocks_is_the_plain_bf16_head(tiny_model, monkeypatch):
    """The bf16 head (logits written in column blocks, the loss and the bf16 gradient from
    one pass over them: head.LossHead._bf16_chunk) against the plain path with bf16
    products (float32 logits, the gradient rounded per block): the same losses to float
    rounding and the same adapter gradients within the bf16 rounding of a few gradient
    values, on the whole gradient; evaluation losses equal training's bit for bit."""
    from llamatune.train.head import LossHead
    model = Model(tiny_model)
    B, T = 2, 24
    inputs, tg, _ = batch(model.config, 4, B, T)
    tg[0, -3:] = -1
    w = ((tg >= 0) / (tg >= 0).sum()).astype(np.float32)
    results = []
    for blocked in (True, False):
        if not blocked:
            monkeypatch.setattr(LossHead, "blocked_head", lambda self, n, adapter, dW: False)
        g, params = adapted_graph(model, ("attn_q", "attn_v", "ffn_down"), B, T)
        assert g.head_rows == 96                          # 5 blocks of the 400-token head, the last one ragged
        loss = g.step(inputs, tg, w)
        results.append((loss, g.losses.copy(), params.grad.copy(), g.loss(inputs, tg, w)))
    (l1, ls1, g1, e1), (l2, ls2, g2, e2) = results
    assert e1 == l1                                       # evaluation = training, bit for bit
    np.testing.assert_allclose(ls1, ls2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=0, atol=2e-3 * np.abs(g2).max())
    assert np.abs(g2).max() > 0


@needs_bf16
def test_bf16_graph_keeps_the_gate_inputs_in_bf16_and_its_modes_agree(tiny_model):
    """With bf16 products the layers keep g and u as bf16 bits (half their bytes in the
    plan and the memory estimate), and every checkpointing mode still gives the same
    gradients bit for bit (the forward computes h from what it keeps, as backward's
    recompute does)."""
    from llamatune.train.buffers import buffer_plan, plan_bytes
    model = Model(tiny_model)
    cfg = model.config
    B, T = 2, 16
    inputs, tg, w = batch(cfg, 6, B, T)
    grads = {}
    for mode in ("selective", "none", "layer"):
        g, params = adapted_graph(model, ("attn_q", "ffn_gate", "ffn_up", "ffn_down"), B, T, mode)
        assert all(a.ffn.g.dtype == np.uint16 and a.ffn.u.dtype == np.uint16 for a in g.layers)
        f32_plan = buffer_plan(cfg, list(g.lora.values()), B, T, mode, g.head_rows, False)
        saved = (1 if mode == "layer" else cfg.n_layer) * 2 * B * T * cfg.n_ff * 2      # bytes of g and u, halved
        assert plan_bytes(f32_plan) - g.plan.buffer_bytes == saved
        g.step(inputs, tg, w)
        grads[mode] = params.grad.copy()
    assert np.abs(grads["selective"]).max() > 0
    np.testing.assert_array_equal(grads["none"], grads["selective"])
    np.testing.assert_array_equal(grads["layer"], grads["selective"])


@needs_bf16
def test_bf16_head_kept_whole_in_wider_blocks(tiny_model, monkeypatch):
    """Where a chunk has at least n_embd tokens, bf16 training keeps the head's bf16
    copy whole (FrozenBase.keep_bf16) instead of expanding its blocks twice a chunk, and
    multiplies it in blocks of KEPT_HEAD_BLOCK columns (here the whole 400-token
    vocabulary at once, against 5 blocks of the scratch's 96 rows): the same losses to
    float rounding and the same gradients within the bf16 rounding of a few values
    (the blocks' dx sums in another order), on the whole tensors."""
    from llamatune.kernels import cross_entropy as ce
    from llamatune.train import buffers
    model = Model(tiny_model)
    B, T = 2, 40                                          # 80 tokens >= n_embd 64
    inputs, tg, w = batch(model.config, 8, B, T)
    runs, widths = [], []
    blocked = ce.cross_entropy_blocked
    monkeypatch.setattr(ce, "cross_entropy_blocked", lambda losses, logits, width, *a, **k: (
        widths.append(width), blocked(losses, logits, width, *a, **k)))
    for kept in (True, False):
        if not kept:
            monkeypatch.setattr(buffers, "kept_head_bytes", lambda cfg, chunk: 0)
        g, params = adapted_graph(model, ("attn_v", "ffn_down"), B, T)
        assert g.weights.is_kept_bf16("output.weight") == kept
        loss = g.step(inputs, tg, w)
        runs.append((loss, g.losses.copy(), params.grad.copy()))
        assert widths[-1] == (4096 if kept else 96)
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=1e-5, atol=1e-6)
    assert np.abs(runs[1][2]).max() > 0
    np.testing.assert_allclose(runs[0][2], runs[1][2], rtol=0, atol=2e-3 * np.abs(runs[1][2]).max())


@needs_bf16
@pytest.mark.parametrize("trans_b", [True, False])
def test_adapter_in_the_bf16_product_keeps_float32_accuracy(trans_b):
    """Products.adapted: the base product with an adapter's share in its K axis (the
    float32 factors as three bf16 parts) equals bf16(a) bf16(W) + v F in float64 to float32
    accuracy, the share included (with its bf16 rounding alone the share would be off by
    ~2^-9 of itself, far beyond the tolerance); the shared input's wide buffer gives the
    same bits; += accumulates."""
    from llamatune.models.products import Products, adapter_extension
    rng = np.random.default_rng(11)
    N, K, n, r = 64, 96, 80, 4
    E = adapter_extension(r)
    a = rng.standard_normal((N, K)).astype(np.float32)
    v = rng.standard_normal((N, r)).astype(np.float32)                 # s xa, or s dy B
    F = rng.standard_normal((n, r) if trans_b else (r, n)).astype(np.float32)   # B, or A
    W = rng.standard_normal((n, K) if trans_b else (K, n)).astype(np.float32)
    ext = np.zeros((n, K + E) if trans_b else (K + E, n), np.uint16)
    if trans_b:
        bf16.to_bf16_rows(ext, W)
        bf16.split_into(ext, F, K, "b")
    else:
        bf16.to_bf16(ext[:K], W)
        bf16.split_rows_into(ext, F, K, "b")
    wide = lambda u: bf16.from_bf16_ref(bf16.to_bf16_ref(u)).astype(np.float64)
    ref = wide(a) @ (wide(W).T if trans_b else wide(W)) + v.astype(np.float64) @ (F.T if trans_b else F)
    share = v.astype(np.float64) @ (F.T if trans_b else F)
    assert np.abs(share).max() > 0.2 * np.abs(ref).max()                # the share is no rounding detail
    products = Products(np, precision.ComputePolicy("bf16"))
    out = np.empty((N, n), np.float32)
    products.adapted(out, a, ext, v, trans_b=trans_b)
    np.testing.assert_allclose(out, ref, rtol=0, atol=5e-6 * np.abs(ref).max())
    held = np.empty_like(out)
    with products.shared_input(a, E):
        products.adapted(held, a, ext, v, trans_b=trans_b)
    np.testing.assert_array_equal(held, out)
    twice = out.copy()
    products.adapted(twice, a, ext, v, trans_b=trans_b, accumulate=True)
    np.testing.assert_allclose(twice, 2 * ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@needs_bf16
def test_bf16_graph_with_adapters_in_the_products(tiny_model):
    """Training with bf16 products carries each layer adapter in its base products
    (forward and dx: no pass of its own over y or dx). Against the same graph with the
    adapters' float32 passes: the same losses to float rounding and the same gradients
    within a few bf16 roundings (whole tensors), both as far from the float32 graph;
    the checkpointing modes agree bit for bit."""
    model = Model(tiny_model)
    B, T = 2, 24
    inputs, tg, w = batch(model.config, 9, B, T)
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    runs = {}
    for key, dtype, carried, mode in (("f32", "f32", False, "selective"), ("pass", "bf16", False, "selective"),
                                      ("carried", "bf16", True, "selective"), ("layer", "bf16", True, "layer")):
        g, params = adapted_graph(model, kinds, B, T, mode, dtype)
        g.policy = dataclasses.replace(g.policy, adapters_in_products=carried)
        g.attention = attention  # float32 attention: its bf16 roundings would turn the share's
        #                          2e-5 differences into flips of a bf16 ulp (the loss moved 1e-4)
        assert g.linears.in_product("blk.0.ffn_up.weight", B * T) == carried
        runs[key] = (g.step(inputs, tg, w), params.grad.copy())
    (l32, g32), (lp, gp), (lc, gc), (ll, gl) = runs["f32"], runs["pass"], runs["carried"], runs["layer"]
    np.testing.assert_allclose(lc, lp, rtol=1e-5)
    np.testing.assert_allclose(gc, gp, rtol=0, atol=1e-2 * np.abs(gp).max())
    err = lambda gr: np.abs(gr - g32).max() / np.abs(g32).max()
    assert err(gc) < 1.5 * err(gp) + 1e-3
    np.testing.assert_array_equal(gl, gc)
    assert ll == lc


@needs_bf16
def test_gate_inputs_stored_as_bf16_by_the_products_change_no_bit(tiny_model, monkeypatch):
    """Where gate and up have no bias and their adapters ride in the products, the
    products store g and u as bf16 bits straight into the layer's buffers (oneDNN rounds
    as it stores): the same losses and gradients bit for bit as the float32 scratch the
    gate kernel rounds."""
    from llamatune.models.forward import Forward
    model = Model(tiny_model)
    B, T = 2, 16
    inputs, tg, w = batch(model.config, 10, B, T)
    runs = []
    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(Forward, "stores_bf16", lambda self, names, N: False)
        g, params = adapted_graph(model, ("ffn_gate", "ffn_down"), B, T)
        assert g.stores_bf16(["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"], B * T) == direct
        runs.append((g.step(inputs, tg, w), params.grad.copy()))
    assert runs[0][0] == runs[1][0]
    assert np.abs(runs[1][1]).max() > 0
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("requested,device,trainable,flags,want", [
    ("auto", "cpu", False, ["amx_bf16"], "100000"),
    ("bf16", "auto", False, ["avx512_bf16"], "100000"),
    ("f32", "cpu", False, ["amx_bf16"], "2000"),        # OpenBLAS's threads would wait for spinning workers
    ("auto", "cpu", True, ["amx_bf16"], "2000"),        # trained weights multiply in f32
    ("auto", "cuda", False, ["amx_bf16"], "2000"),
    ("auto", "cpu", False, [], "2000"),                 # no native bf16: f32 products
])
def test_prepare_threads_spins_longer_for_bf16_products(monkeypatch, requested, device, trainable, flags, want):
    """The OpenMP spin a command sets before OpenMP starts: long where its products will
    likely be oneDNN's bf16 ones, the package's short default otherwise; a value the user
    set is kept, and a command without products changes nothing."""
    from llamatune.kernels import cpuinfo
    monkeypatch.setattr(cpuinfo, "cpu_bf16_flags", lambda *a: flags)
    for start in ({}, {"GOMP_SPINCOUNT": "2000"}):          # unset, or the package's default
        environ = dict(start)
        precision.prepare_threads(requested, device, trainable, environ)
        assert environ == {"GOMP_SPINCOUNT": want}
    environ = {"GOMP_SPINCOUNT": "5000"}
    precision.prepare_threads(requested, device, trainable, environ)
    assert environ == {"GOMP_SPINCOUNT": "5000"}
    environ = {}
    precision.prepare_threads(None, device, trainable, environ)
    assert environ == {}


def test_commands_ask_for_the_spin_of_their_products(monkeypatch):
    """The command line's options decide it (cli/options_cli._prepare_threads): a
    frozen-base finetune at auto, quickstart as auto, full finetuning and from-scratch
    training as trained weights, a command without --compute-dtype not at all."""
    from types import SimpleNamespace
    from llamatune import options as o
    from llamatune.cli import options_cli
    calls = []
    monkeypatch.setattr(precision, "prepare_threads", lambda *a: calls.append(a))
    options_cli._prepare_threads(SimpleNamespace(compute_dtype="auto", device="cpu", fine_tune_type="lora"))
    options_cli._prepare_threads(SimpleNamespace(compute_dtype="auto", device="cpu", fine_tune_type="full"))
    options_cli._prepare_threads(o.QuickstartOptions.__new__(o.QuickstartOptions))
    options_cli._prepare_threads(o.ScratchOptions.__new__(o.ScratchOptions))
    options_cli._prepare_threads(SimpleNamespace(lora=["a.gguf"]))
    assert calls[:3] == [("auto", "cpu", False), ("auto", "cpu", True), ("auto", "cpu", False)]
    assert calls[3][2] is True and calls[4][0] is None


def test_the_compute_dtype_chooses_the_attention_kernels():
    """bf16 products bring attention's bf16 kernels (float32 scores); f32 keeps the
    backend's own."""
    assert precision.policy("bf16").attention(attention) is attention_bf16
    assert precision.policy("f32").attention(attention) is attention
    assert precision.F32.attention(attention) is attention
