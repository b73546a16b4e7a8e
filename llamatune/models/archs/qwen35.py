"""qwen35: Qwen3.5 dense models (llama.cpp src/models/qwen35.cpp and delta-net-base.cpp).

Two kinds of layer, both with `attn_norm` before the mixer and `post_attention_norm`
before the SwiGLU feed-forward (Qwen3.5's post_attention_layernorm is the FFN's input
norm; there is no ffn_norm):

  - gated delta-net layers (`attention.recurrent_layers`, else all but every
    `full_attention_interval`-th, default 4): `attn_qkv` (2 NK DK + NV DV, C) gives
    q | k | v, through the causal convolution `ssm_conv1d` (channels, K) and SiLU;
    `attn_gate` (NV DV, C) the output gate z; `ssm_alpha`, `ssm_beta` (NV, C) the
    decay and write strength, g = ssm_a softplus(alpha + ssm_dt.bias) (ssm_a is
    -exp(A_log): the converter stores it so), beta = sigmoid(b); the gated delta
    rule with l2-normalized q, k (eps = the norm eps) and tiled heads (value head h
    reads q/k head h % NK: the converter reorders HF's grouped value heads);
    `ssm_norm` (DV,) the gated RMS norm (weight as stored: the converter adds no 1
    there); `ssm_out` (C, NV DV);
  - gated full-attention layers: `attn_q` (2 NH HS, C) whose rows are, per head, HS
    query rows then HS gate rows; per-head `attn_q_norm` / `attn_k_norm`; NEOX rope
    on the first `rope.dimension_count` dimensions of each head (multi-rope with
    `rope.dimension_sections`: for text every section has the token's position, the
    same rotation as long as the sections cover every rotated pair); the attention
    output times sigmoid(gate) before `attn_output`.

The norm weights of the file are HF's plus one (the converter adds it), except ssm_norm.
The multi-token-prediction layers the converter appends after the trunk (block_count
includes `nextn_predict_layers` of them) are not read: llama.cpp runs them only as a
draft model; n_layer is the trunk's.
"""
from __future__ import annotations

import numpy as np

from ...errors import LlamatuneError
from ..arch import NEOX, Arch

NORMS = ("attn_norm", "post_attention_norm")
FFN = ("ffn_down", "ffn_gate", "ffn_up")
RECURRENT = ("attn_norm", "ssm_a", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_alpha", "ssm_beta", "attn_qkv",
             "attn_gate", "ssm_norm", "ssm_out") + FFN + ("post_attention_norm",)
ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm") + FFN \
    + ("post_attention_norm",)
VECTORS = ("ssm_a", "ssm_conv1d.weight", "ssm_dt.bias")
INTERVAL = 4            # llama.cpp's full_attn_interval default
SSM_KEYS = ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")


def layer_kinds(cfg, i: int) -> tuple[str, ...]:
    return RECURRENT if cfg.is_recurrent(i) else ATTENTION


