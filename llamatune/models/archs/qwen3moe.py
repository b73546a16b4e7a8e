"""qwen3moe: Qwen3 mixture-of-experts models, Qwen3-30B-A3B and Qwen3-Coder-30B-A3B
(llama.cpp src/models/qwen3moe.cpp).

qwen3's attention (per-head q/k RMSNorm, NEOX rope) and, in every layer, a mixture of
experts in place of the dense SwiGLU: the router `ffn_gate_inp` (E, C) gives each token
a softmax over E experts, the `expert_used_count` largest are kept with their weights
normalized to sum 1 (llama.cpp's build_moe_ffn with norm_w, HF's norm_topk_prob), and the
token's output is the weighted sum of those experts' SwiGLUs, stored as 3-D tensors
`ffn_gate_exps`, `ffn_up_exps` (E, F_exp, C) and `ffn_down_exps` (E, C, F_exp)
(models/moe.py; the layer's feed-forward part of kind "moe", models/parts.py). llama.cpp reads no dense layers for this family (HF's mlp_only_layers
and decoder_sparse_step are not in the GGUF); `expert_feed_forward_length` defaults to
feed_forward_length / expert_used_count as llama.cpp's.
"""
from ..arch import NEOX, QK_NORMS, Arch

LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output") + QK_NORMS + ("ffn_norm", "ffn_gate_inp")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _read(read) -> dict:
    n_used = read.count("expert_used_count")
    n_ff = read.raw("feed_forward_length", 0)
    return dict(n_expert=read.count("expert_count"), n_expert_used=n_used,
                n_ff_exp=read.count("expert_feed_forward_length", max(1, int(n_ff) // n_used)))


def _metadata(cfg) -> dict:
    a = cfg.arch
    return {f"{a}.expert_count": cfg.n_expert, f"{a}.expert_used_count": cfg.n_expert_used,
            f"{a}.expert_feed_forward_length": cfg.n_ff_exp}


ARCH = Arch(name="qwen3moe", rope_mode=NEOX, layer=LAYER, experts=EXPERTS, ffn="moe", read_hparams=_read,
            hparams_metadata=_metadata, scratch=False,
            peft_modules=(("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                          ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                          ("ffn_gate_inp", "mlp.gate")),
            peft_experts=((("ffn_gate_exps", "ffn_up_exps"), "mlp.experts.gate_up_proj", "stacked"),
                          (("ffn_down_exps",), "mlp.experts.down_proj", "stacked")))
