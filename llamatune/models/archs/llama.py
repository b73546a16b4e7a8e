"""llama: Llama 1/2/3, TinyLlama, Mistral, SmolLM (llama.cpp src/models/llama.cpp).

Per layer, pre-norm RMSNorm, rope on adjacent pairs (NORM), SwiGLU feed-forward:
    x += Wo attn(rope(Wq n(x)), rope(Wk n(x)), Wv n(x))      n = RMSNorm(attn_norm)
    x += Wdown (silu(Wgate n(x)) * Wup n(x))                 n = RMSNorm(ffn_norm)
Llama 3.1's rope frequency factors come in the optional `rope_freqs` tensor.
"""
from ..arch import NORM, Arch

ARCH = Arch(name="llama", rope_mode=NORM, peft_permute_qk=True)
