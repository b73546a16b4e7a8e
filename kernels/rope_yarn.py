"""YaRN rope tables (gpt-oss), as ggml computes them: `ggml_rope_cache_init` with
`rope_yarn` and ext_factor != 0 (ggml-cpu ops.cpp), in float32.

For rotated pair i (i0 = 2 i) of a position p, theta_extrap = p * base^(-2 i / n_rot) / ff_i
(ggml's running product theta *= theta_scale, theta_scale = powf(base, -2.0f/n_rot); ff the
frequency factors, rope_freqs, else 1),
theta_interp = freq_scale * theta_extrap and

    ramp = 1 - clamp((i - low) / max(0.001, high - low), 0, 1)     (rope_yarn_ramp, i0/2 = i)
    mix  = ramp * ext_factor
    theta = theta_interp (1 - mix) + theta_extrap mix
    cos, sin = cosf(theta) * m, sinf(theta) * m,   m = attn_factor * (1 + 0.1 logf(1 / freq_scale))

with (low, high) = ggml_rope_yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast,
beta_slow): floorf / ceilf of n_rot * logf(n_ctx_orig / (beta * 2 pi)) / (2 logf(base)),
clamped to [0, n_rot - 1]. llama.cpp's context (llama_context's constructor) sets, for a
file whose rope.scaling.type is yarn, ext_factor 1 and attn_factor =
get_mscale(factor) / (1 + 0.1 logf(factor)) * rope.scaling.attn_factor, factor =
1 / freq_scale, get_mscale(s) = 0.1 logf(s) + 1 (1 for s <= 1): the magnitude left is
get_mscale(factor) times the file's attn_factor, HF's `attention_factor`. beta_fast 32
and beta_slow 1 are llama_hparams' defaults (gpt-oss reads no other). The rotation
itself is kernels/rope.py's, on these tables.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._checks import check_array

BETA_FAST, BETA_SLOW = 32.0, 1.0      # llama_hparams yarn_beta_fast / yarn_beta_slow


def corr_dims(n_rot: int, n_ctx_orig: int, freq_base: float, beta_fast: float = BETA_FAST,
              beta_slow: float = BETA_SLOW) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims in float32: (low, high) pair indices of the ramp."""
    f32 = np.float32

    def dim(rot):
        return f32(n_rot) * f32(math.log(f32(n_ctx_orig) / (f32(rot) * f32(2) * f32(math.pi)))) \
            / (f32(2) * f32(math.log(f32(freq_base))))
    return float(max(f32(0), f32(math.floor(dim(beta_fast))))), \
        float(min(f32(n_rot - 1), f32(math.ceil(dim(beta_slow)))))


def attn_factor(freq_scale: float, file_attn_factor: float = 1.0) -> float:
    """llama_context's yarn_attn_factor for a yarn file (ext_factor 1), float32 steps."""
    f32 = np.float32
    factor = f32(1) / f32(freq_scale)
    mscale = f32(1) if factor <= 1 else f32(0.1) * f32(math.log(factor)) + f32(1)
    mscale = mscale * (f32(1) / (f32(1) + f32(0.1) * f32(math.log(factor))))
    return float(mscale * f32(file_attn_factor))


@njit(cache=True)
def _yarn_cache_kernel(cos, sin, positions, n_rot, freq_base, freq_scale, freq_factors, low, high, ext_factor,
                       mscale):
    # every operation float32, in ggml's order
    theta_scale = freq_base ** (np.float32(-2.0) / np.float32(n_rot))
    one = np.float32(1.0)
    m = mscale
    if ext_factor != 0:
        m = mscale * (one + np.float32(0.1) * np.log(one / freq_scale))
    T, n_pairs = cos.shape
    for t in range(T):
        theta = np.float32(positions[t])
        for i in range(n_pairs):
            extrap = theta / freq_factors[i]
            interp = freq_scale * extrap
            angle = interp
            if ext_factor != 0:
                y = (np.float32(i) - low) / max(np.float32(0.001), high - low)
                mix = (one - min(one, max(np.float32(0), y))) * ext_factor
                angle = interp * (one - mix) + extrap * mix
            cos[t, i] = np.cos(angle) * m
            sin[t, i] = np.sin(angle) * m
            theta = theta * theta_scale


def rope_cache_yarn(cos, sin, positions, n_rot, freq_base, freq_scale, n_ctx_orig, ext_factor, attn,
                    freq_factors=None):
    """Fill cos, sin (T, n_rot//2) float32 for positions (T,) int64: YaRN tables with the
    magnitude attn (`attn_factor`) and the ramp of ggml_rope_yarn_corr_dims; freq_factors
    None or float32 (n_rot//2,) as kernels/rope.py's."""
    shape = (positions.shape[0], n_rot // 2)
    check_array("rope_yarn", "positions", positions, shape[:1], np.int64)
    check_array("rope_yarn", "cos", cos, shape, np.float32)
    check_array("rope_yarn", "sin", sin, shape, np.float32)
    if freq_factors is None:
        freq_factors = np.ones(shape[1], np.float32)    # theta / 1.0f == theta exactly
    check_array("rope_yarn", "freq_factors", freq_factors, shape[1:], np.float32)
    low, high = corr_dims(n_rot, n_ctx_orig, freq_base)
    f32 = np.float32
    _yarn_cache_kernel(cos, sin, positions, n_rot, f32(freq_base), f32(freq_scale), freq_factors, f32(low), f32(high),
                       f32(ext_factor), f32(attn))
