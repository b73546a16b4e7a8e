"""Architecture declarations (models/arch.py, models/archs/*.py)."""
import re

import pytest

from llamatune.errors import LlamatuneError
from llamatune.models.arch import NEOX, NORM, get_arch, supported, tensor_shape
from llamatune.models.config import ModelConfig
from llamatune.models.writer import tensor_names


def tiny(arch: str) -> ModelConfig:
    return ModelConfig(arch=arch, n_vocab=50, n_ctx_train=32, n_embd=16, n_layer=2, n_ff=24, n_head=4,
                       n_head_kv=2, head_dim=4, n_rot=4, norm_eps=1e-5)


def test_every_declared_architecture_is_found_by_its_name():
    names = supported()
    assert {"llama", "qwen2"} <= set(names)
    for name in names:
        assert get_arch(name).name == name


def test_unknown_architecture_is_one_error_listing_the_supported():
    with pytest.raises(LlamatuneError, match=r"architecture 'falcon' is not supported \(supported: .*llama.*qwen2"):
        get_arch("falcon")
    with pytest.raises(LlamatuneError, match=r"m\.gguf: architecture 'model' is not supported"):
        ModelConfig.from_metadata({"general.architecture": "model"}, "m.gguf")


def test_llama_and_qwen2_declare_the_tensors_llama_cpp_has_in_file_order():
    llama, qwen2 = get_arch("llama"), get_arch("qwen2")
    assert (llama.rope_mode, qwen2.rope_mode) == (NORM, NEOX)
    assert llama.matrices == ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert llama.norms == ("attn_norm", "ffn_norm") and llama.biases == ()
    assert qwen2.matrices == llama.matrices and qwen2.biases == ("attn_q", "attn_k", "attn_v")
    assert list(tensor_names(tiny("qwen2")))[:14] == [
        "token_embd.weight", "output_norm.weight", "output.weight",
        "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_q.bias", "blk.0.attn_k.weight",
        "blk.0.attn_k.bias", "blk.0.attn_v.weight", "blk.0.attn_v.bias", "blk.0.attn_output.weight",
        "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"]


def test_tensor_shapes_follow_the_config():
    cfg = tiny("llama")
    assert tensor_shape(cfg, "attn_q") == (16, 16) and tensor_shape(cfg, "attn_k") == (8, 16)
    assert tensor_shape(cfg, "attn_k.bias") == (8,) and tensor_shape(cfg, "ffn_down") == (16, 24)
    assert tensor_shape(cfg, "output") == (50, 16) and tensor_shape(cfg, "ffn_norm") == (16,)
    with pytest.raises(KeyError, match="no shape for tensor kind 'attn_qkv'"):
        tensor_shape(cfg, "attn_qkv")


def test_each_layer_is_built_from_the_part_kinds_its_declaration_names(monkeypatch):
    """Arch.mixer / Arch.ffn pick every layer's parts, Arch.parts(cfg, i) per layer (a
    hybrid); the forward classes or training's (with their backward) by the same kinds."""
    from dataclasses import replace

    from llamatune.models import config as config_module
    from llamatune.models.parts import PARTS, Attention, FeedForward, layer_act_shapes, layer_parts
    from llamatune.train.parts import TRAIN_PARTS, AttentionBackward, FeedForwardBackward
    cfg = tiny("llama")
    assert [tuple(type(p) for p in parts) for parts in layer_parts(cfg)] == [(Attention, FeedForward)] * 2
    assert [tuple(type(p) for p in parts) for parts in layer_parts(cfg, TRAIN_PARTS)] == \
        [(AttentionBackward, FeedForwardBackward)] * 2

    class Other(FeedForward):
        kind = "other"
    llama = get_arch("llama")
    hybrid = replace(llama, parts=lambda c, i: ("attention", "other" if i % 2 else "feed_forward"))
    monkeypatch.setattr(config_module, "get_arch", lambda name: hybrid)
    layers = layer_parts(cfg, {"attention": Attention, "feed_forward": FeedForward, "other": Other})
    assert [type(parts[1]) for parts in layers] == [FeedForward, Other]
    assert "other.g" in layer_act_shapes(layers[1], 2, 4) and "feed_forward.g" in layer_act_shapes(layers[0], 2, 4)
    with pytest.raises(LlamatuneError, match=r"architecture llama: layer 1 has part kind\(s\) \['other'\], "
                                             r"not one of " + re.escape(str(sorted(PARTS))) + "$"):
        layer_parts(cfg)
