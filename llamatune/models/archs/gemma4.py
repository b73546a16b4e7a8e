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
and what the released E2B / E4B text models add (llama.cpp's per-layer hparams):
  - full-attention heads of another size than the sliding-window ones (`attention.key_length`
    512 vs `key_length_swa` 256, `rope.dimension_count_swa`): ModelConfig.head_dim_swa, n_rot_swa;
  - per-layer kv head counts and feed-forward widths (`attention.head_count_kv`,
    `feed_forward_length` arrays; use_double_wide_mlp): n_head_kv_layers, n_ff_layers, the
    model-level values the widest layer's (ModelConfig.layer gives each layer's);
  - keys and values shared by the last `attention.shared_kv_layers` layers (no attn_k, attn_v,
    attn_k_norm of their own): each attends over those of the last earlier layer of its kind
    (ModelConfig.kv_source), which keeps them for it and adds their gradients to its own;
  - per-layer embeddings (`embedding_length_per_layer_input` P): the model-level
    per_layer_token_embd (V, L P, frozen, read row by row), per_layer_model_proj (L P, C)
    and per_layer_proj_norm (P,) make each layer's input e_i (Forward.per_layer_embed), and
    each layer ends with the `per_layer_input` part (inp_gate, proj, post_norm).
And the larger models' attention_k_eq_v (31B): full-attention layers without attn_v,
their values the keys' projection before its norm (ModelConfig.k_eq_v, told by the
missing tensors as llama.cpp tells it). Refused in one line naming it: value heads of
another size than the key heads, the mixture-of-experts block (26B-A4B: refused as a
mixture of experts by config.py). Vision and audio towers are not read.

The layer is the `gemma4_attention` part (models/parts.py: gemma3's attention with the
value norm) and gemma3's feed-forward; Forward applies the layer output scale
(`Forward.output_scales`) and rope.py gives rope_freqs to the full-attention layers alone
(`Arch.swa_rope_factors`).
"""
from __future__ import annotations

from ...errors import LlamatuneError
from ..arch import NEOX, Arch, block_layer

LAYER = block_layer(qk_norm=True, post_norms=True) + ("layer_output_scale.weight",)
KV_KINDS = ("attn_k", "attn_v", "attn_k_norm")          # what a layer sharing another's K/V lacks
PER_LAYER = ("inp_gate", "proj", "post_norm")           # a layer's per-layer embedding tensors
LOCAL_ROPE_BASE = 10000.0   # llama.cpp's rope_freq_base_train_swa default


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


def _per_layer(read, key: str, n_layer: int) -> list[int] | None:
    """A count llama.cpp reads with get_key_or_arr: one per layer (a list of n_layer
    positive integers) or None where the file holds one for every layer."""
    value = read.raw(key)
    if not isinstance(value, list):
        return None
    if len(value) != n_layer or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise LlamatuneError(f"{read.source}: metadata key '{read.arch}.{key}' must be a list of {n_layer} positive "
                             "integers (one per layer)")
    return value


def _count(read, key: str, default: int = 0) -> int:
    """A count >= 0 that may be absent (default)."""
    value = read.raw(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LlamatuneError(f"{read.source}: metadata key '{read.arch}.{key}' is {value!r}, expected a count >= 0")
    return value


def _head_sizes(read) -> dict:
    """The full-attention layers' head size and rotated dimensions are the model's; the
    sliding-window layers' (key_length_swa, dimension_count_swa) where they differ."""
    head, head_swa = read.raw("attention.key_length"), read.raw("attention.key_length_swa")
    for key, swa in (("value_length", "value_length_swa"),):
        if read.raw(f"attention.{key}", head) != head or read.raw(f"attention.{swa}", head_swa) != head_swa:
            raise LlamatuneError(f"{read.source}: {read.arch} with value heads of another size than the key heads "
                                 "(attention.value_length) is not supported (llama.cpp refuses it too)")
    rot, rot_swa = read.raw("rope.dimension_count", head), read.raw("rope.dimension_count_swa")
    values = {}
    if head_swa is not None and head_swa != head:
        values["head_dim_swa"] = _count(read, "attention.key_length_swa")
    if rot_swa is not None and rot_swa != rot:
        values["n_rot_swa"] = _count(read, "rope.dimension_count_swa")
    return values


