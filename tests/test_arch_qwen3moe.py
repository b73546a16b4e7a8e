"""qwen3moe: the declaration, metadata and tensors as llama.cpp's converter writes them,
loading (the 3-D expert tensors memory-mapped, one expert dequantized at a time) and the
bad files refused in one line; the mixture-of-experts feed-forward (models/moe.py)
against the float64 reference (checks/arch_reference.py). The tiny models are written
by llamatune's writer with seeded random weights; the Hugging Face oracle (a model
trained by transformers and converted by llama.cpp's converter, checks/moe_hf.py) is a
`slow` test that needs the torch Python."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from checks.arch_reference import (_moe, all_ranks, check_forward, check_lora_gradients, check_modes_identical,
                                   forward, model_weights, write_arch_model)
from conftest import tiny_config
from test_arch_qwen3 import BLOCK as QWEN3_BLOCK, QWEN3
from llamatune.backend import cpu
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import tensor_out, write_gguf
from llamatune.models.arch import NEOX
from llamatune.models.config import ModelConfig
from llamatune.models.forward import Forward
from llamatune.models.model import Model
from llamatune.models.moe import moe_forward
from llamatune.models.weights import FrozenBase

MOE = QWEN3 | dict(n_expert=8, n_expert_used=2, n_ff_exp=16)     # qwen3's block, its feed-forward of experts
BLOCK = dataclasses.replace(QWEN3_BLOCK, moe_k=2)
TORCH_PYTHON = os.environ.get("LLAMATUNE_TORCH_PYTHON", "LLAMATUNE_TORCH_PYTHON-not-set")


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory, tiny_vocab):
    cfg = tiny_config("qwen3moe", **MOE)
    return Model(write_arch_model(tmp_path_factory.mktemp("qwen3moe") / "qwen3moe.gguf", cfg, tiny_vocab, seed=4))


def test_declaration_tensors_and_metadata_as_llama_cpp(qwen3moe):
    spec = qwen3moe.config.spec
    assert spec.rope_mode == NEOX and spec.qk_norm and spec.moe and spec.expert_norm and not spec.scratch
    names = [n for n in qwen3moe.file.tensors if n.startswith("blk.0.")]
    assert sorted(names) == sorted(f"blk.0.{k}.weight" for k in (   # llama.cpp llama_model_qwen3moe::load_arch_tensors
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
        "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    t = qwen3moe.file.tensors
    assert t["blk.0.ffn_gate_inp.weight"].shape == (8, 32)
    assert t["blk.0.ffn_gate_exps.weight"].shape == t["blk.0.ffn_up_exps.weight"].shape == (8, 16, 32)
    assert t["blk.0.ffn_down_exps.weight"].shape == (8, 32, 16)
    md = qwen3moe.file.metadata
    assert (md["qwen3moe.expert_count"], md["qwen3moe.expert_used_count"],
            md["qwen3moe.expert_feed_forward_length"]) == (8, 2, 16)
    cfg = qwen3moe.config
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp) == (8, 2, 16)


def test_expert_feed_forward_length_defaults_as_llama_cpp(qwen3moe):
    md = {k: v for k, v in qwen3moe.file.metadata.items() if k != "qwen3moe.expert_feed_forward_length"}
    assert ModelConfig.from_metadata(md, "m").n_ff_exp == 48 // 2      # n_ff / n_expert_used


@pytest.mark.parametrize("key,value,match", [
    ("qwen3moe.expert_used_count", 9, r"expert_used_count 9 .* at most expert_count"),
    ("qwen3moe.expert_count", None, r"missing required metadata key 'qwen3moe.expert_count'"),
    ("qwen3moe.expert_used_count", 0, r"'qwen3moe.expert_used_count' is 0, expected 1 to")])
def test_bad_expert_metadata_is_one_line(qwen3moe, key, value, match):
    md = dict(qwen3moe.file.metadata)
    if value is None:
        del md[key]
    else:
        md[key] = value
    with pytest.raises(LlamatuneError, match=r"^m: .*" + match):
        ModelConfig.from_metadata(md, "m")


def test_an_expert_tensor_of_the_wrong_shape_names_it(qwen3moe, tmp_path):
    f = qwen3moe.file
    name = "blk.1.ffn_up_exps.weight"
    tensors = [tensor_out(n, np.zeros((8, 32, 16), np.float32) if n == name else np.array(t.data))
               for n, t in f.tensors.items()]
    write_gguf(tmp_path / "bad.gguf", f.arch, f.kvs.values(), tensors)
    with pytest.raises(LlamatuneError, match=rf"bad.gguf: tensor '{name}' has shape \(8, 32, 16\), "
                                             r"expected \(8, 16, 32\)$"):
        Model(tmp_path / "bad.gguf")


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0])
def test_moe_part_forward_matches_the_reference(qwen3moe, tmp_path, tiny_vocab, qtype):
    """The layer's mixture of experts alone (router through Forward.linear, experts
    dequantized one at a time) against the float64 reference on the file's own values."""
    model = qwen3moe if qtype == QType.F32 else Model(write_arch_model(
        tmp_path / "q8.gguf", qwen3moe.config, tiny_vocab, seed=4, outtype=qtype))
    W = {n: np.asarray(v, np.float64) for n, v in _dequantized(model).items()}
    fwd = Forward(model.config, FrozenBase(model), cpu())
    xn = np.random.default_rng(5).standard_normal((40, 32)).astype(np.float32)
    for i in range(model.config.n_layer):
        out = np.full_like(xn, np.nan)
        acts = moe_forward(fwd, out, xn, i)
        want = _moe(xn.astype(np.float64), W, f"blk.{i}.", 2, True)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
        assert acts.idx.shape == (40, 2) and np.allclose(acts.w.sum(1), 1)
        assert len(np.unique(acts.idx)) > 4                       # most experts work


