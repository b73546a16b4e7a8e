"""gemma, gemma2, gemma3: tensors and metadata as llama.cpp's converter writes them,
hyperparameters as llama.cpp reads them, the forward of infer.py and step.py against
an independent numpy forward (embedding scale, GeGLU, sandwich norms, q/k norms,
soft-capping, sliding windows, per-layer rope), LoRA gradients on every kind by finite
differences, checkpointing modes bit-identical, dense gradients."""
from __future__ import annotations

import numpy as np
import pytest

from checks.arch_reference import (Block, all_ranks, check_dense_gradients, check_forward, check_lora_gradients,
                            check_modes_identical, write_arch_model)
from conftest import tiny_config
from llamatune.errors import LlamatuneError
from llamatune.models.arch import NEOX
from llamatune.models.config import ModelConfig
from llamatune.models.model import Model

SHAPE = dict(n_embd=32, n_ff=48, n_head=4, n_head_kv=2, head_dim=12, n_rot=12)
# tiny versions: caps low enough to bite, a window of 3 over 6-7 tokens
CONFIGS = {
    "gemma": dict(SHAPE),
    "gemma2": dict(SHAPE, n_layer=3, attn_softcap=1.5, final_softcap=2.5, sliding_window=3, swa_pattern=2),
    "gemma3": dict(SHAPE, n_layer=3, sliding_window=3, swa_pattern=3, rope_freq_base=1e6, rope_freq_scale=0.5,
                   rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0),
}
LOCAL, GLOBAL3 = (10000.0, 1.0), (1e6, 0.5)
BLOCKS = {
    "gemma": Block(rope_neox=True, gelu=True, embd_scale=True),
    "gemma2": Block(rope_neox=True, gelu=True, embd_scale=True, post_norms=True, attn_softcap=1.5,
                    final_softcap=2.5, swa=(True, False, True), window=3),
    "gemma3": Block(rope_neox=True, gelu=True, embd_scale=True, post_norms=True, qk_norm=True,
                    swa=(True, True, False), window=3, rope=(LOCAL, LOCAL, GLOBAL3)),
}
ARCHS = tuple(CONFIGS)
TIED = {"gemma": True, "gemma2": True, "gemma3": False}   # gemma3 may carry its own output tensor


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory, tiny_vocab):
    arch = request.param
    cfg = tiny_config(arch, **CONFIGS[arch])
    return Model(write_arch_model(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", cfg, tiny_vocab, seed=5,
                                  tied=TIED[arch]))


# ------------------------------------------------------------------ declarations and metadata
def test_declarations():
    from llamatune.models.arch import get_arch
    gemma, gemma2, gemma3 = (get_arch(a) for a in ARCHS)
    for spec in (gemma, gemma2, gemma3):
        assert spec.rope_mode == NEOX and spec.activation == "gelu" and spec.embd_scale and spec.biases == ()
    assert gemma.tied and gemma2.tied and not gemma3.tied
    assert not gemma.post_norms and gemma2.post_norms and gemma3.post_norms
    assert not gemma.qk_norm and not gemma2.qk_norm and gemma3.qk_norm
    assert gemma3.norms == ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm",
                            "post_ffw_norm")


# what llama.cpp's convert_hf_to_gguf.py (conversion/gemma.py) writes, per arch
CONVERTER_KEYS = {
    "gemma": ["context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
              "attention.value_length"],
}
CONVERTER_KEYS["gemma2"] = CONVERTER_KEYS["gemma"] + ["attn_logit_softcapping", "final_logit_softcapping",
                                                      "attention.sliding_window"]
CONVERTER_KEYS["gemma3"] = CONVERTER_KEYS["gemma"] + ["rope.freq_base", "attention.sliding_window"]
LAYER_TENSORS = {   # llama.cpp llama_model_<arch>::load_arch_tensors
    "gemma": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"],
}
LAYER_TENSORS["gemma2"] = LAYER_TENSORS["gemma"] + ["post_attention_norm", "post_ffw_norm"]
LAYER_TENSORS["gemma3"] = LAYER_TENSORS["gemma2"] + ["attn_q_norm", "attn_k_norm"]


