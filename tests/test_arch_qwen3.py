"""qwen3: tensors and metadata as llama.cpp's converter writes them, the forward of
infer.py and step.py against an independent numpy forward, LoRA gradients on every
kind (the per-head q/k norms included) by finite differences, checkpointing modes
bit-identical, and dense (train-from-scratch) gradients."""
from __future__ import annotations

import numpy as np
import pytest

from checks.arch_reference import (Block, all_ranks, check_dense_gradients, check_forward, check_lora_gradients,
                            check_modes_identical, write_arch_model)
from conftest import tiny_config
from llamatune.models.arch import NEOX
from llamatune.models.model import Model

# key_length 12 differs from n_embd / n_head = 8, as Qwen3 models have (128 vs 5120/40)
QWEN3 = dict(n_embd=32, n_ff=48, n_head=4, n_head_kv=2, head_dim=12, n_rot=12, rope_freq_base=1e6)
BLOCK = Block(rope_neox=True, qk_norm=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_vocab):
    cfg = tiny_config("qwen3", **QWEN3)
    return Model(write_arch_model(tmp_path_factory.mktemp("qwen3") / "qwen3.gguf", cfg, tiny_vocab, seed=2))


def test_declaration_tensors_and_metadata_as_llama_cpp(qwen3):
    spec = qwen3.config.spec
    assert spec.rope_mode == NEOX and spec.qk_norm and not spec.post_norms and spec.biases == ()
    assert spec.activation == "silu" and not spec.embd_scale and not spec.tied
    names = [n for n in qwen3.file.tensors if n.startswith("blk.0.")]
    assert sorted(names) == sorted(f"blk.0.{k}.weight" for k in (   # llama.cpp llama_model_qwen3::load_arch_tensors
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
        "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"))
    assert qwen3.file.tensors["blk.0.attn_q_norm.weight"].shape == (12,)
    assert qwen3.file.tensors["blk.0.attn_q.weight"].shape == (48, 32)
    md = qwen3.file.metadata
    assert md["general.architecture"] == "qwen3" and md["qwen3.attention.key_length"] == 12
    assert md["qwen3.attention.value_length"] == 12 and md["qwen3.rope.freq_base"] == 1e6


def test_forward_matches_numpy(qwen3):
    check_forward(qwen3, BLOCK)


def test_lora_gradients_every_kind(qwen3):
    ranks = all_ranks(qwen3.config, tied=False)
    assert {"attn_q_norm", "attn_k_norm", "output", "token_embd"} <= set(ranks)
    assert check_lora_gradients(qwen3, ranks, "layer", n_probe=150) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_modes_identical(qwen3, dtype):
    check_modes_identical(qwen3, all_ranks(qwen3.config, tied=False), dtype, packed=dtype == np.float64)


def test_dense_gradients():
    cfg = tiny_config("qwen3", n_embd=16, n_ff=24, n_head=2, n_head_kv=1, head_dim=6, n_rot=6, n_vocab=40)
    assert check_dense_gradients(cfg, tied=False, n_probe=100) < 1e-5