def _dequantized(model) -> dict[str, np.ndarray]:
    from llamatune.kernels import dequant
    return {n: dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).reshape(t.shape)
            for n, t in model.file.tensors.items()}


def test_only_the_chosen_experts_are_dequantized(qwen3moe, monkeypatch):
    base = FrozenBase(qwen3moe)
    seen = []
    real = base.expert_matrix
    monkeypatch.setattr(base, "expert_matrix", lambda name, e: seen.append((name, e)) or real(name, e))
    fwd = Forward(qwen3moe.config, base, cpu())
    xn = np.random.default_rng(6).standard_normal((1, 32)).astype(np.float32)
    acts = moe_forward(fwd, np.empty_like(xn), xn, 0)
    chosen = sorted(acts.idx[0].tolist())
    assert sorted({e for _, e in seen}) == chosen and len(seen) == 3 * 2       # gate, up, down of each


# --------------------------------------------------------------------------- the Hugging Face oracle
@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A Qwen3MoeForCausalLM trained by transformers (100 steps), converted by llama.cpp's
    converter (checks/moe_hf.py): its paths and work folder."""
    from checks.moe_hf import make
    if not Path(TORCH_PYTHON).exists():
        pytest.skip(f"no Python with torch and transformers at {TORCH_PYTHON} (LLAMATUNE_TORCH_PYTHON)")
    work = tmp_path_factory.mktemp("moe-hf")
    return make(work, TORCH_PYTHON, steps=100) | {"work": work}


@pytest.mark.slow
def test_hf_oracle_logits(hf_model):
    """The float64 reference on the GGUF's weights equals HF's float64 logits (1e-10), and
    llamatune's float32 runner is within float32 rounding of them."""
    from checks.moe_hf import hf_logits
    from llamatune.models.infer import Runner
    model = Model(hf_model["f32"])
    cfg = model.config
    ids = np.random.default_rng(0).integers(0, cfg.n_vocab, (2, 40))
    hf = hf_logits(TORCH_PYTHON, hf_model["hf"], ids, hf_model["work"])
    W = model_weights(model)
    ref = np.stack([forward(cfg, BLOCK, W, row) for row in ids])
    assert np.abs(ref - hf).max() <= 1e-10 * np.abs(hf).max()
    np.testing.assert_allclose(Runner(model).forward(ids), hf, rtol=0, atol=2e-6 * np.abs(hf).max())