def test_tensors_and_metadata_as_llama_cpp(model):
    arch = model.config.arch
    md, tensors = model.file.metadata, model.file.tensors
    assert md["general.architecture"] == arch
    assert not [k for k in CONVERTER_KEYS[arch] if f"{arch}.{k}" not in md]
    assert sorted(n for n in tensors if n.startswith("blk.1.")) == sorted(f"blk.1.{k}.weight"
                                                                           for k in LAYER_TENSORS[arch])
    assert ("output.weight" in tensors) == (not TIED[arch])
    assert tensors["blk.0.attn_q.weight"].shape == (48, 32) and tensors["blk.0.attn_output.weight"].shape == (32, 48)
    if arch == "gemma3":
        assert tensors["blk.0.attn_k_norm.weight"].shape == (12,)
    # read back: the same config (soft-caps, window, pattern, local rope)
    want = tiny_config(arch, **CONFIGS[arch])
    got = model.config
    for f in ("attn_softcap", "final_softcap", "sliding_window", "swa_pattern", "rope_freq_base",
              "rope_freq_scale", "head_dim"):
        assert getattr(got, f) == getattr(want, f), f
    assert [got.window(i) for i in range(got.n_layer)] == [3 * s for s in BLOCKS[arch].swa or [0, 0]]