def read_hparams(read) -> dict:
    n_layer = read.count("block_count")
    values = dict(attn_scale=1.0, rope_freq_base_swa=read.number("rope.freq_base_swa", LOCAL_ROPE_BASE),
                  rope_freq_scale_swa=1.0, sliding_window=read.count("attention.sliding_window"),
                  swa_pattern=_swa_pattern(read, n_layer), n_kv_shared=_count(read, "attention.shared_kv_layers"),
                  n_embd_per_layer=_count(read, "embedding_length_per_layer_input")) | _head_sizes(read)
    for key, field, model in (("feed_forward_length", "n_ff_layers", "n_ff"),
                              ("attention.head_count_kv", "n_head_kv_layers", "n_head_kv")):
        counts = _per_layer(read, key, n_layer)     # the model's: the widest layer's (shared buffers)
        if counts is not None:
            values[model] = max(counts)
            if len(set(counts)) > 1:
                values[field] = tuple(counts)
    if read.raw("final_logit_softcapping"):
        values["final_softcap"] = read.number("final_logit_softcapping")
    flags = read.raw("attention.sliding_window_pattern")
    if any(f"blk.{i}.attn_k.weight" in read.tensors and f"blk.{i}.attn_v.weight" not in read.tensors
           for i in range(n_layer) if not flags[i]):
        values["k_eq_v"] = True       # llama.cpp: `Vcur = wv ? wv cur : Kcur` (use_alternative_attention)
    return values


def hparams_metadata(cfg) -> dict:
    a = cfg.arch
    md = {f"{a}.attention.sliding_window": cfg.sliding_window,
          f"{a}.attention.sliding_window_pattern": [i % cfg.swa_pattern < cfg.swa_pattern - 1
                                                    for i in range(cfg.n_layer)],
          f"{a}.rope.freq_base_swa": cfg.rope_freq_base_swa,
          f"{a}.attention.key_length_swa": cfg.head_dim_swa or cfg.head_dim,
          f"{a}.attention.value_length_swa": cfg.head_dim_swa or cfg.head_dim,
          f"{a}.rope.dimension_count_swa": cfg.n_rot_swa or cfg.n_rot}
    if cfg.n_ff_layers:
        md[f"{a}.feed_forward_length"] = list(cfg.n_ff_layers)
    if cfg.n_head_kv_layers:
        md[f"{a}.attention.head_count_kv"] = list(cfg.n_head_kv_layers)
    if cfg.n_kv_shared:
        md[f"{a}.attention.shared_kv_layers"] = cfg.n_kv_shared
    if cfg.n_embd_per_layer:
        md[f"{a}.embedding_length_per_layer_input"] = cfg.n_embd_per_layer
    if cfg.final_softcap:
        md[f"{a}.final_logit_softcapping"] = cfg.final_softcap
    return md


def layer_kinds(cfg, i: int) -> tuple[str, ...]:
    """Layer i's tensors: a layer sharing an earlier one's keys and values has no attn_k,
    attn_v, attn_k_norm; with per-layer embeddings each layer adds inp_gate, proj, post_norm."""
    kinds = LAYER if cfg.has_kv(i) else tuple(k for k in LAYER if k not in KV_KINDS)
    if not cfg.has_v(i):                                    # attention_k_eq_v: the keys' projection
        kinds = tuple(k for k in kinds if k != "attn_v")
    return kinds + (PER_LAYER if cfg.n_embd_per_layer else ())


def shapes(cfg) -> dict:
    P = cfg.n_embd_per_layer
    return {"layer_output_scale.weight": (1,), "inp_gate": (P, cfg.n_embd), "proj": (cfg.n_embd, P),
            "post_norm": (cfg.n_embd,)}


def parts(cfg, i: int) -> tuple[str, ...]:
    """gemma4's attention, gemma3's feed-forward, and with per-layer embeddings the part
    that adds them (models/parts.PerLayerInput)."""
    return ("gemma4_attention", "feed_forward") + (("per_layer_input",) if cfg.n_embd_per_layer else ())


def model_tensors(cfg) -> dict:
    """The per-layer embeddings' model-level tensors (llama.cpp's per_layer_tok_embd, read
    row by row as token_embd; per_layer_model_proj; per_layer_proj_norm), none without."""
    LP = cfg.n_layer * cfg.n_embd_per_layer
    if not LP:
        return {}
    return {"per_layer_token_embd.weight": (cfg.n_vocab, LP), "per_layer_model_proj.weight": (LP, cfg.n_embd),
            "per_layer_proj_norm.weight": (cfg.n_embd_per_layer,)}


ARCH = Arch(name="gemma4", rope_mode=NEOX, activation="gelu", embd_scale=True,
            read_hparams=read_hparams, hparams_metadata=hparams_metadata, mixer="gemma4_attention",
            swa_rope_factors=False, vectors=("layer_output_scale.weight",), shapes=shapes, scratch=False,
            layer=LAYER + PER_LAYER, layer_kinds=layer_kinds, model_tensors=model_tensors, parts=parts,
            peft_modules=Arch.peft_modules + (("inp_gate", "per_layer_input_gate"), ("proj", "per_layer_projection")))