@pytest.mark.slow
def test_hf_oracle_loss_and_lora_gradients(hf_model):
    """LoRA on attention over the frozen experts: the training graph's float64 loss and the
    gradient of every A and B equal HF autograd's (PEFT, the same values) to 1e-6 relative
    (the rope tables are float32, as llama.cpp's); the gradient reaches the first layer
    through the second's experts and router."""
    from checks.moe_hf import hf_lora_grads
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    model = Model(hf_model["f32"])
    cfg, rng = model.config, np.random.default_rng(3)
    B, T, r, alpha = 2, 24, 4, 8.0
    ids = rng.integers(0, cfg.n_vocab, (B, T + 1))
    targets = lora_targets(cfg, {k: r for k in ("attn_q", "attn_k", "attn_v", "attn_output")}, alpha, tied=False)
    params = ParamBuffer(lora_specs(targets), np.float64)
    params.data[...] = rng.normal(0, 0.1, params.size)
    lora = {n: params[n].copy() for t in targets for n in (t.a, t.b)}
    hf = hf_lora_grads(TORCH_PYTHON, hf_model["hf"], ids, lora, r, alpha, hf_model["work"])
    g = StepExecutor(cfg, FrozenBase(model), params, targets, B, T, "selective", dtype=np.float64)
    loss = g.step(ids[:, :-1], ids[:, 1:], np.full((B, T), 1 / (B * T)))
    assert loss == pytest.approx(hf["loss"], rel=1e-9)
    assert len(lora) == 4 * 2 * cfg.n_layer
    for name in lora:
        want = hf[name]
        assert np.abs(params.grad_of(name) - want).max() <= 1e-6 * np.abs(want).max(), name


# --------------------------------------------------------------------------- the whole model
def test_forward_matches_numpy(qwen3moe):
    check_forward(qwen3moe, BLOCK)


def test_lora_gradients_through_the_experts_and_router(qwen3moe):
    """LoRA on attention (and the norms, the head, the embedding) of a frozen mixture of
    experts: the gradient reaches them through the experts each token chose and through
    the router's logits (the choice fixed), by finite differences in float64."""
    ranks = {k: r for k, r in all_ranks(qwen3moe.config, tied=False).items() if k != "ffn_gate_inp"}
    assert check_lora_gradients(qwen3moe, ranks, "selective", n_probe=150) < 1e-5


def test_router_adapter_gradients(qwen3moe):
    assert check_lora_gradients(qwen3moe, {"ffn_gate_inp": 2, "attn_v": 2}, "layer", n_probe=100) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_modes_identical(qwen3moe, dtype):
    check_modes_identical(qwen3moe, all_ranks(qwen3moe.config, tied=False), dtype, packed=dtype == np.float64)


def test_a_gpu_is_refused_in_one_line(qwen3moe):
    from types import SimpleNamespace
    with pytest.raises(LlamatuneError, match=r"qwen3moe.gguf: a mixture of experts \(qwen3moe\) runs on the CPU "
                                             r"only so far: use --device cpu$"):
        FrozenBase(qwen3moe, SimpleNamespace(name="cuda"))


def test_expert_lora_gradients(qwen3moe):
    """Per-expert A and B on the three expert tensors (llama.cpp's build_lora_mm_id layout),
    with attention's: every gradient by float64 finite differences."""
    ranks = {"ffn_gate_exps": 2, "ffn_up_exps": 3, "ffn_down_exps": 2, "attn_q": 2}
    assert check_lora_gradients(qwen3moe, ranks, "selective", n_probe=150) < 1e-5


