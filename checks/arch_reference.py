"""An independent float64 numpy forward of the llama-family blocks, written from
llama.cpp's graph builders (src/models/{llama,qwen2,qwen3,gemma,gemma2,gemma3,olmo2,smollm3,
granite}.cpp),
for the architecture tests: it reads only the weights and plain numbers given to it,
never the project's kernels, Arch options or per-layer helpers.

Also: the tiny random models those tests share (norm weights random around 1 and
biases nonzero, so that every tensor matters) and a LoRA setup on every kind a
model has.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Block:
    """What the reference computes, spelled out per test (not read from the Arch)."""
    rope_neox: bool
    gelu: bool = False                    # GeGLU instead of SwiGLU
    embd_scale: bool = False              # x * sqrt(n_embd)
    qk_norm: bool = False
    post_norms: bool = False
    attn_scale: float | None = None       # None: 1/sqrt(head_dim)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    swa: tuple[bool, ...] = ()            # per layer: sliding window?
    window: int = 0
    rope: tuple[tuple[float, float], ...] = ()   # per layer (base, scale)
    pre_norms: bool = True                # attn_norm / ffn_norm before the sublayers (olmo2: none)
    qk_norm_full: bool = False            # q/k RMSNorm over the whole projection (olmo2), not per head
    nope: tuple[bool, ...] = ()           # per layer: no rope (smollm3's every 4th layer)
    embd_mult: float = 0.0                # x * embd_mult (granite)
    residual_scale: float = 0.0           # sublayer outputs times this before the residual add (granite)
    logit_scale: float = 0.0              # logits / logit_scale (granite)
    moe_k: int = 0                        # mixture of experts: k experts per token (0: dense SwiGLU)
    moe_norm: bool = True                 # their softmax weights normalized to sum 1


def _moe(h, W, p, k, normalize):
    """llama.cpp's build_moe_ffn (softmax gating) token by token: h (T, C)."""
    z = h @ W[p + "ffn_gate_inp.weight"].T
    pr = np.exp(z - z.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    G, U, D = (W[p + n + ".weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-pr[t], kind="stable")[:k]
        w = pr[t, top] / pr[t, top].sum() if normalize else pr[t, top]
        for e, we in zip(top, w):
            g = G[e] @ h[t]
            out[t] += we * (D[e] @ (g / (1 + np.exp(-g)) * (U[e] @ h[t])))
    return out


def _norm(v, w, eps):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w


def _rope(v, pos, base, scale, neox):
    """v (T, H, HS) rotated at positions pos (T,); all HS dimensions rotate."""
    HS = v.shape[-1]
    half = HS // 2
    theta = (scale * pos)[:, None] * base ** (-np.arange(half) * 2.0 / HS)      # (T, half)
    c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
    if neox:
        a, b = v[..., :half], v[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)
    a, b = v[..., 0::2], v[..., 1::2]
    out = np.empty_like(v)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(cfg, blk: Block, W: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """logits (T, V) of one row of tokens (T,), float64."""
    T, NH, NKV, HS, eps = len(tokens), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.norm_eps
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd.weight"][tokens]
    if blk.embd_scale:
        x = x * np.sqrt(cfg.n_embd)
    if blk.embd_mult:
        x = x * blk.embd_mult
    res = blk.residual_scale or 1.0
    for i in range(cfg.n_layer):
        p = f"blk.{i}."

        def lin(v, name):
            y = v @ W[p + name + ".weight"].T
            return y + W[p + name + ".bias"] if p + name + ".bias" in W else y
        h = _norm(x, W[p + "attn_norm.weight"], eps) if blk.pre_norms else x
        q, k, v = (lin(h, n) for n in ("attn_q", "attn_k", "attn_v"))
        if blk.qk_norm_full:
            q, k = _norm(q, W[p + "attn_q_norm.weight"], eps), _norm(k, W[p + "attn_k_norm.weight"], eps)
        q, k, v = (t.reshape(T, -1, HS) for t in (q, k, v))
        if blk.qk_norm:
            q, k = _norm(q, W[p + "attn_q_norm.weight"], eps), _norm(k, W[p + "attn_k_norm.weight"], eps)
        base, scale = blk.rope[i] if blk.rope else (cfg.rope_freq_base, cfg.rope_freq_scale)
        if not (blk.nope and blk.nope[i]):
            q, k = _rope(q, pos, base, scale, blk.rope_neox), _rope(k, pos, base, scale, blk.rope_neox)
        visible = np.tril(np.ones((T, T), bool))
        if blk.swa and blk.swa[i]:
            visible &= (np.arange(T)[:, None] - np.arange(T)[None, :]) < blk.window
        att = np.empty((T, NH, HS))
        for hd in range(NH):
            kv = hd // (NH // NKV)
            s = q[:, hd] @ k[:, kv].T * (blk.attn_scale or 1 / np.sqrt(HS))
            if blk.attn_softcap:
                s = blk.attn_softcap * np.tanh(s / blk.attn_softcap)
            s = np.where(visible, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            att[:, hd] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
        o = lin(att.reshape(T, -1), "attn_output")
        x = x + res * (_norm(o, W[p + "post_attention_norm.weight"], eps) if blk.post_norms else o)
        h = _norm(x, W[p + "ffn_norm.weight"], eps) if blk.pre_norms else x
        if blk.moe_k:
            f = _moe(h, W, p, blk.moe_k, blk.moe_norm)
        else:
            g, u = lin(h, "ffn_gate"), lin(h, "ffn_up")
            f = lin((_gelu(g) if blk.gelu else g / (1 + np.exp(-g))) * u, "ffn_down")
        x = x + res * (_norm(f, W[p + "post_ffw_norm.weight"], eps) if blk.post_norms else f)
    logits = _norm(x, W["output_norm.weight"], eps) @ W.get("output.weight", W["token_embd.weight"]).T
    if blk.logit_scale:
        logits = logits / blk.logit_scale
    if blk.final_softcap:
        logits = blk.final_softcap * np.tanh(logits / blk.final_softcap)
    return logits


def cross_entropy(logits, targets):
    """Per-token loss -log softmax(logits)[target], float64 (targets -1: 0)."""
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    picked = logits[np.arange(len(targets)), np.maximum(targets, 0)]
    return np.where(targets >= 0, lse - picked, 0.0)


def model_weights(model) -> dict[str, np.ndarray]:
    """Every tensor of a loaded F32 model as float64 (numpy order)."""
    return {n: np.array(t.data, np.float64).reshape(t.shape) for n, t in model.file.tensors.items()}


def random_model_weights(cfg, seed: int, std: float = 0.15, tied: bool = False) -> dict[str, np.ndarray]:
    """The writer's random weights with norms N(1, 0.2) and biases N(0, 0.3): every tensor matters."""
    from llamatune.models.writer import random_weights
    w = random_weights(cfg, seed=seed, std=std, tied=tied)
    rng = np.random.default_rng(seed + 100)
    for name in w:
        if name.endswith("norm.weight"):
            w[name] = (1 + rng.normal(0, 0.2, w[name].shape)).astype(np.float32)
        elif name.endswith(".bias"):
            w[name] = rng.normal(0, 0.3, w[name].shape).astype(np.float32)
    return w


def all_ranks(cfg, tied: bool, r: int = 2) -> dict[str, int]:
    """Rank r on every kind the model has: its layer matrices and norms, output_norm, and
    (untied) the head and the embedding."""
    kinds = [k for k in cfg.spec.layer if "." not in k] + ["output_norm"]
    if not tied:
        kinds += ["output", "token_embd"]
    return {k: r for k in kinds}


# --------------------------------------------------------------------------- shared checks

def write_arch_model(path, cfg, vocab, seed: int = 0, tied: bool = False, outtype=None):
    from gguf import GGMLQuantizationType as QType
    from llamatune.models.writer import write_model
    write_model(path, cfg, random_model_weights(cfg, seed, tied=tied), vocab, outtype or QType.F32)
    return path


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, cfg.n_vocab, (B, T))
    targets = rng.integers(0, cfg.n_vocab, (B, T))
    targets[0, -1] = -1                                   # padding is never a target
    weights = (targets >= 0) / max(1, int((targets >= 0).sum()))
    return inputs, targets, weights


def lora_setup(model, ranks, dtype, seed=0):
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    tied = model.weights.output is model.weights.token_embd
    targets = lora_targets(model.config, ranks, alpha=3.0, tied=tied)
    params = ParamBuffer(lora_specs(targets), dtype)
    init_lora(params, targets, np.random.default_rng(seed))
    params.data[...] += np.random.default_rng(seed + 1).normal(0, 0.05, params.size).astype(dtype)   # B != 0 too
    return targets, params


def check_forward(model, blk: Block, T: int = 7):
    """infer.py's logits (full and token by token through the KV cache) and step.py's
    per-token losses (float64) against the numpy reference."""
    from llamatune.models.infer import KVCache, Runner
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.params import ParamBuffer
    cfg = model.config
    W = model_weights(model)
    inputs, targets, weights = batch(cfg, 2, T, seed=11)
    want = np.stack([forward(cfg, blk, W, row) for row in inputs])            # (B, T, V)
    runner = Runner(model)
    np.testing.assert_allclose(runner.forward(inputs), want, rtol=2e-4, atol=2e-4)
    cache = KVCache.empty(model, 2, T)
    steps = np.concatenate([runner.forward(inputs[:, t:t + 1], cache) for t in range(T)], 1)
    np.testing.assert_allclose(steps, want, rtol=2e-4, atol=2e-4)
    g = StepExecutor(cfg, FrozenBase(model), ParamBuffer([], np.float64), [], 2, T, dtype=np.float64)
    g.loss(inputs, targets, weights)
    ce = np.concatenate([cross_entropy(want[b], targets[b]) for b in range(2)])
    np.testing.assert_allclose(g.losses, ce, rtol=1e-7, atol=1e-8)   # rope tables are f32, as llama.cpp
    return want


def check_lora_gradients(model, ranks, mode="selective", n_probe=250, packed=False):
    """Every LoRA parameter's gradient (float64) by finite differences."""
    from fdcheck import fd_check
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    cfg = model.config
    targets, params = lora_setup(model, ranks, np.float64)
    T = 6
    g = StepExecutor(cfg, FrozenBase(model), params, targets, 2, T, mode, dtype=np.float64)
    inputs, tg, w = batch(cfg, 2, T)
    pack = PACKED if packed else {}

    def loss(p):
        params.zero_grad()
        return g.step(inputs, tg, w, key=(7,), **pack)
    loss(params.data)
    analytic = params.grad.copy()
    for t in targets:                                      # every adapter carries gradient
        assert np.abs(params.grad_of(t.a)).max() > 0 and np.abs(params.grad_of(t.b)).max() > 0, t.weight
    return fd_check(loss, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=n_probe)


# two samples per row, positions restarting, for packed-row checks
PACKED = dict(positions=np.array([[0, 1, 2, 3, 0, 1], [0, 1, 0, 1, 2, 3]]),
              segments=np.array([[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1]], np.int32))


def check_dense_gradients(cfg, tied: bool, n_probe=250):
    """train-from-scratch: every weight a float64 parameter, gradients by finite differences."""
    from fdcheck import fd_check
    from llamatune.models.writer import tensor_names
    from llamatune.train.step import StepExecutor
    from llamatune.train.params import DenseWeights
    from llamatune.train.params import ParamBuffer, ParamSpec
    shapes = tensor_names(cfg, tied=tied)
    params = ParamBuffer([ParamSpec(n, s) for n, s in shapes.items()], np.float64)
    for n, a in random_model_weights(cfg, seed=3, tied=tied).items():
        params[n][...] = a
    g = StepExecutor(cfg, DenseWeights(params, tied="output.weight" not in shapes), params, [], 2, 5, "layer",
              dtype=np.float64)
    inputs, tg, w = batch(cfg, 2, 5)

    def loss(p):
        params.zero_grad()
        return g.step(inputs, tg, w)
    loss(params.data)
    analytic = params.grad.copy()
    return fd_check(loss, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=n_probe)


def check_modes_identical(model, ranks, dtype, packed=False):
    """Checkpointing modes none / selective / layer: the same loss and gradients, bit for bit."""
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    out = {}
    for mode in ("layer", "selective", "none"):
        targets, params = lora_setup(model, ranks, dtype)
        g = StepExecutor(model.config, FrozenBase(model), params, targets, 2, 6, mode, 0.2, dtype=dtype)
        inputs, tg, w = batch(model.config, 2, 6, seed=3)
        loss = g.step(inputs, tg, w, key=(5,), **(PACKED if packed else {}))
        out[mode] = loss, params.grad.copy()
    loss, grad = out["selective"]
    assert np.abs(grad).max() > 0
    for mode in ("layer", "none"):
        assert out[mode][0] == loss, mode
        np.testing.assert_array_equal(out[mode][1], grad, err_msg=mode)


# --------------------------------------------------------------------------- llama.cpp figures
# tiny seeded models whose llama-perplexity checks/arch_crosscheck.py --record writes to
# tests/fixtures/arch_llamacpp.json (test_arch_llamacpp.py rebuilds them and compares)
LLAMACPP_SHAPE = dict(n_vocab=400, n_ctx_train=64, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16,
                      n_rot=16, n_layer=2, norm_eps=1e-6)
LLAMACPP_MODELS = {
    "qwen3": dict(LLAMACPP_SHAPE, head_dim=24, n_rot=24, rope_freq_base=1e6),
    # 8 experts of 32 (Q8_0 blocks fit the down projection's rows), 2 per token
    "qwen3moe": dict(LLAMACPP_SHAPE, head_dim=24, n_rot=24, rope_freq_base=1e6, n_expert=8, n_expert_used=2,
                     n_ff_exp=32),
    "gemma": dict(LLAMACPP_SHAPE),
    "gemma2": dict(LLAMACPP_SHAPE, n_layer=3, attn_softcap=5.0, final_softcap=8.0, sliding_window=8, swa_pattern=2),
    # 5:1 sliding-window layers with base 10000; the global one with base 1e6 and linear scaling x2
    "gemma3": dict(LLAMACPP_SHAPE, n_layer=6, sliding_window=8, swa_pattern=6, rope_freq_base=1e6,
                   rope_freq_scale=0.5, rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0),
}
LLAMACPP_TIED = {"qwen3": False, "qwen3moe": False, "gemma": True, "gemma2": True, "gemma3": True}


@dataclass
class LlamacppCase:
    name: str            # key in arch_llamacpp.json
    model: object        # Path
    adapter: object      # Path or None
    exact: bool          # F32: llama.cpp without activation rounding (-fa off, F32 KV)


def llamacpp_models(work, archs=None) -> list[LlamacppCase]:
    """Write the tiny models (F32 and Q8_0) and a seeded adapter per architecture into `work`."""
    from pathlib import Path

    from gguf import GGMLQuantizationType as QType
    from conftest import TEXT
    from llamatune.formats.adapter import LoraAdapter, write_adapter
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import tensor_names, train_spm_vocab, write_model
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    vocab = train_spm_vocab(TEXT, 400)
    cases = []
    for arch in archs or LLAMACPP_MODELS:
        cfg = ModelConfig(arch=arch, **LLAMACPP_MODELS[arch])
        w = random_model_weights(cfg, seed=21, std=0.1, tied=LLAMACPP_TIED[arch])
        rng = np.random.default_rng(22)
        adapter = LoraAdapter(arch, 8.0)
        for name, shape in tensor_names(cfg, tied=LLAMACPP_TIED[arch]).items():
            if name.startswith("blk.") and len(shape) == 2:
                adapter.pairs[name] = (rng.normal(0, 0.2, (4, shape[1])).astype(np.float32),
                                       rng.normal(0, 0.2, (shape[0], 4)).astype(np.float32))
            elif name.startswith("blk.") and len(shape) == 3:                # per expert (build_lora_mm_id)
                adapter.pairs[name] = (rng.normal(0, 0.2, (shape[0], 4, shape[2])).astype(np.float32),
                                       rng.normal(0, 0.2, (shape[0], shape[1], 4)).astype(np.float32))
        write_adapter(work / f"{arch}-adapter.gguf", adapter)
        for qtype, exact in ((QType.F32, True), (QType.Q8_0, False)):
            path = work / f"{arch}-{qtype.name}.gguf"
            write_model(path, cfg, w, vocab, qtype)
            cases += [LlamacppCase(f"{arch} {qtype.name}", path, None, exact),
                      LlamacppCase(f"{arch} {qtype.name} +adapter", path, work / f"{arch}-adapter.gguf", exact)]
    return cases


# --------------------------------------------------------------------------- phi3 with longrope (recorded figures)
PHI3_SEEDED_CHARS = 4000          # the seeded phi3 is scored on the first characters of shakespeare-eval.txt
PHI3_CONTEXTS = (64, 320)         # llama.cpp pads -c to 256: 64 -> short rope factors, 320 (512) -> long


def longrope(cfg):
    """`cfg` given Phi-3.5's kind of rope, and its two factor vectors: su/longrope factors
    (rope_factors_long / _short), an attention factor sqrt(1 + ln(scale) / ln(n_ctx_orig)) as
    convert_hf_to_gguf.py computes it, an original context of 256 in a context length of 512,
    and 3/4 of each head rotated (Phi-4-mini's partial rotary)."""
    import dataclasses
    import math
    n_ctx_train, n_ctx_orig, n_rot = 512, 256, cfg.head_dim * 3 // 4
    cfg = dataclasses.replace(cfg, n_ctx_train=n_ctx_train, n_ctx_orig=n_ctx_orig, n_rot=n_rot,
                              rope_attn_factor=math.sqrt(1 + math.log(n_ctx_train / n_ctx_orig) / math.log(n_ctx_orig)))
    return cfg, {"rope_factors_long.weight": np.geomspace(1.0, 8.0, n_rot // 2).astype(np.float32),
                 "rope_factors_short.weight": np.linspace(1.0, 1.2, n_rot // 2).astype(np.float32)}


def seeded_phi3(work, vocab):
    """A phi3 of seeded random weights with longrope and Phi-3's vocabulary (`vocab`, a GGUF),
    and a seeded random adapter on attn_qkv, attn_output, ffn_up and ffn_down; returns
    (model, adapter) paths. Rebuilt bit for bit anywhere from numpy's seeded generator, so
    test_arch_phi3.py checks llamatune against the llama.cpp figures recorded for it by
    `checks/arch_crosscheck.py --record --arch phi3` without llama.cpp."""
    from pathlib import Path

    from llamatune.formats.adapter import LoraAdapter, write_adapter
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.arch import tensor_shape
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import random_weights, vocab_kvs, write_model
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    f = GGUFFile(vocab)
    cfg, factors = longrope(ModelConfig(arch="phi3", n_vocab=len(f.metadata["tokenizer.ggml.tokens"]),
                                        n_ctx_train=512, n_embd=64, n_layer=2, n_ff=128, n_head=4, n_head_kv=2,
                                        head_dim=16, n_rot=16, norm_eps=1e-5))
    model, adapter = work / "phi3-seeded-f32.gguf", work / "phi3-seeded-adapter.gguf"
    write_model(model, cfg, random_weights(cfg, seed=11, std=0.3) | factors, vocab_kvs(f), name="seeded test model")
    rng, lora = np.random.default_rng(12), LoraAdapter("phi3", 8.0)
    for i in range(cfg.n_layer):
        for kind in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"):
            n_out, n_in = tensor_shape(cfg, kind)
            lora.pairs[f"blk.{i}.{kind}.weight"] = (rng.normal(0, 0.2, (4, n_in)).astype(np.float32),
                                                    rng.normal(0, 0.2, (n_out, 4)).astype(np.float32))
    write_adapter(adapter, lora)
    return model, adapter
