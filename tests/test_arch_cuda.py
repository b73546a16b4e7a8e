"""The new architecture options on the CUDA backend (numba's simulator without a GPU; gemma3, which has
every option but the soft-caps, runs by default, qwen3, gemma2, olmo2, smollm3 and granite with --slow):
inference logits and a LoRA training step of micro qwen3 / gemma2 / gemma3 / gemma4 models
(q/k norms, GeGLU, sandwich norms, soft-caps, sliding window, two rope caches)
against the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from checks.arch_reference import all_ranks, lora_setup, write_arch_model
from conftest import tiny_config
from test_cuda_e2e import cuda  # noqa: F401  (the fixture: the CUDA backend, or a skip)

pytestmark = pytest.mark.cuda

MICRO = dict(n_embd=16, n_ff=24, n_head=2, n_head_kv=1, head_dim=6, n_rot=6, n_layer=2, n_vocab=40)   # ids < 40 only
CONFIGS = {
    "qwen3": dict(MICRO),
    "gemma2": dict(MICRO, attn_softcap=1.5, final_softcap=2.5, sliding_window=3, swa_pattern=2),
    "gemma3": dict(MICRO, sliding_window=3, swa_pattern=2, rope_freq_base=1e6, rope_freq_scale=0.5,
                   rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0),
    "olmo2": dict(MICRO, head_dim=8, n_rot=8),        # n_head * head_dim = n_embd, as llama.cpp's olmo2
    "smollm3": dict(MICRO, n_layer=4, nope_step=4),
    "granite": dict(MICRO, embd_multiplier=12.0, attn_scale=0.0625, residual_scale=0.375, logit_scale=8.0),
    "gemma4": dict(MICRO, n_layer=4, sliding_window=3, swa_pattern=2, rope_freq_base=1e6, rope_freq_base_swa=10000.0,
                   rope_freq_scale_swa=1.0, attn_scale=1.0, final_softcap=2.5),     # the value norm, output scales
    # Gemma-4-E4B's features: heads of 8 / 6, kv heads and widths per layer, the last two
    # layers sharing the first two's keys and values, per-layer inputs of 4
    "gemma4-e4b": dict(MICRO, n_layer=4, sliding_window=3, swa_pattern=2, rope_freq_base=1e6,
                       rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0, attn_scale=1.0, final_softcap=2.5,
                       head_dim=8, n_rot=8, head_dim_swa=6, n_rot_swa=6, n_head_kv=2, n_head_kv_layers=(2, 1, 2, 1),
                       n_ff=32, n_ff_layers=(24, 24, 32, 32), n_kv_shared=2, n_embd_per_layer=4),
}


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) for a in CONFIGS if a != "gemma3"] + ["gemma3"])
def test_logits_and_training_step_match_cpu(cuda, arch, tmp_path, tiny_vocab):
    from llamatune.backend import cpu
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    cfg = tiny_config(arch.removesuffix("-e4b"), **CONFIGS[arch])
    model = Model(write_arch_model(tmp_path / "m.gguf", cfg, tiny_vocab, seed=1))
    cfg = model.config
    tokens = np.array([[1, 5, 9, 33, 7, 2]])           # 6 tokens: the window of 3 matters
    want = Runner(model).forward(tokens)
    np.testing.assert_allclose(cuda.to_host(Runner(model, backend=cuda).forward(tokens)), want, rtol=1e-4, atol=1e-5)

    rng = np.random.default_rng(0)
    inputs, labels = rng.integers(0, cfg.n_vocab, (1, 6)), rng.integers(0, cfg.n_vocab, (1, 6))
    w = np.full((1, 6), 1 / 6, np.float32)
    tied = model.weights.output is model.weights.token_embd
    results = []
    for backend in (cpu(), cuda):
        targets, params = lora_setup(model, all_ranks(cfg, tied), np.float32)
        if backend is not cpu():
            params.to_device(backend)
        g = StepExecutor(cfg, FrozenBase(model, backend), params, targets, 1, 6, "selective", backend=backend)
        results.append((g.step(inputs, labels, w), params.host(params.grad).copy()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    # gemma4: one more float32 norm (the values') whose sums the device orders its own way
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-3, atol=3e-6 if arch.startswith("gemma4") else 1e-6)