def test_expert_adapters_by_default_and_switched_off(qwen3moe):
    from llamatune.options.training import FinetuneOptions
    from llamatune.train.lora import lora_targets
    kinds = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    cfg = qwen3moe.config
    on = lora_targets(cfg, FinetuneOptions(lora_r=4, rank_ffn_exps=2).ranks(), 4.0, tied=False)
    exps = [t for t in on if t.kind in kinds]
    assert len(exps) == 3 * cfg.n_layer and {t.rank for t in exps} == {2}
    gate = next(t for t in exps if t.kind == "ffn_gate_exps")
    assert (gate.a_shape, gate.b_shape) == ((8, 2, 32), (8, 16, 2))
    assert not any(t.kind == "ffn_gate_inp" for t in on)                  # the router stays frozen
    off = lora_targets(cfg, FinetuneOptions(lora_r=4, no_lora_experts=True, rank_ffn_gate_inp=2).ranks(), 4.0, tied=False)
    assert not any(t.kind in kinds for t in off) and any(t.kind == "ffn_gate_inp" for t in off)


@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0])
def test_export_merges_expert_adapters_per_expert(qwen3moe, tmp_path, tiny_vocab, qtype):
    """export-lora adds s B[e] A[e] to each expert's rows of the 3-D tensor (F32 exactly, and
    the merged model's logits are the runtime adapter's; Q8_0 re-quantized within its
    rounding: a token's choice of experts may flip there, so its values are compared)."""
    from llamatune.commands.export import export_lora
    from llamatune.formats.adapter import LoraAdapter, load_runtime_adapters, write_adapter
    from llamatune.models.infer import Runner
    base = qwen3moe.path if qtype == QType.F32 else write_arch_model(tmp_path / "q8.gguf", qwen3moe.config,
                                                                      tiny_vocab, seed=4, outtype=qtype)
    model = Model(base)
    rng, adapter = np.random.default_rng(9), LoraAdapter("qwen3moe", 2.0)
    for name, (E, n_out, n_in) in ((n, t.shape) for n, t in model.file.tensors.items() if len(t.shape) == 3):
        adapter.pairs[name] = (rng.normal(0, 0.3, (E, 2, n_in)).astype(np.float32),
                               rng.normal(0, 0.3, (E, n_out, 2)).astype(np.float32))
    write_adapter(tmp_path / "a.gguf", adapter)
    export_lora(base, [(tmp_path / "a.gguf", 1.0)], tmp_path / "merged.gguf")
    merged = Model(tmp_path / "merged.gguf")
    for name, (a, b) in adapter.pairs.items():
        want = _dequantized(model)[name] + b @ a                             # scale alpha / r = 1
        got = _dequantized(merged)[name]
        np.testing.assert_allclose(got, want, rtol=1e-6 if qtype == QType.F32 else 0,
                                   atol=1e-6 if qtype == QType.F32 else 0.01 * np.abs(want).max())
    if qtype == QType.F32:
        ids = np.random.default_rng(1).integers(0, 400, (1, 12))
        runtime = Runner(model, load_runtime_adapters(model, [(str(tmp_path / "a.gguf"), 1.0)])).forward(ids)
        assert np.abs(runtime - Runner(model).forward(ids)).max() > 1e-2     # the adapter matters
        np.testing.assert_allclose(Runner(merged).forward(ids), runtime, atol=1e-4 * np.abs(runtime).max())


# --------------------------------------------------------------------------- the load-balancing loss
def _aux_graph(model, ranks, coef, mode="layer"):
    from checks.arch_reference import batch, lora_setup
    from llamatune.train.step import StepExecutor
    targets, params = lora_setup(model, ranks, np.float64)
    g = StepExecutor(model.config, FrozenBase(model), params, targets, 2, 6, mode, dtype=np.float64)
    g.router_aux_coef = coef
    return g, params, batch(model.config, 2, 6)


