"""olmo2, smollm3 and granite: tensors and metadata as llama.cpp's converter writes them,
the forward of infer.py and step.py against the independent numpy forward
(checks/arch_reference.py), LoRA gradients on every kind by finite differences (through
olmo2's whole-width q/k norms and missing pre-norms, smollm3's rope-less layers and
granite's multipliers), checkpointing modes bit-identical, and dense (train-from-scratch)
gradients. tests/test_arch_families_hf.py checks the same families against HF
transformers and llama.cpp on models made and converted by them."""
from __future__ import annotations

import numpy as np
import pytest

from checks.arch_reference import (Block, all_ranks, check_dense_gradients, check_forward, check_lora_gradients,
                                   check_modes_identical, write_arch_model)
from conftest import tiny_config
from llamatune.errors import LlamatuneError
from llamatune.formats.gguf_io import kv
from llamatune.models.arch import NEOX, NORM
from llamatune.models.model import Model

SHAPE = dict(n_embd=32, n_ff=48, n_head=4, n_head_kv=2, head_dim=8, n_rot=8, n_layer=4)
GRANITE = dict(embd_multiplier=12.0, attn_scale=0.0625, residual_scale=0.375, logit_scale=8.0)
CASES = {   # family: (config values, reference block, tied head)
    "olmo2": (SHAPE, Block(rope_neox=True, pre_norms=False, qk_norm_full=True, post_norms=True), False),
    "smollm3": (SHAPE | dict(nope_step=4), Block(rope_neox=False, nope=(False, False, False, True)), True),
    "granite": (SHAPE | GRANITE, Block(rope_neox=False, embd_mult=12.0, attn_scale=0.0625, residual_scale=0.375,
                                       logit_scale=8.0), True),
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory, tiny_vocab):
    name = request.param
    values, blk, tied = CASES[name]
    cfg = tiny_config(name, **values)
    path = write_arch_model(tmp_path_factory.mktemp(name) / f"{name}.gguf", cfg, tiny_vocab, seed=5, tied=tied)
    return name, Model(path), blk, tied


# ----------------------------------------------------------------------------- declarations

def layer0(model):
    return sorted(n.removeprefix("blk.0.") for n in model.file.tensors if n.startswith("blk.0."))


def test_olmo2_declares_llama_cpps_tensors(tmp_path, tiny_vocab):
    """llama_model_olmo2::load_arch_tensors: no attn_norm / ffn_norm, q/k norms of the whole width."""
    cfg = tiny_config("olmo2", **SHAPE)
    m = Model(write_arch_model(tmp_path / "o.gguf", cfg, tiny_vocab))
    spec = m.config.spec
    assert spec.rope_mode == NEOX and not spec.pre_norms and spec.post_norms and spec.qk_norm_full
    assert layer0(m) == sorted(f"{k}.weight" for k in (
        "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm",
        "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"))
    assert m.file.tensors["blk.0.attn_q_norm.weight"].shape == (32,)       # n_head * head_dim
    assert m.file.tensors["blk.0.attn_k_norm.weight"].shape == (16,)       # n_head_kv * head_dim
    assert "output.weight" in m.file.tensors


def test_olmo2_with_a_sliding_window_is_refused(tmp_path, tiny_vocab):
    from llamatune.models.writer import write_model
    from checks.arch_reference import random_model_weights
    cfg = tiny_config("olmo2", **SHAPE)
    write_model(tmp_path / "olmo3.gguf", cfg, random_model_weights(cfg, 0), tiny_vocab,
                extra=[kv("olmo2.attention.sliding_window", 16)])
    with pytest.raises(LlamatuneError, match=r"olmo3\.gguf: olmo2 with a sliding window \(OLMo 3\) is not supported"):
        Model(tmp_path / "olmo3.gguf")


def test_smollm3_has_no_rope_on_every_fourth_layer():
    cfg = tiny_config("smollm3", **(CASES["smollm3"][0] | dict(n_layer=9)))
    assert cfg.rope_mode == NORM and cfg.spec.peft_permute_qk
    assert [i for i in range(9) if not cfg.has_rope(i)] == [3, 7]
    assert all(tiny_config("llama", **SHAPE).has_rope(i) for i in range(4))


def test_granite_reads_and_writes_its_multipliers(tmp_path, tiny_vocab):
    cfg = tiny_config("granite", **(SHAPE | GRANITE))
    md = cfg.metadata()
    assert (md["granite.embedding_scale"], md["granite.attention.scale"], md["granite.residual_scale"],
            md["granite.logit_scale"]) == (12.0, 0.0625, 0.375, 8.0)
    m = Model(write_arch_model(tmp_path / "g.gguf", cfg, tiny_vocab, tied=True))
    got = m.config
    assert (got.embd_multiplier, got.attn_scale, got.residual_scale, got.logit_scale) == (12.0, 0.0625, 0.375, 8.0)
    assert got.embedding_scale == 12.0 and all(got.has_rope(i) for i in range(4))
    assert got.logit_multiplier(np.float32) == np.float32(0.125)


def test_granite_without_rope_finetuned_has_no_rope(tmp_path, tiny_vocab):
    from llamatune.models.writer import write_model
    from checks.arch_reference import random_model_weights
    cfg = tiny_config("granite", **(SHAPE | GRANITE))
    write_model(tmp_path / "nope.gguf", cfg, random_model_weights(cfg, 0, tied=True), tiny_vocab,
                extra=[kv("granite.rope.scaling.finetuned", False)])
    assert not any(Model(tmp_path / "nope.gguf").config.has_rope(i) for i in range(4))


def test_granite_without_logit_scale_is_refused(tmp_path, tiny_vocab):
    from llamatune.models.config import ModelConfig
    md = tiny_config("granite", **(SHAPE | GRANITE)).metadata() | {"general.architecture": "granite"}
    del md["granite.logit_scale"]
    with pytest.raises(LlamatuneError, match=r"g\.gguf: missing required metadata key 'granite\.logit_scale'"):
        ModelConfig.from_metadata(md, "g.gguf")


# ----------------------------------------------------------------------------- forward and gradients

def test_forward_matches_numpy(family):
    name, model, blk, tied = family
    check_forward(model, blk)


def test_lora_gradients_every_kind(family):
    name, model, blk, tied = family
    ranks = all_ranks(model.config, tied=tied)
    assert check_lora_gradients(model, ranks, "layer", n_probe=150) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_modes_identical(family, dtype):
    name, model, blk, tied = family
    check_modes_identical(model, all_ranks(model.config, tied=tied), dtype, packed=dtype == np.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_dense_gradients(name):
    values, blk, tied = CASES[name]
    cfg = tiny_config(name, **(values | dict(n_embd=16, n_ff=24, n_head=2, n_head_kv=1, head_dim=8, n_rot=8,
                                               n_vocab=40)))
    assert check_dense_gradients(cfg, tied=tied, n_probe=100) < 1e-5
