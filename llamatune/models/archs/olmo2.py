"""olmo2: OLMo 2 (llama.cpp src/models/olmo2.cpp).

No norm before attention or the feed-forward: their outputs are normed instead, before
the residual add, and q and k are normed over the whole projection (all heads together,
one (n_head * head_dim,) and one (n_head_kv * head_dim,) weight), before rope (NEOX):
    q, k, v = RMSNorm(x Wq^T, attn_q_norm), RMSNorm(x Wk^T, attn_k_norm), x Wv^T
    x_mid   = x + RMSNorm(attn(rope(q), rope(k), v) Wo^T, post_attention_norm)
    x_out   = x_mid + RMSNorm(Wdown (silu(Wgate x_mid) * Wup x_mid), post_ffw_norm)
The head is `output` (llama.cpp requires it). Attention scale 1/sqrt(head_dim).

Not here: OLMo 3 (also `olmo2` in llama.cpp: sliding-window layers and YaRN on the
global ones); a file with `attention.sliding_window` is refused.
"""
from ..arch import NEOX, Arch
from ...errors import LlamatuneError

LAYER = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm",
         "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")


def read_hparams(read) -> dict:
    if read.raw("attention.sliding_window"):
        raise LlamatuneError(f"{read.source}: olmo2 with a sliding window (OLMo 3) is not supported yet "
                             f"('{read.arch}.attention.sliding_window' is {read.raw('attention.sliding_window')})")
    return {}


ARCH = Arch(name="olmo2", rope_mode=NEOX, layer=LAYER, qk_norm_full=True, read_hparams=read_hparams)