def _md(arch, **extra):
    md = {"general.architecture": arch, f"{arch}.context_length": 64, f"{arch}.embedding_length": 32,
          f"{arch}.block_count": 8, f"{arch}.feed_forward_length": 48, f"{arch}.attention.head_count": 4,
          f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 16,
          f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": 50}
    return md | {f"{arch}.{k}": v for k, v in extra.items()}


def test_hparams_as_llama_cpp_reads_them():
    # gemma2: llama.cpp's defaults when the keys are absent, set_swa_pattern(2): even layers slide
    c = ModelConfig.from_metadata(_md("gemma2"))
    assert (c.attn_softcap, c.final_softcap, c.sliding_window, c.swa_pattern) == (50.0, 30.0, 4096, 2)
    assert [c.is_swa(i) for i in range(4)] == [True, False, True, False]
    assert c.attention_options(0) == dict(scale=None, softcap=50.0, window=4096)
    assert c.rope_params(0) == c.rope_params(1) == (10000.0, 1.0) and len(c.rope_sets) == 1
    # the 46-layer (27B) gemma2: scale 1/sqrt(n_embd / n_head), integer division
    big = ModelConfig.from_metadata(_md("gemma2", block_count=46, embedding_length=4608, **{"attention.head_count": 32}))
    assert big.attn_scale == np.float32(1 / np.sqrt(144))
    # gemma3: 5:1 pattern, local layers at base 10000 without the linear scaling of the global ones
    c = ModelConfig.from_metadata(_md("gemma3", **{"attention.sliding_window": 512, "rope.freq_base": 1e6,
                                                   "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    assert [c.is_swa(i) for i in range(8)] == [True] * 5 + [False] + [True] * 2
    assert c.rope_params(0) == (10000.0, 1.0) and c.rope_params(5) == (1e6, 0.125)
    assert c.rope_sets == [(10000.0, 1.0), (1e6, 0.125)] and c.rope_set(5) == 1
    assert c.attn_softcap == 0 and c.final_softcap == 0
    # gemma3 without a window: every layer global, one rope
    c = ModelConfig.from_metadata(_md("gemma3"))
    assert c.sliding_window == 0 and len(c.rope_sets) == 1 and c.window(0) == 0
    # metadata round trip
    for arch in ARCHS:
        cfg = tiny_config(arch, **CONFIGS[arch])
        md = {"general.architecture": arch, **cfg.metadata()}
        assert ModelConfig.from_metadata(md) == cfg


def test_unsupported_hparams_are_refused_by_name():
    with pytest.raises(LlamatuneError, match=r"m\.gguf: rope scaling type 'longrope' is not supported \(only linear "
                                             r"and yarn\)"):
        ModelConfig.from_metadata(_md("gemma3", **{"rope.scaling.type": "longrope", "rope.scaling.factor": 8.0}),
                                  "m.gguf")
    with pytest.raises(LlamatuneError, match=r"m\.gguf: metadata key 'gemma2\.attention\.sliding_window_pattern' "
                                             r"is a per-layer array"):
        ModelConfig.from_metadata(_md("gemma2", **{"attention.sliding_window_pattern": [True, False]}), "m.gguf")
    with pytest.raises(LlamatuneError, match=r"m\.gguf: metadata key 'gemma2\.attn_logit_softcapping' is -1"):
        ModelConfig.from_metadata(_md("gemma2", attn_logit_softcapping=-1.0), "m.gguf")
    from llamatune.train.lora import lora_targets
    with pytest.raises(LlamatuneError, match="a gemma model has no attn_q_norm tensors: their LoRA rank must be 0"):
        lora_targets(tiny_config("gemma", **SHAPE), {"attn_q": 2, "attn_q_norm": 2}, 2.0, tied=True)


def test_tied_architectures_never_write_or_read_an_output_tensor(tmp_path, tiny_vocab):
    from llamatune.models.writer import random_weights, tensor_names, write_model
    cfg = tiny_config("gemma", **SHAPE)
    assert "output.weight" not in tensor_names(cfg)
    w = random_weights(cfg) | {"output.weight": np.ones((cfg.n_vocab, cfg.n_embd), np.float32)}
    write_model(tmp_path / "g.gguf", cfg, w, tiny_vocab)
    m = Model(tmp_path / "g.gguf")
    assert "output.weight" not in m.file.tensors and m.weights.output is m.weights.token_embd


# ------------------------------------------------------------------ forward and gradients
def test_forward_matches_numpy(model):
    check_forward(model, BLOCKS[model.config.arch])


def test_lora_gradients_every_kind(model):
    cfg = model.config
    ranks = all_ranks(cfg, tied=TIED[cfg.arch])
    assert set(cfg.spec.norms) <= set(ranks)
    assert check_lora_gradients(model, ranks, "selective", n_probe=150) < 1e-5


def test_lora_gradients_packed_rows_layer_mode(model):
    """Packed rows: the sliding window counts within each sample."""
    cfg = model.config
    assert check_lora_gradients(model, all_ranks(cfg, tied=TIED[cfg.arch]), "layer", n_probe=60, packed=True) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_modes_identical(model, dtype):
    cfg = model.config
    check_modes_identical(model, all_ranks(cfg, tied=TIED[cfg.arch]), dtype, packed=dtype == np.float64)


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_gradients(arch):
    small = dict(n_embd=16, n_ff=24, n_head=2, n_head_kv=1, head_dim=6, n_rot=6, n_vocab=40)
    cfg = tiny_config(arch, **(CONFIGS[arch] | small))
    assert check_dense_gradients(cfg, tied=TIED[arch], n_probe=100) < 1e-5


def test_packed_rows_equal_samples_alone(model):
    """Two samples packed in one row give the per-token losses they give alone: rope
    positions (both rope caches) restart, attention (sliding window included) stays in each."""
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.params import ParamBuffer
    cfg = model.config
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, cfg.n_vocab, 5), rng.integers(0, cfg.n_vocab, 6)
    ta, tb = rng.integers(0, cfg.n_vocab, 5), rng.integers(0, cfg.n_vocab, 6)
    alone = []
    for x, t in ((a, ta), (b, tb)):
        g = StepExecutor(cfg, FrozenBase(model), ParamBuffer([], np.float64), [], 1, len(x), dtype=np.float64)
        g.loss(x[None], t[None], np.ones((1, len(x))))
        alone.append(g.losses.copy())
    g = StepExecutor(cfg, FrozenBase(model), ParamBuffer([], np.float64), [], 1, 11, dtype=np.float64)
    g.loss(np.concatenate([a, b])[None], np.concatenate([ta, tb])[None], np.ones((1, 11)),
           positions=np.concatenate([np.arange(5), np.arange(6)])[None], segments=np.array([[0] * 5 + [1] * 6]))
    np.testing.assert_allclose(g.losses, np.concatenate(alone), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3", "qwen3"])
def test_new_model_of_a_family_round_trips(arch, tmp_path, tiny_vocab):
    """ModelConfig.new (train-from-scratch) gives the family's defaults, and the file the
    writer makes of it reads back as the same config."""
    from llamatune.models.writer import random_weights, write_model
    cfg = ModelConfig.new(arch, n_vocab=400, n_ctx_train=64, n_embd=32, n_layer=2, n_ff=64, n_head=4,
                          n_head_kv=2, head_dim=8, n_rot=8, norm_eps=1e-6)
    write_model(tmp_path / "m.gguf", cfg, random_weights(cfg), tiny_vocab)
    assert Model(tmp_path / "m.gguf").config == cfg
    if arch == "gemma2":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window, cfg.swa_pattern) == (50.0, 30.0, 4096, 2)
    if arch == "gemma3":
        assert cfg.rope_params(0) == (10000.0, 1.0) and cfg.rope_params(5) == (1e6, 1.0)
