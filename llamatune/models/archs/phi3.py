"""phi3: Phi-3 / Phi-3.5 / Phi-4-mini (llama.cpp src/models/phi3.cpp).

llama's block with two fused projections and NEOX rope:
    q | k | v = n(x) Wqkv^T                  attn_qkv (Cq + 2 Ckv, C), rows q, k, v
    x += Wo attn(rope(q), rope(k), v)
    gate | up = n(x) Wup^T                   ffn_up (2F, C), rows gate, up
    x += Wdown (silu(gate) * up)             (ggml_swiglu: the first half is gated)
A LoRA adapter on a fused tensor is one pair, A (r, C) and B (rows, r), applied to the
whole product before the split, as llama.cpp's build_lora_mm does.

Rope scaling `su` / `longrope` (Phi-3 128k, Phi-3.5, Phi-4-mini) comes as the
`rope_factors_long` / `rope_factors_short` tensors (frequency factors, theta_i /= f_i)
and `rope.scaling.attn_factor` (cos and sin multiplied by it); as llama.cpp's
get_rope_factors, a context above `rope.scaling.original_context_length` (after llama.cpp
rounds it up to a multiple of 256) rotates with the long factors, any other with the
short ones (models/rope.py).

`attention.sliding_window` is read and ignored: llama.cpp disables Phi-3's sliding
window ("Phi SWA is currently disabled", llama_model_phi3::load_arch_hparams), so
every layer attends to the whole causal context here too.
"""
from ..arch import NEOX, Arch


def read_hparams(read) -> dict:
    values = {"rope_attn_factor": read.number("rope.scaling.attn_factor", 1.0)}
    if read.raw("rope.scaling.original_context_length") is not None:
        values["n_ctx_orig"] = read.count("rope.scaling.original_context_length")
    return values


def hparams_metadata(cfg) -> dict:
    """The keys convert_hf_to_gguf.py's Phi3MiniModel writes beyond llama's."""
    md = {"phi3.rope.scaling.original_context_length": cfg.n_ctx_orig_rope,
          "phi3.attention.sliding_window": 0}
    if cfg.rope_attn_factor != 1.0:
        md["phi3.rope.scaling.attn_factor"] = float(cfg.rope_attn_factor)
    return md


ARCH = Arch(name="phi3", rope_mode=NEOX,
            layer=("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"),
            read_hparams=read_hparams, hparams_metadata=hparams_metadata,
            fused_qkv=True, fused_gate_up=True,
            peft_modules=(("attn_qkv", "self_attn.qkv_proj"), ("attn_output", "self_attn.o_proj"),
                          ("ffn_up", "mlp.gate_up_proj"), ("ffn_down", "mlp.down_proj")))
