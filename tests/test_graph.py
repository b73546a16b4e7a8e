"""The training graph as a whole: gradients proven by finite differences in float64,
checkpointing changes nothing, step 0 equals the base model, and gradient
accumulation equals one big batch."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from fdcheck import fd_check
from llamatune import precision
from llamatune.models.weights import FrozenBase
from llamatune.train.step import StepExecutor
from llamatune.train.params import DenseWeights
from llamatune.models.infer import Runner
from llamatune.kernels import cross_entropy
from llamatune.train.lora import init_lora, lora_specs, lora_targets
from llamatune.models.model import Model
from llamatune.models.writer import random_weights, tensor_names
from llamatune.train.params import ParamBuffer, ParamSpec

from conftest import tiny_config, write_tiny_model

ALL_RANKS = {k: 2 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                            "token_embd", "output", "attn_norm", "ffn_norm", "output_norm")}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, tiny_vocab):
    # small enough for element-wise finite differences: C 32, 2 layers, GQA 4/2
    return Model(write_tiny_model(tmp_path_factory.mktemp("g") / "m.gguf", tiny_vocab, n_embd=32, n_ff=48,
                                  head_dim=8, n_rot=8))


def batch(cfg, B, T, seed=0, pad=True):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, cfg.n_vocab, (B, T))
    targets = rng.integers(0, cfg.n_vocab, (B, T))
    if pad:
        targets[0, -2:] = -1                   # padding is never a target
    weights = (targets >= 0) / max(1, int((targets >= 0).sum()))
    return inputs, targets, weights


def lora_setup(model, ranks, dtype, seed=0):
    targets = lora_targets(model.config, ranks, alpha=3.0, tied=False)
    params = ParamBuffer(lora_specs(targets), dtype)
    init_lora(params, targets, np.random.default_rng(seed))
    # make B nonzero too, so every path carries gradient
    params.data[...] += np.random.default_rng(seed + 1).normal(0, 0.05, params.size).astype(dtype)
    return targets, params


@pytest.mark.parametrize("checkpointing", ["selective", "none", "layer"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lora_gradient_matches_finite_differences(small_model, checkpointing, dropout):
    cfg = small_model.config
    targets, params = lora_setup(small_model, ALL_RANKS, np.float64)
    g = StepExecutor(cfg, FrozenBase(small_model), params, targets, 2, 5, checkpointing, dropout, dtype=np.float64)
    inputs, tg, w = batch(cfg, 2, 5)

    def loss(p):
        params.zero_grad()
        return g.step(inputs, tg, w, key=(7,))

    loss(params.data)
    analytic = params.grad.copy()
    # float64 throughout; tolerance covers f32-stored base weights (exact in f64) and eps^2 truncation
    err = fd_check(loss, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=300)
    assert err < 1e-5


def test_dense_gradient_matches_finite_differences(tiny_vocab):
    cfg = tiny_config(n_embd=16, n_ff=24, head_dim=4, n_rot=4, n_vocab=400)
    shapes = tensor_names(cfg)
    params = ParamBuffer([ParamSpec(n, s) for n, s in shapes.items()], np.float64)
    for n, a in random_weights(cfg, seed=3, std=0.2).items():
        params[n][...] = a
    for n in shapes:                                         # norms away from 1 to test their grads
        if n.endswith("norm.weight"):
            params[n][...] += np.random.default_rng(1).normal(0, 0.1, shapes[n])
    g = StepExecutor(cfg, DenseWeights(params), params, [], 2, 4, "selective", dtype=np.float64)
    with pytest.raises(ValueError, match="bf16 products are for a frozen base"):   # trained weights: f32
        StepExecutor(cfg, DenseWeights(params), params, [], 2, 4, policy=precision.ComputePolicy("bf16"))
    inputs, tg, w = batch(cfg, 2, 4, seed=5)

    def loss(p):
        params.zero_grad()
        return g.step(inputs, tg, w)

    loss(params.data)
    analytic = params.grad.copy()
    err = fd_check(loss, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=400)
    assert err < 1e-5


def test_checkpointing_gives_identical_gradients(small_model):
    cfg = small_model.config
    grads = []
    for ckpt in ("selective", "none"):
        targets, params = lora_setup(small_model, ALL_RANKS, np.float32)
        g = StepExecutor(cfg, FrozenBase(small_model), params, targets, 2, 8, ckpt)
        inputs, tg, w = batch(cfg, 2, 8)
        g.step(inputs, tg, w)
        grads.append(params.grad.copy())
    np.testing.assert_array_equal(grads[0], grads[1])


@pytest.mark.parametrize("mode", ["selective", "layer"])
def test_adapters_merged_into_dequantized_weights_change_nothing(tmp_path, tiny_vocab, mode):
    """With more tokens than a matrix has rows or columns, a quantized layer matrix is
    multiplied as W + s B A (the adapter merged into its dequantized copy) instead of
    adding the factored adapter's share to the product: the same loss and gradients
    to float rounding; dropout, F32 weights and float64 keep the factored form."""
    from gguf import GGMLQuantizationType as QType
    model = Model(write_tiny_model(tmp_path / "q8.gguf", tiny_vocab, QType.Q8_0))
    cfg = model.config
    B, T = 2, 56                                   # N = 112 > n_ff = 96 > n_embd = 64
    inputs, tg, w = batch(cfg, B, T)
    runs = []
    for merge in (True, False):
        targets, params = lora_setup(model, ALL_RANKS, np.float32)
        g = StepExecutor(cfg, FrozenBase(model), params, targets, B, T, mode,
                  policy=dataclasses.replace(precision.F32, merge_adapters=merge))
        assert g.linears.matrix("blk.0.ffn_down.weight", B * T)[1] is merge
        runs.append((g.step(inputs, tg, w), params.grad.copy()))
    (loss_m, grad_m), (loss_f, grad_f) = runs
    np.testing.assert_allclose(loss_m, loss_f, rtol=1e-6)
    np.testing.assert_allclose(grad_m, grad_f, rtol=2e-4, atol=2e-5 * np.abs(grad_f).max())
    targets, params = lora_setup(model, ALL_RANKS, np.float32)
    down = "blk.0.ffn_down.weight"
    assert not StepExecutor(cfg, FrozenBase(model), params, targets, B, T, mode, 0.1).linears.matrix(down, B * T)[1]
    assert not StepExecutor(cfg, FrozenBase(model), params, targets, 1, 8, mode).linears.matrix(down, 8)[1]
    f32 = Model(write_tiny_model(tmp_path / "f32.gguf", tiny_vocab))
    assert not StepExecutor(cfg, FrozenBase(f32), params, targets, B, T, mode).linears.matrix(down, B * T)[1]


def test_step_zero_equals_base_model(small_model):
    """With PEFT init (B = 0 / embedding A = 0) the graph's loss is the base model's,
    computed independently by the inference forward."""
    cfg = small_model.config
    targets = lora_targets(cfg, ALL_RANKS, alpha=8.0, tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    B, T = 2, 8
    g = StepExecutor(cfg, FrozenBase(small_model), params, targets, B, T)
    inputs, tg, w = batch(cfg, B, T, pad=False)
    loss = g.step(inputs, tg, w)
    logits = Runner(small_model).forward(inputs).reshape(B * T, -1)
    ref = np.empty(B * T, np.float32)
    cross_entropy.cross_entropy_forward(ref, np.ascontiguousarray(logits), tg.reshape(-1))
    np.testing.assert_allclose(g.losses, ref, rtol=2e-5, atol=2e-5)
    assert loss == pytest.approx(float(ref.mean()), rel=1e-5)


def test_gradient_accumulation_equals_one_big_batch(small_model):
    cfg = small_model.config
    inputs, tg, _ = batch(cfg, 4, 8, seed=9)
    n = int((tg >= 0).sum())
    w = (tg >= 0).astype(np.float32) / n
    targets, big = lora_setup(small_model, ALL_RANKS, np.float32)
    StepExecutor(cfg, FrozenBase(small_model), big, targets, 4, 8).step(inputs, tg, w)
    _, acc = lora_setup(small_model, ALL_RANKS, np.float32)
    g2 = StepExecutor(cfg, FrozenBase(small_model), acc, targets, 2, 8)
    for half in (slice(0, 2), slice(2, 4)):           # two micro-batches, weights normalised by the total
        g2.step(inputs[half], tg[half], w[half])
    # same sum, different summation order: equal to float32 rounding
    np.testing.assert_allclose(acc.grad, big.grad, rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory, tiny_vocab):
    """qwen2: q/k/v biases (nonzero here) and NEOX rope."""
    from gguf import GGMLQuantizationType as QType
    from llamatune.models.writer import write_model
    cfg = tiny_config("qwen2", n_embd=32, n_ff=48, head_dim=8, n_rot=8)
    w = random_weights(cfg, seed=4, std=0.1)
    rng = np.random.default_rng(5)
    for name in w:
        if name.endswith(".bias"):
            w[name] = rng.normal(0, 0.3, w[name].shape).astype(np.float32)
    path = tmp_path_factory.mktemp("q") / "qwen2.gguf"
    write_model(path, cfg, w, tiny_vocab, QType.F32)
    return Model(path)


def test_qwen2_bias_and_neox_rope(qwen2_model):
    """The inference forward applies biases and NEOX rope: checked against a plain
    numpy forward of the same weights; the graph agrees and its gradient is exact."""
    m = qwen2_model
    cfg = m.config
    assert cfg.rope_mode == 2 and cfg.spec.biases == ("attn_q", "attn_k", "attn_v")
    tokens = np.array([[1, 7, 30, 2, 99]])
    logits = Runner(m).forward(tokens)[0]
    W = {n: np.array(t.data, np.float64).reshape(t.shape) for n, t in m.file.tensors.items()}
    T, NH, NKV, HS = 5, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    x = W["token_embd.weight"][tokens[0]]

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.norm_eps) * w

    def rope_neox(v):                                          # (T, H, HS), rotate halves
        half = HS // 2
        theta = np.arange(T)[:, None] * cfg.rope_freq_base ** (-np.arange(half) * 2 / HS)
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        a, b = v[..., :half], v[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)
    p = "blk.0."
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q = rope_neox((h @ W[p + "attn_q.weight"].T + W[p + "attn_q.bias"]).reshape(T, NH, HS))
        k = rope_neox((h @ W[p + "attn_k.weight"].T + W[p + "attn_k.bias"]).reshape(T, NKV, HS))
        v = (h @ W[p + "attn_v.weight"].T + W[p + "attn_v.bias"]).reshape(T, NKV, HS)
        att = np.empty((T, NH, HS))
        for hd in range(NH):
            s = q[:, hd] @ k[:, hd // (NH // NKV)].T / np.sqrt(HS)
            s = np.where(np.tril(np.ones((T, T))) > 0, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            att[:, hd] = (pr / pr.sum(-1, keepdims=True)) @ v[:, hd // (NH // NKV)]
        x = x + att.reshape(T, -1) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    want = norm(x, W["output_norm.weight"]) @ W["output.weight"].T
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)

    targets, params = lora_setup(m, ALL_RANKS, np.float64)
    g = StepExecutor(cfg, FrozenBase(m), params, targets, 1, 5, dtype=np.float64)
    inputs, tg, w = batch(cfg, 1, 5, pad=False)

    def loss(p):
        params.zero_grad()
        return g.step(inputs, tg, w)

    loss(params.data)
    analytic = params.grad.copy()
    assert fd_check(loss, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=150) < 1e-5


# ---------------------------------------------------------------- checkpointing modes, head in blocks
MODES = ("layer", "selective", "none")


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, tiny_vocab):
    """Tied head (output = token_embd, one Q8_0 tensor) and 3 layers, so layer mode
    recomputes more than one layer."""
    from gguf import GGMLQuantizationType as QType
    return Model(write_tiny_model(tmp_path_factory.mktemp("t") / "tied.gguf", tiny_vocab, QType.Q8_0, tied=True,
                                  n_embd=32, n_ff=64, head_dim=8, n_rot=8, n_layer=3))


def mode_grads(make, dtype, B=2, T=6, dropout=0.0, packed=False):
    """(loss, gradient) of one step in each mode; `make` -> (cfg, base, params, targets).
    packed: rows hold two samples each (rope positions restart, attention per sample)."""
    segments = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], np.int32) if packed else None
    positions = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]]) if packed else None
    out = {}
    for mode in MODES:
        cfg, base, params, targets = make(dtype)
        g = StepExecutor(cfg, base, params, targets, B, T, mode, dropout, dtype=dtype)
        inputs, tg, w = batch(cfg, B, T, seed=3)
        loss = g.step(inputs, tg, w, key=(5,), positions=positions, segments=segments)
        out[mode] = loss, params.grad.copy()
    return out


def assert_modes_identical(out):
    loss, grad = out["selective"]
    assert np.abs(grad).max() > 0
    for mode in ("layer", "none"):
        assert out[mode][0] == loss
        np.testing.assert_array_equal(out[mode][1], grad, err_msg=mode)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_modes_identical_lora_untied_head_and_embedding(small_model, dtype, packed):
    """LoRA on every kind, output head and token_embd included (untied); with dropout."""
    def make(dt):
        targets, params = lora_setup(small_model, ALL_RANKS, dt)
        return small_model.config, FrozenBase(small_model), params, targets
    assert_modes_identical(mode_grads(make, dtype, dropout=0.3, packed=packed))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_modes_identical_lora_tied_head(tied_model, dtype):
    ranks = {k: r for k, r in ALL_RANKS.items() if k not in ("output", "token_embd")}   # refused when tied

    def make(dt):
        targets = lora_targets(tied_model.config, ranks, alpha=3.0, tied=True)
        params = ParamBuffer(lora_specs(targets), dt)
        params.data[...] = np.random.default_rng(1).normal(0, 0.05, params.size)
        return tied_model.config, FrozenBase(tied_model), params, targets
    assert tied_model.weights.output is tied_model.weights.token_embd
    assert_modes_identical(mode_grads(make, dtype))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_modes_identical_dense(tied, dtype):
    cfg = tiny_config(n_embd=16, n_ff=24, head_dim=4, n_rot=4, n_vocab=400, n_layer=3)

    def make(dt):
        shapes = tensor_names(cfg, tied=tied)
        params = ParamBuffer([ParamSpec(n, s) for n, s in shapes.items()], dt)
        for n, a in random_weights(cfg, seed=3, std=0.2, tied=tied).items():
            params[n][...] = a
        return cfg, DenseWeights(params, tied=tied), params, []
    assert_modes_identical(mode_grads(make, dtype))


def test_head_in_blocks_equals_full_matrix(tied_model):
    """The head is expanded head_rows rows at a time (several blocks here), never in
    full; logits, loss and gradients equal those of the whole dequantized matrix."""
    from llamatune.kernels import dequant
    m, cfg = tied_model, tied_model.config
    deq = m.dequantizer
    layer_max = max(t.n_rows * t.n_cols for layer in m.weights.layers for t in layer.mats.values())
    assert deq.size == layer_max and deq.head_rows == layer_max // cfg.n_embd < cfg.n_vocab
    with pytest.raises(ValueError, match="do not fit the dequantization scratch"):
        deq.get(m.weights.output)
    W = dequant.dequantize(m.weights.output.raw_rows(), m.weights.output.qtype, cfg.n_embd)   # (V, C) reference

    ranks = {k: 2 for k in ("attn_q", "ffn_down")}
    targets = lora_targets(cfg, ranks, alpha=3.0, tied=True)
    B, T = 2, 6
    inputs, tg, w = batch(cfg, B, T, seed=2)
    results = []
    for full in (False, True):
        params = ParamBuffer(lora_specs(targets))
        params.data[...] = np.random.default_rng(1).normal(0, 0.05, params.size)
        g = StepExecutor(cfg, FrozenBase(m), params, targets, B, T)
        if full:                               # one block: the whole matrix
            g.head_rows = cfg.n_vocab
            blocked = g.weights.matrix_rows
            g.weights.matrix_rows = lambda name, lo, hi: W[lo:hi] if name == "output.weight" else blocked(name, lo, hi)
        loss = g.step(inputs, tg, w)
        results.append((loss, g.losses.copy(), params.grad.copy()))
    (l0, losses0, g0), (l1, losses1, g1) = results
    np.testing.assert_allclose(losses0, losses1, rtol=1e-6, atol=1e-6)
    # f32 rounding of differently blocked sums: relative to the gradient's scale, as
    # elements that nearly cancel keep only the absolute error of their terms
    np.testing.assert_allclose(g0, g1, rtol=1e-5, atol=1e-5 * np.abs(g1).max())
    # inference: the blocked head against x W^T with the whole matrix
    x = np.random.default_rng(0).normal(0, 1, (5, cfg.n_embd)).astype(np.float32)
    np.testing.assert_allclose(Runner(m).head(x), x @ W.T, rtol=1e-5, atol=1e-5)


def test_head_chunk_sizes():
    """As few chunks as fit the room (or HEAD_CHUNK_BYTES, and at least HEAD_CHUNK_TOKENS
    tokens), all about the same size."""
    from llamatune.train.buffers import HEAD_CHUNK_BYTES, HEAD_CHUNK_TOKENS, head_chunk
    K = HEAD_CHUNK_TOKENS
    V = HEAD_CHUNK_BYTES // 4 // (2 * K)                  # HEAD_CHUNK_BYTES hold 2K rows of logits
    assert head_chunk(5 * K, V) == -(-5 * K // 3)         # 3 chunks of 5K/3, not 2K + 2K + K
    assert head_chunk(5 * K, V, 3 * K * V) == 5 * K // 2  # the room holds 3K: 2 chunks
    assert head_chunk(2048, 32000, 2048 * 8192) == 512    # the bench shape, selective: 4 chunks
    assert head_chunk(10**6, 2**14) == HEAD_CHUNK_BYTES // 4 // 2**14
    W = HEAD_CHUNK_BYTES // 4 // (K // 2)                 # 32 MB hold K/2 rows: K rows all the same
    assert head_chunk(3 * K, W) == K and head_chunk(3 * K, W, K * W) == K
    assert head_chunk(3 * K, W, 2 * K * W) == 3 * K // 2  # unless the room holds more
    assert head_chunk(K // 2, 10**9) == K // 2            # never more than N
    assert head_chunk(5, 10, 10**6) == 5


@pytest.mark.parametrize("mode", MODES)
def test_logits_overlay_the_gradient_scratch_and_chunking_changes_nothing(small_model, mode):
    from llamatune.train.buffers import grad_scratch
    """The head's logits live in the layer backward's scratch (one buffer); a
    step with one token per chunk equals one with every token in one chunk (LoRA on
    the head too), in float64 to the last few bits."""
    B, T = 2, 6
    results = []
    for chunk in (None, 1, B * T):
        targets, params = lora_setup(small_model, ALL_RANKS, np.float64)
        g = StepExecutor(small_model.config, FrozenBase(small_model), params, targets, B, T, mode, dtype=np.float64)
        assert np.shares_memory(g.logits, g.dg) and g.logits.base is g.dg.base
        views = [getattr(g, name) for name in grad_scratch(small_model.config, B * T, mode)]
        assert len(views) == (8 if mode == "none" else 9)
        assert not any(np.shares_memory(a, b) for i, a in enumerate(views) for b in views[i + 1:])
        if chunk is not None:
            g.chunk, g.logits = chunk, np.zeros((chunk, small_model.config.n_vocab))
        inputs, tg, w = batch(small_model.config, B, T, seed=4)
        results.append((g.step(inputs, tg, w), params.grad.copy()))
    for loss, grad in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-13)
        np.testing.assert_allclose(grad, results[0][1], rtol=1e-11, atol=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_tokens_without_target_skip_the_head(small_model, mode):
    """Only tokens with a target go through the head. Giving the others a target of
    weight 0 instead (so every token goes through it) changes no gradient and no
    scored token's loss, in float64 (LoRA on the head and the output norm too); a
    micro-batch without any target has loss 0 and zero gradients."""
    B, T = 2, 6
    cfg = small_model.config
    inputs, tg, w = batch(cfg, B, T, seed=5)
    tg[1, :4] = -1                                           # a prompt: no target
    assert (tg < 0).sum() == 6
    w = (tg >= 0) / (tg >= 0).sum()

    def run(targets, weights):
        lora, params = lora_setup(small_model, ALL_RANKS, np.float64)
        g = StepExecutor(cfg, FrozenBase(small_model), params, lora, B, T, mode, dtype=np.float64)
        rows = []
        ce = g.ops.cross_entropy
        g.ops = SimpleNamespace(**vars(g.ops))
        g.ops.cross_entropy = SimpleNamespace(cross_entropy_forward_backward=lambda losses, *a: (
            rows.append(len(losses)), ce.cross_entropy_forward_backward(losses, *a)))
        loss = g.step(inputs, targets, weights)
        return loss, g.losses.copy(), params.grad.copy(), sum(rows)

    loss, losses, grad, rows = run(tg, w)
    all_tg = np.where(tg >= 0, tg, 7)                        # every token a target, weight 0 where none was
    loss_all, losses_all, grad_all, rows_all = run(all_tg, w)
    assert rows == B * T - 6 and rows_all == B * T
    scored = tg.reshape(-1) >= 0
    np.testing.assert_allclose(losses[scored], losses_all[scored], rtol=1e-12)
    assert (losses[~scored] == 0).all() and (losses_all[~scored] > 0).all()
    assert loss == pytest.approx(loss_all, rel=1e-12)
    np.testing.assert_allclose(grad, grad_all, rtol=1e-10, atol=1e-14 * np.abs(grad_all).max())
    assert np.abs(grad).max() > 0

    loss0, losses0, grad0, rows0 = run(np.full_like(tg, -1), w)
    assert rows0 == 0 and loss0 == 0.0
    assert (losses0 == 0).all() and (grad0 == 0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_columns_after_the_last_target_are_left_out(small_model, mode, packed, monkeypatch):
    """A micro-batch runs on its columns up to the last target (rounded up to
    TRIM_TOKENS), in a graph over the full graph's memory; loss, per-token losses and
    gradients equal the full rows' in float64, for the step and for the evaluation loss."""
    from llamatune.train import step as graph_module
    B, T = 2, 12
    cfg = small_model.config
    inputs, tg, _ = batch(cfg, B, T, seed=6, pad=False)
    tg[0, 5:], tg[1, 7:], tg[1, :2] = -1, -1, -1             # the last target is in column 6
    w = (tg >= 0) / (tg >= 0).sum()
    packing = {}
    if packed:                                                # samples of 3 and 9 tokens in row 0
        packing = dict(positions=np.concatenate([np.r_[:3, :9], np.r_[:12]]).reshape(B, T),
                       segments=np.repeat([[0, 1], [0, 0]], [3, 9], axis=1).astype(np.int32))

    def run(trim):
        monkeypatch.setattr(graph_module, "TRIM_TOKENS", trim)
        lora, params = lora_setup(small_model, ALL_RANKS, np.float64)
        g = StepExecutor(cfg, FrozenBase(small_model), params, lora, B, T, mode, dtype=np.float64)
        loss = g.step(inputs, tg, w, **packing)
        losses, grad = g.losses.copy(), params.grad.copy()
        return g, loss, losses, grad, g.loss(inputs, tg, w, **packing)

    g, loss, losses, grad, eval_loss = run(4)
    assert list(g._trimmed_executors) == [8]                     # 7 columns, rounded up to 8
    short = g._trimmed_executors[8]
    assert short.arena is g.arena and short.activation_bytes() < g.activation_bytes()
    assert all(np.shares_memory(c, full) for (c, _), (full, _) in zip(short.rope_rows, g.rope_rows))
    g_full, loss_full, losses_full, grad_full, eval_full = run(T)
    assert not g_full._trimmed_executors
    assert loss == pytest.approx(loss_full, rel=1e-12) and eval_loss == pytest.approx(eval_full, rel=1e-12)
    assert eval_loss == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(losses, losses_full, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(grad, grad_full, rtol=1e-10, atol=1e-13 * np.abs(grad_full).max())
    assert np.abs(grad).max() > 0
