"""gemma4 (Gemma 4 text, the dense core): the declaration's metadata and tensors as
llama.cpp's gemma4 loader reads them (a tiny model written by llamatune's writer), the
per-layer arrays it accepts (one value for every layer; the sliding flags as a period),
what it refuses in one line naming it (per-layer embeddings, shared KV, full-attention
heads of another size, per-layer kv heads or widths, an aperiodic window pattern, the
experts); the forward, decoding and training loss against the float64 reference
(checks/arch_reference.py: the value norm, the layer output scale, rope_freqs on the
full-attention layers alone), LoRA gradients by float64 finite differences."""
from __future__ import annotations

import numpy as np
import pytest

from checks.arch_reference import Block
from hf_oracle import (built_model, check_greedy_generation, check_logits, check_lora_gradients_against_hf,
                       check_perplexity, check_short_lora)
from llamatune.errors import LlamatuneError
from llamatune.models.config import ModelConfig
from llamatune.models.model import Model

GEMMA4 = dict(n_vocab=400, n_ctx_train=64, n_embd=32, n_layer=4, n_ff=48, n_head=4, n_head_kv=2, head_dim=8,
              n_rot=8, norm_eps=1e-6, attn_scale=1.0, sliding_window=8, swa_pattern=2, rope_freq_base=1e6,
              rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0, final_softcap=30.0)
# llama.cpp llama_model_gemma4::load_arch_tensors, a dense layer without per-layer embeddings
LAYER = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
         "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
         "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight", "layer_output_scale.weight"}


BLOCK = Block(rope_neox=True, gelu=True, embd_scale=True, qk_norm=True, post_norms=True, attn_scale=1.0,
              final_softcap=30.0, swa=(True, False, True, False), window=8,
              rope=((10000.0, 1.0), (1e6, 1.0), (10000.0, 1.0), (1e6, 1.0)), v_norm=True, out_scale=True,
              rope_freqs=(False, True, False, True))


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_vocab):
    """A tiny gemma4 with the converter's proportional-rope factors (half of the pairs
    turned, the rest held by 1e30) and layer output scales away from 1."""
    from checks.arch_reference import random_model_weights
    from llamatune.models.writer import write_model
    cfg = ModelConfig(arch="gemma4", **GEMMA4)
    w = random_model_weights(cfg, seed=3)
    w["rope_freqs.weight"] = np.array([1.0, 1.0, 1e30, 1e30], np.float32)
    for i in range(cfg.n_layer):
        w[f"blk.{i}.layer_output_scale.weight"] = np.array([0.6 + 0.2 * i], np.float32)
    path = tmp_path_factory.mktemp("gemma4") / "gemma4.gguf"
    write_model(path, cfg, w, tiny_vocab)
    return cfg, path


def test_metadata_and_tensors_as_llama_cpp_loads_them(written):
    cfg, path = written
    model = Model(path)
    assert model.config == cfg and cfg.spec.embd_scale and cfg.spec.activation == "gelu" and cfg.spec.qk_norm
    md = model.file.metadata
    assert md["gemma4.attention.sliding_window_pattern"] == [True, False, True, False]
    assert md["gemma4.attention.key_length_swa"] == 8 and md["gemma4.rope.dimension_count_swa"] == 8
    assert [cfg.window(i) for i in range(4)] == [8, 0, 8, 0]
    for i in range(4):
        assert {n.removeprefix(f"blk.{i}.") for n in model.file.tensors if n.startswith(f"blk.{i}.")} == LAYER
    scale = model.weights.layers[1].vectors["layer_output_scale.weight"]
    assert scale.shape == (1,) and scale.dtype == np.float32


def test_one_value_for_every_layer_is_accepted(written):
    md = dict(Model(written[1]).file.metadata)
    md["gemma4.attention.head_count_kv"] = [2, 2, 2, 2]
    md["gemma4.feed_forward_length"] = [48] * 4
    assert ModelConfig.from_metadata(md, "m.gguf") == written[0]


