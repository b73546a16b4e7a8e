"""phi3 (models/archs/phi3.py): fused attn_qkv and ffn_up, NEOX rope on part of each
head, su/longrope frequency factors and attention factor, LoRA on the fused tensors.

A random-weight model carries exactly the tensors and metadata keys llama.cpp's
converter (Phi3MiniModel) writes; inference and the training graph are checked
against an independent float64 numpy forward, gradients by finite differences."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import TEXT, tiny_config
from fdcheck import fd_check
from llamatune.errors import LlamatuneError
from llamatune.kernels import cross_entropy
from llamatune.models.arch import get_arch, tensor_shape
from llamatune.models.infer import KVCache, Runner
from llamatune.models.model import Model
from llamatune.models.weights import FrozenBase
from llamatune.models.writer import random_weights, tensor_names, write_model
from llamatune.train.step import StepExecutor
from llamatune.train.params import DenseWeights
from llamatune.train.lora import init_lora, lora_specs, lora_targets
from llamatune.train.params import ParamBuffer, ParamSpec

N_CTX_ORIG = 256                    # contexts above it (after llama.cpp's padding to 256) rotate with the long factors
ATTN_FACTOR = 1.25
ALL_RANKS = {k: 2 for k in ("attn_qkv", "attn_output", "ffn_up", "ffn_down", "token_embd", "output",
                            "attn_norm", "ffn_norm", "output_norm")}


def phi3_config(**over):
    # head_dim 8 with 6 rotated dimensions (Phi-4-mini rotates 3/4 of each head), GQA 4/2
    base = dict(n_embd=32, n_ff=48, head_dim=8, n_rot=6, n_ctx_train=1024, n_ctx_orig=N_CTX_ORIG,
                rope_attn_factor=ATTN_FACTOR)
    return tiny_config("phi3", **(base | over))


def phi3_weights(cfg, seed=0, tied=False):
    w = random_weights(cfg, seed=seed, std=0.15, tied=tied)
    rng = np.random.default_rng(seed + 1)
    for name in w:                                   # norms away from 1, so their gradients are tested
        if name.endswith("norm.weight"):
            w[name] = (1 + rng.normal(0, 0.2, w[name].shape)).astype(np.float32)
    half = cfg.n_rot // 2
    w["rope_factors_long.weight"] = np.linspace(1.0, 6.0, half).astype(np.float32)
    w["rope_factors_short.weight"] = np.linspace(1.0, 1.7, half).astype(np.float32)
    return w


@pytest.fixture(scope="module")
def phi3_path(tmp_path_factory, tiny_vocab):
    from gguf import GGMLQuantizationType as QType
    path = tmp_path_factory.mktemp("phi3") / "phi3.gguf"
    cfg = phi3_config()
    write_model(path, cfg, phi3_weights(cfg), tiny_vocab, QType.F32)
    return path


@pytest.fixture(scope="module")
def phi3(phi3_path):
    return Model(phi3_path)


# ----------------------------------------------------------------------------- reference

def reference_logits(model: Model, tokens: np.ndarray, n_ctx: int) -> np.ndarray:
    """float64 numpy forward of llama.cpp's phi3 graph for one sequence (T,), context n_ctx."""
    cfg = model.config
    W = {n: np.array(t.data, np.float64).reshape(t.shape) for n, t in model.file.tensors.items()}
    T, NH, NKV, HS, F, Cq, Ckv = len(tokens), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, \
        cfg.n_embd_q, cfg.n_embd_kv
    half = cfg.n_rot // 2
    padded = -(-n_ctx // 256) * 256                       # llama.cpp's n_ctx_seq
    ff = W["rope_factors_long.weight" if padded > N_CTX_ORIG else "rope_factors_short.weight"]
    theta = np.arange(T)[:, None] * cfg.rope_freq_base ** (-2 * np.arange(half) / cfg.n_rot) / ff
    c, s = np.cos(theta)[:, None] * ATTN_FACTOR, np.sin(theta)[:, None] * ATTN_FACTOR

    def rope(v):                                          # NEOX on the first n_rot dims, the rest passes
        a, b, rest = v[..., :half], v[..., half:2 * half], v[..., 2 * half:]
        return np.concatenate([a * c - b * s, a * s + b * c, rest], -1)

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.norm_eps) * w
    x = W["token_embd.weight"][tokens]
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        qkv = norm(x, W[p + "attn_norm.weight"]) @ W[p + "attn_qkv.weight"].T
        q = rope(qkv[:, :Cq].reshape(T, NH, HS))
        k = rope(qkv[:, Cq:Cq + Ckv].reshape(T, NKV, HS))
        v = qkv[:, Cq + Ckv:].reshape(T, NKV, HS)
        att = np.empty((T, NH, HS))
        for h in range(NH):
            sc = q[:, h] @ k[:, h // (NH // NKV)].T / np.sqrt(HS)
            sc = np.where(np.tril(np.ones((T, T))) > 0, sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            att[:, h] = (pr / pr.sum(-1, keepdims=True)) @ v[:, h // (NH // NKV)]
        x = x + att.reshape(T, -1) @ W[p + "attn_output.weight"].T
        gu = norm(x, W[p + "ffn_norm.weight"]) @ W[p + "ffn_up.weight"].T
        g, u = gu[:, :F], gu[:, F:]                       # ggml_swiglu: the first half is the gate
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    head = W.get("output.weight", W["token_embd.weight"])
    return norm(x, W["output_norm.weight"]) @ head.T


# ----------------------------------------------------------------------------- declaration

def test_phi3_declares_the_tensors_and_keys_of_llama_cpps_converter(phi3):
    spec = get_arch("phi3")
    assert spec.fused_qkv and spec.fused_gate_up and spec.rope_mode == 2
    cfg = phi3.config
    assert list(tensor_names(cfg))[:9] == [
        "token_embd.weight", "output_norm.weight", "output.weight", "blk.0.attn_norm.weight",
        "blk.0.attn_qkv.weight", "blk.0.attn_output.weight", "blk.0.ffn_norm.weight", "blk.0.ffn_up.weight",
        "blk.0.ffn_down.weight"]
    assert tensor_shape(cfg, "attn_qkv") == (32 + 2 * 16, 32) and tensor_shape(cfg, "ffn_up") == (96, 32)
    assert tensor_shape(tiny_config(), "ffn_up") == (96, 64)            # llama's stays (F, C)
    md = phi3.file.metadata
    assert md["phi3.rope.scaling.original_context_length"] == N_CTX_ORIG
    assert md["phi3.attention.sliding_window"] == 0
    assert md["phi3.rope.scaling.attn_factor"] == pytest.approx(ATTN_FACTOR)
    assert phi3.file.tensors["rope_factors_long.weight"].shape == (3,)
    assert (cfg.n_ctx_orig, cfg.rope_attn_factor) == (N_CTX_ORIG, ATTN_FACTOR)


def test_phi3_sliding_window_is_read_and_not_applied_as_llama_cpp(phi3_path, tmp_path, tiny_vocab):
    """llama.cpp disables Phi-3's sliding window; a model carrying one computes the same logits."""
    from llamatune.formats.gguf_io import kv
    cfg = phi3_config()
    path = tmp_path / "swa.gguf"
    write_model(path, cfg, phi3_weights(cfg), tiny_vocab, extra=[kv("phi3.attention.sliding_window", 2)])
    tokens = np.array([[1, 7, 30, 2, 99, 5]])
    np.testing.assert_array_equal(Runner(Model(path)).forward(tokens), Runner(Model(phi3_path)).forward(tokens))


def test_phi3_with_only_one_rope_factor_tensor_is_refused(tmp_path, tiny_vocab):
    cfg = phi3_config()
    w = phi3_weights(cfg)
    del w["rope_factors_short.weight"]
    write_model(tmp_path / "one.gguf", cfg, w, tiny_vocab)
    with pytest.raises(LlamatuneError, match=r"one\.gguf: has only one of rope_factors_long\.weight and "
                                             r"rope_factors_short\.weight"):
        Model(tmp_path / "one.gguf")


# ----------------------------------------------------------------------------- forward

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_inference_matches_numpy_with_short_and_long_rope_factors(tmp_path, tiny_vocab, tied):
    cfg = phi3_config()
    write_model(tmp_path / "m.gguf", cfg, phi3_weights(cfg, seed=2, tied=tied), tiny_vocab)
    model = Model(tmp_path / "m.gguf")
    tokens = np.array([1, 7, 30, 2, 99, 5, 12])
    runner = Runner(model)
    short = runner.forward(tokens[None])[0]                     # context 7 (256 in llama.cpp): short factors
    np.testing.assert_allclose(short, reference_logits(model, tokens, 7), rtol=1e-4, atol=1e-4)
    cache = KVCache.empty(model, 1, 257)                        # context 257 (512) > 256: long factors
    first = runner.forward(tokens[None, :4], cache)[0]
    rest = runner.forward(tokens[None, 4:], cache)[0]
    want = reference_logits(model, tokens, 257)
    np.testing.assert_allclose(np.concatenate([first, rest]), want, rtol=1e-4, atol=1e-4)
    assert np.abs(want - short).max() > 1e-2                    # the factors matter
    sized = KVCache.empty(model, 1, 7, context=300)            # generate's cache: -c decides, not its size
    np.testing.assert_allclose(runner.forward(tokens[None], sized)[0], want, rtol=1e-4, atol=1e-4)
    at_256 = KVCache.empty(model, 1, 7, context=256)           # 256 is not above the original context
    np.testing.assert_allclose(runner.forward(tokens[None], at_256)[0], short, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("B, T", [(2, 6), (1, 257)], ids=["short", "long"])
def test_graph_forward_matches_numpy(phi3, B, T):
    cfg = phi3.config
    targets = lora_targets(cfg, ALL_RANKS, alpha=4.0, tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))       # B A = 0: the base model
    rng = np.random.default_rng(3)
    inputs, labels = rng.integers(0, cfg.n_vocab, (B, T)), rng.integers(0, cfg.n_vocab, (B, T))
    g = StepExecutor(cfg, FrozenBase(phi3), params, targets, B, T)
    g.step(inputs, labels, np.full((B, T), 1 / (B * T), np.float32))
    logits = np.concatenate([reference_logits(phi3, row, T) for row in inputs])
    want = np.empty(B * T, np.float32)
    cross_entropy.cross_entropy_forward(want, logits.astype(np.float32), labels.reshape(-1))
    np.testing.assert_allclose(g.losses, want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- gradients

def lora_setup(model, dtype, seed=0):
    targets = lora_targets(model.config, ALL_RANKS, alpha=3.0, tied=False)
    params = ParamBuffer(lora_specs(targets), dtype)
    init_lora(params, targets, np.random.default_rng(seed))
    params.data[...] += np.random.default_rng(seed + 1).normal(0, 0.05, params.size).astype(dtype)
    return targets, params


def test_lora_on_the_fused_tensors_is_one_pair_on_the_whole_product(phi3):
    targets = {t.kind: t for t in lora_targets(phi3.config, ALL_RANKS, 2.0, tied=False)}
    assert (targets["attn_qkv"].a_shape, targets["attn_qkv"].b_shape) == ((2, 32), (64, 2))
    assert (targets["ffn_up"].a_shape, targets["ffn_up"].b_shape) == ((2, 32), (96, 2))


@pytest.mark.parametrize("mode", ["none", "selective", "layer"])
def test_lora_gradient_matches_finite_differences(phi3, mode):
    cfg = phi3.config
    targets, params = lora_setup(phi3, np.float64)
    g = StepExecutor(cfg, FrozenBase(phi3), params, targets, 2, 5, mode, 0.2, dtype=np.float64)
    rng = np.random.default_rng(4)
    inputs, labels = rng.integers(0, cfg.n_vocab, (2, 5)), rng.integers(0, cfg.n_vocab, (2, 5))
    w = np.full((2, 5), 0.1)

    def loss(p):
        params.zero_grad()
        return g.step(inputs, labels, w, key=(3,))
    loss(params.data)
    analytic = params.grad.copy()
    err = fd_check(loss, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=300)
    assert err < 1e-5


@pytest.mark.parametrize("arch", ["phi3", "qwen2"])
def test_dense_gradient_matches_finite_differences(arch):
    """train-from-scratch --arch: every weight a parameter (phi3's fused ones, qwen2's biases)."""
    cfg = tiny_config(arch, n_embd=16, n_ff=24, head_dim=4, n_rot=4)
    shapes = tensor_names(cfg)
    params = ParamBuffer([ParamSpec(n, s) for n, s in shapes.items()], np.float64)
    rng = np.random.default_rng(2)
    for n, a in random_weights(cfg, seed=3, std=0.2).items():
        params[n][...] = a + (rng.normal(0, 0.2, a.shape) if n.endswith(".bias") else 0)
    g = StepExecutor(cfg, DenseWeights(params), params, [], 2, 4, "layer", dtype=np.float64)
    rng = np.random.default_rng(5)
    inputs, labels = rng.integers(0, cfg.n_vocab, (2, 4)), rng.integers(0, cfg.n_vocab, (2, 4))

    def loss(**_):
        params.zero_grad()
        return g.step(inputs, labels, np.full((2, 4), 0.125))
    loss()
    fused_and_biases = [n for n in shapes if n.endswith(".bias") or n.startswith("blk.0.attn_qkv")]
    analytic = {"p": params.grad.copy()} | {n: params.grad_of(n).copy() for n in fused_and_biases}
    inputs_ = {"p": params.data} | {n: params[n] for n in fused_and_biases}
    err = fd_check(loss, inputs_, analytic, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=120)   # biases: all
    assert err < 1e-5


def test_checkpointing_modes_give_bit_identical_gradients(phi3):
    cfg = phi3.config
    rng = np.random.default_rng(6)
    inputs, labels = rng.integers(0, cfg.n_vocab, (2, 10)), rng.integers(0, cfg.n_vocab, (2, 10))
    grads = []
    for mode in ("none", "selective", "layer"):
        targets, params = lora_setup(phi3, np.float32)
        StepExecutor(cfg, FrozenBase(phi3), params, targets, 2, 10, mode, 0.1).step(
            inputs, labels, np.full((2, 10), 0.05, np.float32), key=(1,))
        grads.append(params.grad.copy())
    np.testing.assert_array_equal(grads[0], grads[1])
    np.testing.assert_array_equal(grads[0], grads[2])


# ----------------------------------------------------------------------------- commands

@pytest.fixture(scope="module")
def phi3_q8(tmp_path_factory, tiny_vocab):
    """A Q8_0 phi3 (rows of 32 and 64 fit Q8_0 blocks), rope factors and attention factor."""
    from gguf import GGMLQuantizationType as QType
    cfg = phi3_config(n_ff=64)
    path = tmp_path_factory.mktemp("phi3q") / "phi3-q8_0.gguf"
    write_model(path, cfg, phi3_weights(cfg, seed=7), tiny_vocab, QType.Q8_0)
    return path


def _finetune_options(tmp, model, **over):
    from llamatune.options import FinetuneOptions
    (tmp / "train.txt").write_text(TEXT)
    base = dict(model_base=model, train_data=tmp / "train.txt", ctx=16, batch=2, lora_r=2, adam_iter=4,
                save_every=0, warmup=1, adam_alpha=2e-2, lora_dropout=0.1, rank_att_norm=1,
                checkpoint_out=tmp / "chk-ITERATION.gguf", lora_out=tmp / "adapter-ITERATION.gguf")
    return FinetuneOptions(**(base | over))


def test_finetune_resumes_exactly_and_the_adapter_works_in_every_command(tmp_path, phi3_q8):
    from gguf import GGUFReader
    from llamatune.commands.finetune import finetune
    from test_safety import cli_here
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    finetune(_finetune_options(one, phi3_q8), quiet=True)
    finetune(_finetune_options(two, phi3_q8, adam_iter=2), quiet=True)
    finetune(_finetune_options(two, phi3_q8, checkpoint_in=two / "chk-LATEST.gguf"), quiet=True)
    adapter = one / "adapter-LATEST.gguf"
    a = {t.name: np.array(t.data) for t in GGUFReader(adapter).tensors}
    b = {t.name: np.array(t.data) for t in GGUFReader(two / "adapter-LATEST.gguf").tensors}
    assert "blk.0.attn_qkv.weight.lora_b" in a and "blk.1.ffn_up.weight.lora_a" in a
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)

    text = tmp_path / "eval.txt"
    text.write_text(TEXT)
    base_ppl = cli_here("perplexity", "-m", phi3_q8, "-f", text, "-c", "16")
    lora_ppl = cli_here("perplexity", "-m", phi3_q8, "-f", text, "-c", "16", "--lora", adapter)
    assert base_ppl.returncode == 0 and lora_ppl.returncode == 0, base_ppl.stderr + lora_ppl.stderr
    ppl = [float(r.stdout.split("PPL = ")[1].split()[0]) for r in (base_ppl, lora_ppl)]
    assert ppl[0] != ppl[1]
    gen = cli_here("generate", "-m", phi3_q8, "-p", "First Citizen", "-n", "6", "--temp", "0", "--lora", adapter)
    assert gen.returncode == 0 and gen.stdout.startswith("First Citizen"), gen.stderr

    merged = tmp_path / "merged.gguf"
    assert cli_here("export-lora", "-m", phi3_q8, "--lora", adapter, "-o", merged).returncode == 0
    types = {t.name: t.tensor_type for t in GGUFReader(phi3_q8).tensors}
    assert {t.name: t.tensor_type for t in GGUFReader(merged).tensors} == types   # merged keep their types
    merged_ppl = cli_here("perplexity", "-m", merged, "-f", text, "-c", "16")
    assert float(merged_ppl.stdout.split("PPL = ")[1].split()[0]) == pytest.approx(ppl[1], rel=2e-2)


def test_train_from_scratch_arch_phi3(tmp_path):
    from llamatune.commands.scratch import train_from_scratch
    from llamatune.options import ScratchOptions
    (tmp_path / "t.txt").write_text(TEXT)
    o = ScratchOptions(arch="phi3", train_data=tmp_path / "t.txt", vocab_size=300, embd=32, head=4, head_kv=2,
                       layer=1, ff=32, ctx=16, batch=2, adam_iter=3, warmup=1, save_every=0,
                       checkpoint_out=tmp_path / "chk-ITERATION.gguf", model_out=tmp_path / "model-ITERATION.gguf")
    res = train_from_scratch(o, quiet=True)
    m = Model(tmp_path / "model-LATEST.gguf")
    assert m.config.arch == "phi3" and "blk.0.attn_qkv.weight" in m.file.tensors
    assert m.file.metadata["phi3.rope.scaling.original_context_length"] == 16
    assert np.isfinite(res.losses).all()
    o.arch, o.overwrite = "gemma9", True            # the same folder again: only the --arch check speaks
    with pytest.raises(LlamatuneError, match=r"--arch gemma9: train-from-scratch builds .*llama.*phi3.*qwen2"):
        train_from_scratch(o, quiet=True)


# ----------------------------------------------------------------------------- CUDA

@pytest.mark.cuda
@pytest.mark.slow          # ~30-60 s in the simulator; gemma3 covers the new options on CUDA by default
def test_cuda_runs_phi3_as_the_cpu(tmp_path, tiny_vocab):
    """Inference logits and a LoRA training step (every fused target) on the CUDA backend
    (numba's simulator without a GPU) equal the CPU's."""
    from llamatune.backend import cpu, get_backend
    try:
        cuda = get_backend("cuda")
    except LlamatuneError as e:
        pytest.skip(f"no CUDA device or simulator: {e}")
    cfg = phi3_config(n_embd=16, n_ff=24, head_dim=4, n_rot=2, n_layer=1, n_ctx_orig=8)   # long factors
    write_model(tmp_path / "micro.gguf", cfg, phi3_weights(cfg), tiny_vocab)
    model = Model(tmp_path / "micro.gguf")
    tokens = np.array([[1, 5, 9, 33, 7, 2, 11, 4, 8, 3]])
    np.testing.assert_allclose(cuda.to_host(Runner(model, backend=cuda).forward(tokens)),
                               Runner(model).forward(tokens), rtol=1e-4, atol=1e-5)
    targets = lora_targets(cfg, {"attn_qkv": 2, "ffn_up": 2, "attn_output": 2, "ffn_down": 2}, 2.0, tied=False)
    labels, w = np.roll(tokens, -1), np.full(tokens.shape, 0.1, np.float32)
    results = []
    for backend in (cpu(), cuda):
        params = ParamBuffer(lora_specs(targets))
        init_lora(params, targets, np.random.default_rng(1))
        params.data += np.random.default_rng(2).normal(0, 0.05, params.size).astype(np.float32)
        if backend is not cpu():
            params.to_device(backend)
        loss = StepExecutor(cfg, FrozenBase(model, backend), params, targets, 1, 10, "layer", backend=backend).step(
            tokens, labels, w)
        results.append((loss, params.host(params.grad).copy()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-3, atol=1e-6)


# ----------------------------------------------------------------------------- llama.cpp's figures

def test_perplexity_equals_llama_cpps_recorded_figures(tmp_path):
    """The seeded phi3 of arch_reference.seeded_phi3 (random weights from numpy's seeded
    generator, longrope, 3/4 of each head rotated, Phi-3's vocabulary, a seeded adapter on
    every fused tensor) scored by llamatune equals llama-perplexity's figures recorded by
    `checks/arch_crosscheck.py --record --arch phi3` (F32, no activation rounding: -fa off,
    F32 KV), with the short (-c 64) and the long (-c 320) rope factors, without and with
    the adapter."""
    import json
    from checks.arch_reference import PHI3_CONTEXTS, PHI3_SEEDED_CHARS, seeded_phi3
    from conftest import DATA, REPO, VOCAB, need
    from llamatune.commands.perplexity import perplexity
    from llamatune.formats.adapter import load_runtime_adapters
    figures = json.loads((REPO / "tests" / "fixtures" / "arch_llamacpp_phi3.json").read_text())
    model_path, adapter = seeded_phi3(tmp_path, need(VOCAB / "ggml-vocab-phi-3.gguf"))
    text = need(DATA / "shakespeare-eval.txt").read_text(encoding="utf-8")[:PHI3_SEEDED_CHARS]
    model = Model(model_path)
    assert {(f["n_ctx"], f["lora"]) for f in figures} == {(n, lora) for n in PHI3_CONTEXTS for lora in (False, True)}
    for f in figures:
        adapters = load_runtime_adapters(model, [(str(adapter), 1.0)]) if f["lora"] else None
        ppl = perplexity(Runner(model, adapters), text, f["n_ctx"], 4096).ppl
        assert ppl == pytest.approx(f["llama_cpp"], rel=2e-5), f
