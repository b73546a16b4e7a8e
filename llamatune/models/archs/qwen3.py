"""qwen3: Qwen3 dense models (llama.cpp src/models/qwen3.cpp).

qwen2's block without the q/k/v biases, plus a per-head RMSNorm of q and k
(`attn_q_norm`, `attn_k_norm`, one (head_dim,) weight shared by all heads) after
their projection and before rope (NEOX). `attention.key_length` (head_dim) may
differ from n_embd / n_head. The head is `output`, or token_embd when absent.
"""
from ..arch import NEOX, Arch, block_layer

ARCH = Arch(name="qwen3", rope_mode=NEOX, layer=block_layer(qk_norm=True))
