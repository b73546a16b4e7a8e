"""A model's rope tables: which frequency factors and which attention factor apply.

Mirrors what llama.cpp passes to ggml_rope_ext (kernels/rope.py computes the angles):
  - frequency factors (theta_i /= f_i): Llama 3.1's `rope_freqs`; else Phi-3's su/longrope
    `rope_factors_long` when the context is longer than `rope.scaling.original_context_length`
    and `rope_factors_short` otherwise (llama_model::get_rope_factors, by n_ctx_seq). llama.cpp
    pads the context it is given to a multiple of 256 (llama_context: n_ctx_seq =
    GGML_PAD(n_ctx, 256)) before that comparison, and so does `context_size` here: with a
    Phi-3.5 (original context 4096), -c 4096 rotates with the short factors, -c 4097 (4352)
    with the long ones;
  - `rope.scaling.attn_factor`: ggml's rope_yarn returns cosf(theta) * mscale and
    sinf(theta) * mscale, so the rotated dimensions of q and k are scaled by it (the
    pass-through dimensions are not). The float32 tables are multiplied once, here.
"""
from __future__ import annotations

import numpy as np

from ..kernels import rope as host_rope
from ..kernels import rope_yarn


CONTEXT_PAD = 256     # llama_context rounds n_ctx_seq up to a multiple of this


def context_size(n_ctx: int) -> int:
    """The context size llama.cpp works with when asked for n_ctx tokens (-c)."""
    return -(-n_ctx // CONTEXT_PAD) * CONTEXT_PAD


def rope_factors(cfg, weights, n_ctx: int) -> np.ndarray | None:
    """The (n_rot/2,) f32 frequency factors for a context of n_ctx tokens, or None."""
    if weights.rope_freqs is not None:
        return weights.rope_freqs
    if weights.rope_long is None:
        return None
    return weights.rope_long if context_size(n_ctx) > cfg.n_ctx_orig_rope else weights.rope_short


def rope_cache(cfg, weights, positions: np.ndarray, n_ctx: int,
               rope: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (len(positions), n_rot/2) f32 for int64 positions in a context of n_ctx tokens;
    `weights` holds the model's factor vectors (rope_freqs, rope_long, rope_short); `rope` is a
    layer's (freq_base, freq_scale[, n_rot]) (ModelConfig.rope_sets), by default the model's."""
    freq_base, freq_scale = (rope or (cfg.rope_freq_base, cfg.rope_freq_scale))[:2]
    n_rot = cfg.n_rot if rope is None else cfg.rope_rot(rope)     # gemma4: the set's own
    cos = np.empty((positions.shape[0], n_rot // 2), np.float32)
    sin = np.empty_like(cos)
    factors = rope_factors(cfg, weights, n_ctx)
    if not cfg.spec.swa_rope_factors and rope is not None and rope not in [
            cfg.rope_params(i) for i in range(cfg.n_layer) if not cfg.is_swa(i)]:
        factors = None        # gemma4: rope_freqs is the full-attention layers' alone
    if cfg.rope_ext_factor:
        rope_yarn.rope_cache_yarn(cos, sin, positions, n_rot, freq_base, freq_scale, cfg.n_ctx_orig_rope,
                                  cfg.rope_ext_factor, rope_yarn.attn_factor(freq_scale, cfg.rope_attn_factor),
                                  factors)
        return cos, sin
    host_rope.rope_cache(cos, sin, positions, n_rot, freq_base, freq_scale, factors)
    if cfg.rope_attn_factor != 1.0:
        cos *= np.float32(cfg.rope_attn_factor)
        sin *= np.float32(cfg.rope_attn_factor)
    return cos, sin
