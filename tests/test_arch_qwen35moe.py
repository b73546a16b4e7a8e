"""qwen35moe (Qwen3.5 MoE: qwen35's delta-net and gated-attention layers, a mixture of
experts plus a sigmoid-gated shared expert as each layer's feed-forward): the
declaration's tensors and metadata as llama.cpp's loader reads them, the forward and
decoding against the float64 reference (checks/qwen35_reference.py), every LoRA kind's
gradient (experts, shared expert and its gate included) by float64 finite differences;
and (slow, with the torch interpreter and llama.cpp's tools) a tiny HF-made model
converted by llama.cpp's converter in F32 and Q8_0: logits against HF's float64 ones,
perplexity against llama-perplexity's and HF's, loss and gradients against HF's float64
autograd, and a short LoRA that llama-perplexity --lora scores as llamatune does."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import TEXT
from hf_oracle import (built_model, check_greedy_generation, check_logits, check_lora_gradients_against_hf,
                       check_perplexity, check_short_lora)
from llamatune.errors import LlamatuneError
from llamatune.models.config import ModelConfig
from llamatune.models.model import Model

QWEN35MOE = dict(n_vocab=400, n_ctx_train=64, n_embd=64, n_layer=4, n_ff=48, n_head=4, n_head_kv=2, head_dim=16,
                 n_rot=8, norm_eps=1e-6, ssm_conv_kernel=4, ssm_state_size=16, ssm_group_count=2,
                 ssm_time_step_rank=4, ssm_inner_size=64, recurrent_layers=(True, False, True, False),
                 full_attention_interval=4, rope_sections=(2, 1, 1, 0), n_expert=6, n_expert_used=2, n_ff_exp=32)
# llama.cpp llama_model_qwen35moe::load_arch_tensors (load_block_trunk), per layer kind
FFN = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
       "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
       "attn_norm.weight", "post_attention_norm.weight"}
RECURRENT = FFN | {"attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                   "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight"}
ATTENTION = FFN | {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
                   "attn_k_norm.weight"}
EXPERT_RANKS = {"ffn_gate_exps": 2, "ffn_up_exps": 2, "ffn_down_exps": 2}


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_vocab):
    from checks.arch_reference import write_arch_model
    cfg = ModelConfig(arch="qwen35moe", **QWEN35MOE)
    return cfg, write_arch_model(tmp_path_factory.mktemp("qwen35moe") / "qwen35moe.gguf", cfg, tiny_vocab, seed=2)


def test_config_and_tensors_as_llama_cpp_loads_them(written):
    cfg, path = written
    model = Model(path)
    assert model.config == cfg and cfg.spec.moe and cfg.part_kinds(0) == ("delta_net", "moe_shared_post")
    md = model.file.metadata
    assert (md["qwen35moe.expert_count"], md["qwen35moe.expert_used_count"], md["qwen35moe.expert_feed_forward_length"],
            md["qwen35moe.expert_shared_feed_forward_length"]) == (6, 2, 32, 48)
    for i in range(4):
        names = {n.removeprefix(f"blk.{i}.") for n in model.file.tensors if n.startswith(f"blk.{i}.")}
        assert names == (RECURRENT if i % 2 == 0 else ATTENTION), i
    t = model.file.tensors
    assert t["blk.0.ffn_gate_inp_shexp.weight"].shape == (1, 64) and t["blk.1.ffn_down_shexp.weight"].shape == (64, 48)
    assert t["blk.0.ffn_up_exps.weight"].shape == (6, 32, 64) and t["blk.3.ffn_down_exps.weight"].shape == (6, 64, 32)


def test_shared_width_falls_back_to_feed_forward_length_as_llama_cpp(written):
    md = dict(Model(written[1]).file.metadata)
    del md["qwen35moe.expert_shared_feed_forward_length"]
    md["qwen35moe.feed_forward_length"] = 40
    assert ModelConfig.from_metadata(md, "m.gguf").n_ff == 40
    del md["qwen35moe.feed_forward_length"]
    with pytest.raises(LlamatuneError, match=r"^m\.gguf: missing required metadata key "
                                             r"'qwen35moe\.expert_shared_feed_forward_length'$"):
        ModelConfig.from_metadata(md, "m.gguf")


def test_the_multi_token_prediction_layer_is_not_read(written, tmp_path):
    """A file as the converter writes it without --no-mtp: block_count counts the MTP
    layer (nextn_predict_layers 1, its tensors blk.4.* and blk.4.nextn.*); the trunk is
    the 4 layers before it, and the logits are those of the file without it."""
    from llamatune.formats.gguf_io import KV, GGUFFile, kv, tensor_out, write_gguf
    from llamatune.models.infer import Runner
    f = GGUFFile(written[1])
    change = {"qwen35moe.block_count": 5, "qwen35moe.attention.recurrent_layers": [True, False, True, False, False]}
    kvs = [kv(k, change[k]) if k in change else KV(k, v.value, v.vtype, v.sub_type) for k, v in f.kvs.items()]
    kvs.append(kv("qwen35moe.nextn_predict_layers", 1))
    tensors = [tensor_out(n, np.array(t.data)) for n, t in f.tensors.items()]
    tensors += [tensor_out(n.replace("blk.3.", "blk.4."), np.array(t.data)) for n, t in f.tensors.items()
                if n.startswith("blk.3.")]
    tensors.append(tensor_out("blk.4.nextn.eh_proj.weight", np.zeros((64, 128), np.float32)))
    write_gguf(tmp_path / "mtp.gguf", "qwen35moe", kvs, tensors)
    model = Model(tmp_path / "mtp.gguf")
    assert model.config == written[0]
    tokens = np.random.default_rng(2).integers(0, 400, (1, 7))
    np.testing.assert_array_equal(Runner(model).forward(tokens), Runner(Model(written[1])).forward(tokens))
    md = dict(model.file.metadata) | {"qwen35moe.nextn_predict_layers": 5}
    with pytest.raises(LlamatuneError, match=r"^m\.gguf: metadata key 'qwen35moe\.nextn_predict_layers' is 5, "
                                             r"expected 0 to 4 \(block_count 5 includes them\)$"):
        ModelConfig.from_metadata(md, "m.gguf")


def test_runner_forward_decoding_and_training_loss_match_the_float64_reference(written):
    from checks import qwen35_reference as ref
    from checks.arch_reference import batch, cross_entropy, model_weights
    from llamatune.models.infer import KVCache, Runner
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.params import ParamBuffer
    model = Model(written[1])
    cfg = model.config
    inputs, targets, weights = batch(cfg, 2, 9, seed=5)
    W = model_weights(model)
    want = np.stack([ref.forward(cfg, W, row) for row in inputs])
    runner = Runner(model)
    np.testing.assert_allclose(runner.forward(inputs), want, rtol=2e-4, atol=2e-4)
    cache = KVCache.empty(model, 2, 9)
    steps = [runner.forward(inputs[:, :4], cache)] + [runner.forward(inputs[:, t:t + 1], cache) for t in range(4, 9)]
    np.testing.assert_allclose(np.concatenate(steps, 1), want, rtol=2e-4, atol=2e-4)
    g = StepExecutor(cfg, FrozenBase(model), ParamBuffer([], np.float64), [], 2, 9, dtype=np.float64)
    g.loss(inputs, targets, weights)
    ce = np.concatenate([cross_entropy(want[b], targets[b]) for b in range(2)])
    np.testing.assert_allclose(g.losses, ce, rtol=1e-7, atol=1e-8)


def test_lora_gradients_every_kind_by_finite_differences(written):
    """Every adapter (delta-net, attention, the router, the shared expert and its gate,
    the experts per expert, the norms) against float64 finite differences."""
    from checks.arch_reference import all_ranks, check_lora_gradients
    model = Model(written[1])
    ranks = all_ranks(model.config, tied=False) | EXPERT_RANKS
    assert {"ffn_gate_inp", "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
            "attn_qkv", "ssm_out", "attn_q", "post_attention_norm"} <= set(ranks)
    assert check_lora_gradients(model, ranks, "layer", n_probe=150) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_modes_identical(written, dtype):
    from checks.arch_reference import all_ranks, check_modes_identical
    model = Model(written[1])
    check_modes_identical(model, all_ranks(model.config, tied=False) | EXPERT_RANKS, dtype,
                          packed=dtype == np.float64)


def test_finetune_defaults_adapt_the_shared_expert_and_the_experts(written, tmp_path):
    from typer.testing import CliRunner

    from llamatune.cli.main import app
    from llamatune.formats.gguf_io import GGUFFile
    (tmp_path / "t.txt").write_text(TEXT)
    r = CliRunner().invoke(app, [str(a) for a in (
        "finetune", "--model-base", written[1], "--train-data", tmp_path / "t.txt", "--ctx", 16, "--batch", 2,
        "--lora-r", 2, "--adam-iter", 2, "--save-every", 0, "--checkpoint-out", tmp_path / "chk-ITERATION.gguf",
        "--lora-out", tmp_path / "adapter-ITERATION.gguf")])
    assert r.exit_code == 0, r.output
    adapter = GGUFFile(tmp_path / "adapter-LATEST.gguf")
    kinds = {n.split(".")[2] for n in adapter.tensors if n.startswith("blk.0.")}
    assert kinds == {"attn_qkv", "attn_gate", "ssm_out", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
                     "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    assert adapter.tensors["blk.0.ffn_up_exps.weight.lora_a"].shape == (6, 2, 64)


# --------------------------------------------------------------------------- HF and llama.cpp (slow)

ORACLE = "checks.qwen35moe_hf"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return built_model(tmp_path_factory, ORACLE)


@pytest.mark.slow
def test_logits_equal_hf_float64(hf_model):
    check_logits(hf_model, ORACLE, 70, 2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_perplexity_equals_llama_perplexity_and_hf(hf_model, outtype):
    """llama-perplexity's windows (64 tokens, the second half scored); HF's figure from its
    float64 logits of the same windows (the F32 file's weights)."""
    check_perplexity(hf_model, ORACLE, outtype)


HF_LINEARS = {"attn_qkv": ("linear_attn.in_proj_qkv", 0), "attn_gate": ("linear_attn.in_proj_z", 0),
              "ssm_alpha": ("linear_attn.in_proj_a", 0), "ssm_beta": ("linear_attn.in_proj_b", 0),
              "ssm_out": ("linear_attn.out_proj", 1), "attn_q": ("self_attn.q_proj", None),
              "attn_k": ("self_attn.k_proj", None), "attn_v": ("self_attn.v_proj", None),
              "attn_output": ("self_attn.o_proj", None), "ffn_gate_inp": ("mlp.gate", None),
              "ffn_gate_inp_shexp": ("mlp.shared_expert_gate", None),
              "ffn_gate_shexp": ("mlp.shared_expert.gate_proj", None),
              "ffn_up_shexp": ("mlp.shared_expert.up_proj", None),
              "ffn_down_shexp": ("mlp.shared_expert.down_proj", None)}


def _hf_weight_grad(hf, i: int, kind: str, cfg) -> np.ndarray:
    """HF's dL/dW of layer i's `kind` in the GGUF's layout (value heads tiled as the converter
    writes them; the experts' fused gate|up split)."""
    from test_arch_qwen35 import _tiled
    if kind in ("ffn_gate_exps", "ffn_up_exps"):
        gu = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        return gu[:, :cfg.n_ff_exp] if kind == "ffn_gate_exps" else gu[:, cfg.n_ff_exp:]
    if kind == "ffn_down_exps":
        return hf[f"model.layers.{i}.mlp.experts.down_proj"]
    module, axis = HF_LINEARS[kind]
    return _tiled(hf[f"model.layers.{i}.{module}.weight"], kind, axis, cfg)


@pytest.mark.slow
def test_loss_and_lora_gradients_equal_hf_autograd(hf_model):
    """B = 0: the adapted model is HF's, and dL/dB = s dL/dW A^T (per expert for the
    experts) with HF's dL/dW by float64 autograd."""
    ts = check_lora_gradients_against_hf(hf_model, ORACLE, {k: 4 for k in HF_LINEARS} | EXPERT_RANKS, 70, False,
                                         _hf_weight_grad)
    assert {t.kind for t in ts} == set(HF_LINEARS) | set(EXPERT_RANKS)


@pytest.mark.slow
def test_short_lora_lowers_perplexity_and_llama_cpp_agrees(hf_model, tmp_path):
    check_short_lora(hf_model, tmp_path)


@pytest.mark.slow
def test_greedy_generation_equals_llama_cpp(hf_model):
    """48 greedy tokens through the cache (the recurrent states / the sliding window) as llama-completion's."""
    check_greedy_generation(hf_model)


def test_peft_adapters_of_every_kind_both_ways(written, tmp_path):
    """A PEFT adapter on the delta-net projections (value heads in HF's grouped order), the
    attention, the shared expert and its gate, and the experts (target_parameters) converts
    to a GGUF adapter whose s B A is HF's in the converter's order, and back to the same
    PEFT tensors."""
    import json

    from safetensors.numpy import load_file, save_file

    from llamatune.commands.convert import convert
    from llamatune.formats.adapter import read_adapter
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.arch import get_arch, tensor_shape
    from test_arch_qwen35 import _tiled
    cfg, path = written
    f = GGUFFile(path)
    axes = {"attn_qkv": 0, "attn_gate": 0, "ssm_alpha": 0, "ssm_beta": 0, "ssm_out": 1}
    rng, tensors, want, R, E = np.random.default_rng(5), {}, {}, 3, cfg.n_expert
    for i in range(cfg.n_layer):
        for kind, module in get_arch("qwen35moe").peft_modules:
            if f"blk.{i}.{kind}.weight" not in f.tensors:
                continue
            n_out, n_in = tensor_shape(cfg, kind)
            a, b = rng.normal(0, 0.3, (R, n_in)).astype(np.float32), rng.normal(0, 0.3, (n_out, R)).astype(np.float32)
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = a, b
            want[f"blk.{i}.{kind}.weight"] = _tiled(2.0 * (b @ a), kind, axes.get(kind), cfg)
        experts = f"base_model.model.model.layers.{i}.mlp.experts"
        for nest, kinds, (n_out, n_in) in (("base_layer.", ("gate", "up"), (2 * cfg.n_ff_exp, cfg.n_embd)),
                                            ("", ("down",), (cfg.n_embd, cfg.n_ff_exp))):
            a = rng.normal(0, 0.3, (R * E, n_in)).astype(np.float32)
            b = rng.normal(0, 0.3, (n_out, R * E)).astype(np.float32)
            tensors[f"{experts}.{nest}lora_A.weight"], tensors[f"{experts}.{nest}lora_B.weight"] = a, b
            delta = 2.0 * np.einsum("ore,eri->eoi", b.reshape(n_out, R, E), a.reshape(E, R, n_in))
            for j, k in enumerate(kinds):
                want[f"blk.{i}.ffn_{k}_exps.weight"] = delta[:, j * (n_out // len(kinds)):(j + 1) * (n_out // len(kinds))]
    peft = tmp_path / "peft"
    peft.mkdir()
    save_file(tensors, str(peft / "adapter_model.safetensors"), metadata={"format": "pt"})
    (peft / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": R, "lora_alpha": 6.0,
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}))
    convert(peft, tmp_path / "a.gguf", model_base=path)
    got = read_adapter(tmp_path / "a.gguf", f)
    assert got.pairs.keys() == want.keys()
    assert {n.split(".")[2] for n in want} >= {"attn_qkv", "ssm_out", "ffn_gate_inp_shexp", "ffn_down_exps", "attn_q"}
    for name, (a, b) in got.pairs.items():
        delta = np.einsum("eor,eri->eoi", b, a) if a.ndim == 3 else b @ a
        np.testing.assert_allclose(got.scale(name) * delta, want[name], rtol=1e-5, atol=1e-6)
    convert(tmp_path / "a.gguf", tmp_path / "back", "peft", model_base=path)
    back = load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert back.keys() == tensors.keys()
    for k in tensors:
        np.testing.assert_array_equal(back[k], tensors[k])
