"""A tiny Gemma 4 text model with the larger models' attention_k_eq_v, made by HF
transformers and converted by llama.cpp's convert_hf_to_gguf.py: the oracle of the gemma4
tests of it. The same commands as checks/gemma4_hf.py:

    $PY -m checks.gemma4_31b_hf build DIR [--steps 200]
    $PY -m checks.gemma4_31b_hf convert DIR OUT.gguf --outtype f32|q8_0
    $PY -m checks.gemma4_31b_hf logits DIR TOKENS.npy OUT.npy
    $PY -m checks.gemma4_31b_hf grads DIR BATCH.npz OUT.npz

The model: checks/gemma4_hf.py's (hidden 64, 4 query heads, window 16, GeGLU of 128,
soft-cap 30, tied head) with 4 layers alternating sliding-window and full attention, the
full ones with heads of 32 (the sliding ones 16), 1 kv head (num_global_key_value_heads;
the sliding ones 2) and no v_proj: their values are the keys' projection
(attention_k_eq_v, as Gemma-4-31B's). No per-layer embeddings, no shared KV.
"""
from __future__ import annotations

import functools

from checks import gemma4_hf, hf_tiny

CONFIG = gemma4_hf.CONFIG | dict(
    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=["sliding_attention", "full_attention"] * 2)


def main() -> None:
    hf_tiny.cli(__doc__, functools.partial(gemma4_hf.build, config=CONFIG), gemma4_hf.load64,
                lambda d, out, outtype, llama_cpp: hf_tiny.convert(d, out, outtype, llama_cpp, raw_config=True))


if __name__ == "__main__":
    main()