def test_router_aux_loss_gradients_fd(qwen3moe):
    """--router-aux-loss-coef: the load-balancing loss's gradient through the router's
    logits into its adapter and into attention's (the normed input), with the
    cross-entropy's, by float64 finite differences; the step's loss is the
    cross-entropy plus coef times load_balancing's (one micro-batch: a share of 1)."""
    from fdcheck import fd_check
    g, params, (inputs, tg, w) = _aux_graph(qwen3moe, {"ffn_gate_inp": 2, "attn_v": 2}, 2.0)

    def loss(p):
        params.zero_grad()
        return g.step(inputs, tg, w, key=(7,))
    total = loss(params.data)
    analytic = params.grad.copy()
    g.router_aux_coef = 0.0
    plain = loss(params.data)
    assert np.abs(params.grad - analytic).max() > 1e-3 * np.abs(analytic).max()     # the loss moves the gradient
    g.router_aux_coef = 2.0
    states = [a.ffn.state for a in g.layers]
    from llamatune.train.moe import load_balancing
    aux, _ = load_balancing(states, qwen3moe.config.n_expert)
    assert aux > 0 and total == pytest.approx(plain + 2.0 * aux, rel=1e-12)
    assert fd_check(loss, {"p": params.data}, {"p": analytic}, eps=1e-5, rtol=1e-5, atol=1e-9, n_probe=150) < 1e-5


