"""gemma4: Gemma 4 text models (llama.cpp src/models/gemma4.cpp, load_arch_hparams there).

gemma3's block (sqrt(n_embd) embedding scale, GeGLU, per-head q/k RMSNorm, sandwich
norms post_attention_norm / post_ffw_norm, NEOX rope, sliding-window layers with their
own rope base, final-logit soft-capping) with, over gemma3:
  - attention scale 1 (no 1/sqrt(head_dim): the q/k norms carry it);
  - the values RMS-normed per head without a weight (ggml_rms_norm of Vcur);
  - `blk.N.layer_output_scale` (1,): the layer's output (after both residual adds) times it;
  - the full-attention layers' "proportional" rope: NEOX over all of the head with the
    model-level `rope_freqs` factors (1 on the rotated quarter, 1e30 on the rest), the
    sliding-window ones plain rope with `rope.freq_base_swa` and `rope.dimension_count_swa`;
  - the sliding-window layers from a per-layer `attention.sliding_window_pattern` array;
  - norm weights stored as they are (no +1: the converter's norm_shift is 0);
and, in some models, what this declaration refuses in one line naming it: full-attention
heads of another size than the sliding-window ones (`attention.key_length` vs
`key_length_swa`: every released model), per-layer kv head counts, per-layer
feed-forward widths (use_double_wide_mlp), KV shared across the last layers
(`attention.shared_kv_layers`, E2B / E4B), per-layer embeddings
(`embedding_length_per_layer_input`, E2B / E4B), the mixture-of-experts block (26B-A4B:
refused as a mixture of experts by config.py). Vision and audio towers are not read.

The layer is the `gemma4_attention` part (models/parts.py: gemma3's attention with the
value norm) and gemma3's feed-forward; Forward applies the layer output scale
(`Forward.output_scales`) and rope.py gives rope_freqs to the full-attention layers alone
(`Arch.swa_rope_factors`).
"""
from __future__ import annotations

from ...errors import LlamatuneError
from ..arch import NEOX, Arch, block_layer

LAYER = block_layer(qk_norm=True, post_norms=True) + ("layer_output_scale.weight",)
LOCAL_ROPE_BASE = 10000.0   # llama.cpp's rope_freq_base_train_swa default


def _scalar(read, key: str, what: str):
    """A key llama.cpp reads as a scalar or a per-layer array: the scalar, refused when per layer."""
    value = read.raw(key)
    if isinstance(value, list):
        if len(set(value)) > 1:
            raise LlamatuneError(f"{read.source}: {read.arch} with {what} ('{read.arch}.{key}' per layer) is not "
                                 "supported yet")
        return value[0] if value else None
    return value


def _swa_pattern(read, n_layer: int) -> int:
    """The per-layer sliding flags as llama.cpp's set_swa_pattern(n) period (layer i slides
    iff i % n < n - 1), refused when they have none."""
    flags = read.raw("attention.sliding_window_pattern")
    if not isinstance(flags, list) or len(flags) != n_layer:
        raise LlamatuneError(f"{read.source}: metadata key '{read.arch}.attention.sliding_window_pattern' must be "
                             f"a list of {n_layer} booleans (one per layer)")
    for n in range(1, n_layer + 1):
        if all(bool(f) == (i % n < n - 1) for i, f in enumerate(flags)):
            return n
    raise LlamatuneError(f"{read.source}: {read.arch}'s sliding-window layers {[int(bool(f)) for f in flags]} have "
                         "no period n (layer i sliding iff i % n < n - 1), which is not supported yet")


def _refuse_extras(read) -> None:
    """One line naming what a gemma4 file has that is not supported yet."""
    missing = []
    if read.raw("embedding_length_per_layer_input", 0):
        missing.append("per-layer embeddings (embedding_length_per_layer_input)")
    if read.raw("attention.shared_kv_layers", 0):
        missing.append("KV shared across layers (attention.shared_kv_layers)")
    head, head_swa = read.raw("attention.key_length"), read.raw("attention.key_length_swa")
    if head_swa is not None and head_swa != head:
        missing.append(f"full-attention heads of {head} and sliding-window heads of {head_swa} "
                       "(attention.key_length, key_length_swa)")
    rot, rot_swa = read.raw("rope.dimension_count"), read.raw("rope.dimension_count_swa")
    if rot_swa is not None and rot_swa != rot:
        missing.append(f"sliding-window layers rotating {rot_swa} of {rot} dimensions (rope.dimension_count_swa)")
    if missing:
        raise LlamatuneError(f"{read.source}: {read.arch} with {'; '.join(missing)} is not supported yet")


def read_hparams(read) -> dict:
    _refuse_extras(read)
    ff = read.raw("feed_forward_length")
    values = dict(n_ff=int(_scalar(read, "feed_forward_length", "feed-forward widths")) if isinstance(ff, list)
                  else read.count("feed_forward_length"),
                  attn_scale=1.0, rope_freq_base_swa=read.number("rope.freq_base_swa", LOCAL_ROPE_BASE),
                  rope_freq_scale_swa=1.0, sliding_window=read.count("attention.sliding_window"),
                  swa_pattern=_swa_pattern(read, read.count("block_count")))
    if isinstance(read.raw("attention.head_count_kv"), list):     # one count for every layer
        values["n_head_kv"] = int(_scalar(read, "attention.head_count_kv", "kv head counts"))
    if read.raw("final_logit_softcapping"):
        values["final_softcap"] = read.number("final_logit_softcapping")
    return values


def hparams_metadata(cfg) -> dict:
    a = cfg.arch
    md = {f"{a}.attention.sliding_window": cfg.sliding_window,
          f"{a}.attention.sliding_window_pattern": [i % cfg.swa_pattern < cfg.swa_pattern - 1
                                                    for i in range(cfg.n_layer)],
          f"{a}.rope.freq_base_swa": cfg.rope_freq_base_swa, f"{a}.attention.key_length_swa": cfg.head_dim,
          f"{a}.attention.value_length_swa": cfg.head_dim, f"{a}.rope.dimension_count_swa": cfg.n_rot}
    if cfg.final_softcap:
        md[f"{a}.final_logit_softcapping"] = cfg.final_softcap
    return md


ARCH = Arch(name="gemma4", rope_mode=NEOX, layer=LAYER, activation="gelu", embd_scale=True,
            read_hparams=read_hparams, hparams_metadata=hparams_metadata, mixer="gemma4_attention",
            swa_rope_factors=False,
            vectors=("layer_output_scale.weight",), shapes=lambda cfg: {"layer_output_scale.weight": (1,)},
            scratch=False)