def parts(cfg, i: int) -> tuple[str, str]:
    """Layer i's (mixer, feed-forward) part kinds (models/parts.py, models/qwen35_parts.py)."""
    return ("delta_net" if cfg.is_recurrent(i) else "gated_attention"), "feed_forward_post"


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    C, NK, NV, DK = cfg.n_embd, cfg.ssm_group_count, cfg.ssm_time_step_rank, cfg.ssm_state_size
    inner = cfg.ssm_inner_size
    return {"attn_q": (2 * cfg.n_embd_q, C), "attn_qkv": (2 * NK * DK + inner, C), "attn_gate": (inner, C),
            "ssm_alpha": (NV, C), "ssm_beta": (NV, C), "ssm_out": (C, inner), "ssm_norm": (inner // NV,),
            "ssm_a": (NV,), "ssm_dt.bias": (NV,), "ssm_conv1d.weight": (2 * NK * DK + inner, cfg.ssm_conv_kernel),
            "post_attention_norm": (C,)}


def _recurrent_layers(read, n_layer: int) -> tuple[bool, ...]:
    flags = read.raw("attention.recurrent_layers")
    if flags is None:
        n = read.count("full_attention_interval", INTERVAL)
        return tuple((i + 1) % n != 0 for i in range(n_layer))
    if not isinstance(flags, list) or len(flags) != n_layer or not all(isinstance(f, (bool, int)) for f in flags):
        raise LlamatuneError(f"{read.source}: metadata key '{read.arch}.attention.recurrent_layers' must be a list "
                             f"of {n_layer} booleans (one per layer)")
    return tuple(bool(f) for f in flags)


def _mtp_layers(read, n_all: int) -> int:
    """The multi-token-prediction layers at the end of block_count (`nextn_predict_layers`):
    llama.cpp runs them only as a draft model, so they are not read here (n_layer is the trunk)."""
    n = read.raw("nextn_predict_layers", 0)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < n_all:
        raise LlamatuneError(f"{read.source}: metadata key '{read.arch}.nextn_predict_layers' is {n!r}, expected 0 "
                             f"to {n_all - 1} (block_count {n_all} includes them)")
    return n


def _rope_sections(read, n_rot: int) -> tuple[int, ...]:
    """The multi-rope sections, checked to rotate every pair of the n_rot dimensions with
    the token's position (ggml's interleaved mrope: pair i is in section i % 3 when
    i % S < 3 sections[i % 3], S their sum; else it turns by position 0)."""
    sections = read.raw("rope.dimension_sections", [])
    if not isinstance(sections, list) or not all(isinstance(s, int) and s >= 0 for s in sections):
        raise LlamatuneError(f"{read.source}: metadata key '{read.arch}.rope.dimension_sections' must be a list of "
                             "counts")
    sections = (list(sections) + [0, 0, 0, 0])[:4]
    total = sum(sections)
    if total and not all((i % total) < 3 * sections[(i % total) % 3] for i in range(n_rot // 2)):
        raise LlamatuneError(f"{read.source}: rope.dimension_sections {sections} leave some of the "
                             f"{n_rot // 2} rotated pairs at position 0; only text rope is supported")
    return tuple(sections)


def read_hparams(read) -> dict:
    values = {f"ssm_{k}": read.count(f"ssm.{k}") for k in SSM_KEYS}
    NK, NV, DK, inner = (values[f"ssm_{k}"] for k in ("group_count", "time_step_rank", "state_size", "inner_size"))
    if inner % NV or inner // NV != DK or NV % NK:
        raise LlamatuneError(f"{read.source}: ssm.inner_size {inner}, time_step_rank {NV}, group_count {NK}, "
                             f"state_size {DK}: expected inner_size = time_step_rank x state_size (value heads of "
                             "the q/k heads' size, as llama.cpp's qwen35 reads them) and time_step_rank a multiple "
                             "of group_count")
    n_all = read.count("block_count")
    n_layer = n_all - _mtp_layers(read, n_all)
    values["n_layer"] = n_layer
    values["recurrent_layers"] = _recurrent_layers(read, n_all)[:n_layer]
    values["full_attention_interval"] = read.count("full_attention_interval", INTERVAL)
    head_dim = read.count("attention.key_length", read.count("embedding_length") // read.count("attention.head_count"))
    values["rope_sections"] = _rope_sections(read, read.count("rope.dimension_count", head_dim))
    return values


def hparams_metadata(cfg) -> dict:
    a = cfg.arch
    md = {f"{a}.ssm.{k}": getattr(cfg, f"ssm_{k}") for k in SSM_KEYS}
    md[f"{a}.attention.recurrent_layers"] = list(cfg.recurrent_layers)
    md[f"{a}.full_attention_interval"] = cfg.full_attention_interval
    if cfg.rope_sections:
        md[f"{a}.rope.dimension_sections"] = list(cfg.rope_sections)
    return md


REORDERED = {"attn_qkv": "rows", "attn_gate": "rows", "ssm_alpha": "rows", "ssm_beta": "rows", "ssm_out": "cols"}


def peft_orders(cfg) -> dict:
    """The converter's value-head order (conversion/qwen.py _reorder_v_heads): HF keeps a
    delta-net layer's NV value heads grouped by their NK key heads, the GGUF tiled (head j
    of group g at j NK + g), in the rows of in_proj_qkv's v part, in_proj_z, in_proj_a and
    in_proj_b and the columns of out_proj; {kind: None} without the base's config."""
    if cfg is None:
        return dict.fromkeys(REORDERED)
    NK, NV = cfg.ssm_group_count, cfg.ssm_time_step_rank
    if NK == NV:
        return {}

    def tiled(head: int, lead: int = 0):
        v = np.arange(NV * head).reshape(NK, NV // NK, head).transpose(1, 0, 2).reshape(-1)
        return np.concatenate([np.arange(lead), lead + v])
    DV = cfg.ssm_inner_size // NV
    perms = {"attn_qkv": tiled(DV, 2 * NK * cfg.ssm_state_size), "attn_gate": tiled(DV), "ssm_alpha": tiled(1),
             "ssm_beta": tiled(1), "ssm_out": tiled(DV)}
    return {k: (REORDERED[k], p) for k, p in perms.items()}


ARCH = Arch(name="qwen35", rope_mode=NEOX, layer=tuple(dict.fromkeys(RECURRENT + ATTENTION)), read_hparams=read_hparams,
            hparams_metadata=hparams_metadata, layer_kinds=layer_kinds, parts=parts, shapes=shapes, vectors=VECTORS,
            # the delta-net projections' value heads are in the converter's tiled order (peft_orders)
            peft_modules=(("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                          ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
                          ("attn_qkv", "linear_attn.in_proj_qkv"), ("attn_gate", "linear_attn.in_proj_z"),
                          ("ssm_alpha", "linear_attn.in_proj_a"), ("ssm_beta", "linear_attn.in_proj_b"),
                          ("ssm_out", "linear_attn.out_proj")),
            peft_orders=peft_orders,
            scratch=False)