def test_router_aux_loss_equals_transformers(tmp_path):
    """train/moe.load_balancing and its softmax backward against transformers'
    load_balancing_loss_func (qwen3_moe) under torch autograd, on the same float64 router
    logits of 3 layers (its sums run in float32: agreement to 1e-6)."""
    import json
    import subprocess
    from types import SimpleNamespace
    from llamatune.models.moe import route
    from llamatune.train.moe import load_balancing, probs_backward
    if not Path(TORCH_PYTHON).exists():
        pytest.skip(f"no Python with torch and transformers at {TORCH_PYTHON} (LLAMATUNE_TORCH_PYTHON)")
    L, N, E, k = 3, 10, 8, 2
    logits = np.random.default_rng(3).normal(0, 1.5, (L, N, E))
    np.save(tmp_path / "logits.npy", logits)
    script = f"""
import json, numpy as np, torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
z = torch.tensor(np.load({str(tmp_path / "logits.npy")!r}), dtype=torch.float64, requires_grad=True)
aux = load_balancing_loss_func(tuple(z), {E}, {k})
aux.backward()
print(json.dumps({{"aux": float(aux), "grad": z.grad.tolist()}}))
"""
    proc = subprocess.run([TORCH_PYTHON, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hf = json.loads(proc.stdout.strip().splitlines()[-1])
    states = []
    for z in logits:
        idx, _, probs = route(z, k, True)
        states.append(SimpleNamespace(idx=idx, probs=probs, prob_sum=probs.sum(axis=0)))
    aux, dp = load_balancing(states, E)
    assert aux == pytest.approx(hf["aux"], rel=1e-6)
    grad = np.zeros_like(logits)
    for g, s in zip(grad, states):
        probs_backward(g, dp, s.probs)
    want = np.array(hf["grad"])
    assert np.abs(grad - want).max() <= 1e-6 * np.abs(want).max()


def test_router_options(qwen3moe, tmp_path):
    from llamatune.options.training import FinetuneOptions
    from llamatune.train.lora import lora_targets
    on = lora_targets(qwen3moe.config, FinetuneOptions(lora_r=4, train_router=True).ranks(), 4.0, tied=False)
    assert {t.rank for t in on if t.kind == "ffn_gate_inp"} == {4} and len([t for t in on if t.kind == "ffn_gate_inp"]) == 2
    opts = FinetuneOptions(lora_r=4, train_router=True, rank_ffn_gate_inp=2)
    assert opts.ranks()["ffn_gate_inp"] == 2 and FinetuneOptions(lora_r=4).ranks()["ffn_gate_inp"] == 0
    with pytest.raises(LlamatuneError, match=r"--router-aux-loss-coef -0.5: must be 0 or more"):
        FinetuneOptions(router_aux_loss_coef=-0.5).check()


def test_memory_plan_and_dry_run_name_the_experts(qwen3moe):
    """The experts' rows (N k of them) are planned: their scratch once, the kept g, u, probs,
    w per layer (shared in layer mode), the expert adapters' x A^T; a graph allocates
    exactly the plan; --dry-run names the model file's share and its experts'."""
    from llamatune.kernels.moe import scratch_shapes
    from llamatune.train.buffers import step_plan
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import lora_targets
    from llamatune.train.memory import Planner, gib
    from llamatune.train.trainer import file_share
    cfg = qwen3moe.config
    targets = lora_targets(cfg, {"ffn_gate_exps": 2, "ffn_down_exps": 3, "attn_q": 2}, 4.0, tied=False)
    N, P = 2 * 8, 2 * 8 * cfg.n_expert_used
    plan = step_plan(cfg, targets, 2, 8, "layer", 4, False).buffers
    assert {k: plan[f"moe.{k}"] for k in scratch_shapes(P, 1, 1)} == scratch_shapes(P, cfg.n_embd, cfg.n_ff_exp)
    assert plan["layer.moe.g"] == plan["layer.moe.u"] == (P, cfg.n_ff_exp)
    assert plan["layer.moe.probs"] == (N, cfg.n_expert) and plan["layer.moe.w"] == (N, cfg.n_expert_used)
    assert plan["moe.xa.ffn_gate_exps.2"] == (P, 2) and plan["moe.xa.ffn_down_exps.3"] == (P, 3)
    none = step_plan(cfg, targets, 2, 8, "none", 4, False).buffers
    assert all(f"blk.{i}.moe.g" in none and f"moe.xa.blk.{i}.ffn_gate_exps.weight" in none for i in range(cfg.n_layer))
    base = FrozenBase(qwen3moe)
    planner = Planner(cfg, targets, base, 1 << 20, qwen3moe.path.stat().st_size, 0, 0.0)
    est = planner.estimate(2, 8, "layer")
    experts = sum(t.nbytes for t in base.experts.values())
    assert 0 < experts < est.model
    assert file_share(planner, est) == (f"of the layer estimate: the model file {gib(est.model)} (the experts "
                                        f"{gib(experts)} of it), mapped and read in place; the run's own memory "
                                        f"{gib(est.total - est.model)}")


def test_bf16_products_take_the_experts_in_bf16(qwen3moe, monkeypatch):
    """With bf16 products the experts come dequantized to bf16 (FrozenBase.expert_matrix_bf16)
    and multiply through the run's Products: the step's loss and LoRA gradients (experts'
    and attention's) close to the float32 step's."""
    from llamatune.kernels import bf16
    from llamatune.precision import policy
    from llamatune.train.step import StepExecutor
    from checks.arch_reference import batch, lora_setup
    if not (bf16.cpu_bf16_flags() and bf16.available()):
        pytest.skip("this CPU has no native bf16 or oneDNN is not installed")
    ranks = {"ffn_gate_exps": 2, "ffn_down_exps": 2, "attn_q": 2}
    inputs, tg, w = batch(qwen3moe.config, 2, 16)
    got = {}
    for dtype in ("f32", "bf16"):
        targets, params = lora_setup(qwen3moe, ranks, np.float32)
        base = FrozenBase(qwen3moe)
        seen = []
        real = base.expert_matrix_bf16
        monkeypatch.setattr(base, "expert_matrix_bf16", lambda name, e: seen.append(e) or real(name, e))
        g = StepExecutor(qwen3moe.config, base, params, targets, 2, 16, "layer", policy=policy(dtype))
        params.zero_grad()
        got[dtype] = (g.step(inputs, tg, w), params.grad.copy(), len(seen))
    assert got["f32"][2] == 0 and got["bf16"][2] > 0
    assert got["bf16"][0] == pytest.approx(got["f32"][0], rel=1e-2)
    a, b = got["f32"][1], got["bf16"][1]
    assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99