@pytest.mark.parametrize("change, message", [
    ({"gemma4.embedding_length_per_layer_input": 16}, r"gemma4 with per-layer embeddings"),
    ({"gemma4.attention.shared_kv_layers": 2}, r"gemma4 with KV shared across layers"),
    ({"gemma4.attention.key_length_swa": 4}, r"gemma4 with full-attention heads of 8 and sliding-window heads of 4"),
    ({"gemma4.rope.dimension_count_swa": 4}, r"gemma4 with sliding-window layers rotating 4 of 8 dimensions"),
    ({"gemma4.attention.head_count_kv": [2, 1, 2, 1]}, r"gemma4 with kv head counts \('gemma4\.attention\."
                                                       r"head_count_kv' per layer\) is not supported yet$"),
    ({"gemma4.feed_forward_length": [48, 48, 96, 96]}, r"gemma4 with feed-forward widths"),
    ({"gemma4.attention.sliding_window_pattern": [True, False, False, True]},
     r"gemma4's sliding-window layers \[1, 0, 0, 1\] have no period"),
    ({"gemma4.attention.sliding_window_pattern": [True]},
     r"metadata key 'gemma4\.attention\.sliding_window_pattern' must be a list of 4 booleans"),
    ({"gemma4.expert_count": 8}, r"architecture 'gemma4' with 8 experts is a mixture of experts not supported yet"),
])
def test_what_is_not_supported_is_refused_in_one_line_naming_it(written, change, message):
    md = dict(Model(written[1]).file.metadata) | change
    with pytest.raises(LlamatuneError, match=r"^m\.gguf: .*" + message) as e:
        ModelConfig.from_metadata(md, "m.gguf")
    assert "\n" not in str(e.value)


def test_forward_decoding_and_training_loss_match_the_float64_reference(written):
    from checks.arch_reference import check_forward
    check_forward(Model(written[1]), BLOCK, T=12)          # past the window of 8


def test_lora_gradients_every_kind_by_finite_differences(written):
    from checks.arch_reference import all_ranks, check_lora_gradients
    model = Model(written[1])
    assert check_lora_gradients(model, all_ranks(model.config, tied=True), "layer") < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_modes_identical(written, dtype):
    from checks.arch_reference import all_ranks, check_modes_identical
    model = Model(written[1])
    check_modes_identical(model, all_ranks(model.config, tied=True), dtype, packed=dtype == np.float64)


# --------------------------------------------------------------------------- HF and llama.cpp (slow)

HF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


ORACLE = "checks.gemma4_hf"


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return built_model(tmp_path_factory, ORACLE)


@pytest.mark.slow
def test_hf_model_loads_and_its_logits_equal_hf_float64(hf_model):
    model = Model(hf_model / "f32.gguf")
    cfg = model.config
    assert (cfg.swa_pattern, cfg.sliding_window, cfg.attn_scale, cfg.final_softcap) == (4, 16, 1.0, 30.0)
    np.testing.assert_array_equal(model.weights.rope_freqs, np.float32([1, 1] + [1e30] * 6))   # a quarter turns
    check_logits(hf_model, ORACLE, 40, 1e-5)                                       # past the window of 16


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_perplexity_equals_llama_perplexity_and_hf(hf_model, outtype):
    """llama-perplexity's windows (64 tokens, BOS first, the second half scored); HF's
    figure from its float64 logits of the same windows."""
    check_perplexity(hf_model, ORACLE, outtype, bos=True)


@pytest.mark.slow
def test_loss_and_lora_gradients_equal_hf_autograd(hf_model):
    """B = 0: the adapted model is HF's, and dL/dB = s dL/dW A^T with HF's dL/dW (float64 autograd)."""
    check_lora_gradients_against_hf(hf_model, ORACLE, {k: 4 for k in HF_LINEARS}, 40, True,
                                    lambda hf, i, kind, cfg: hf[f"model.layers.{i}.{HF_LINEARS[kind]}.weight"])


@pytest.mark.slow
def test_short_lora_lowers_perplexity_and_llama_cpp_agrees(hf_model, tmp_path):
    check_short_lora(hf_model, tmp_path)


@pytest.mark.slow
def test_greedy_generation_equals_llama_cpp(hf_model):
    """48 greedy tokens through the cache (the recurrent states / the sliding window) as llama-completion's."""
    check_greedy_generation(hf_model)
