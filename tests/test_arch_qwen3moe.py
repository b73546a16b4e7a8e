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
TORCH_PYTHON = os.environ.get("LLAMATUNE_TORCH_PYTHON", "/work/venvs/torch/bin/python")


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
