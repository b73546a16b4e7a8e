"""qwen2: Qwen2 / Qwen2.5 (llama.cpp src/models/qwen2.cpp).

llama's block with biases on the q, k and v projections and rope on the two halves
of each head (NEOX).
"""
from ..arch import NEOX, Arch

ARCH = Arch(name="qwen2", rope_mode=NEOX,
            layer=("attn_norm", "attn_q", "attn_q.bias", "attn_k", "attn_k.bias", "attn_v", "attn_v.bias",
                   "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_norm"))
