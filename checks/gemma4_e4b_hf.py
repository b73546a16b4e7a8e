"""A tiny Gemma 4 text model with what Gemma-4-E4B's has beyond the dense core, made by HF
transformers and converted by llama.cpp's convert_hf_to_gguf.py: the oracle of the gemma4
tests of those features. The same commands as checks/gemma4_hf.py:

    $PY -m checks.gemma4_e4b_hf build DIR [--steps 200]
    $PY -m checks.gemma4_e4b_hf convert DIR OUT.gguf --outtype f32|q8_0
    $PY -m checks.gemma4_e4b_hf logits DIR TOKENS.npy OUT.npy
    $PY -m checks.gemma4_e4b_hf grads DIR BATCH.npz OUT.npz

The model: checks/gemma4_hf.py's (hidden 64, 4 query heads, window 16, GeGLU of 128, soft-cap
30, tied head) with 4 layers alternating sliding-window and full attention, the full ones
with heads of 32 (the sliding ones 16: E4B's 512 / 256) and 1 kv head (the sliding ones 2:
per_layer_config, as the larger models' per-layer kv heads), the last 2 layers sharing the
keys and values of layers 0 and 1 (num_kv_shared_layers) with feed-forwards twice as wide
(use_double_wide_mlp), and per-layer embeddings of 8 (hidden_size_per_layer_input).
"""
from __future__ import annotations

import functools

from checks import gemma4_hf, hf_tiny

FULL = {"head_dim": 32, "num_key_value_heads": 1}
CONFIG = gemma4_hf.CONFIG | dict(
    global_head_dim=32, layer_types=["sliding_attention", "full_attention"] * 2, per_layer_config={1: FULL, 3: FULL},
    hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True)


def main() -> None:
    hf_tiny.cli(__doc__, functools.partial(gemma4_hf.build, config=CONFIG), gemma4_hf.load64,
                lambda d, out, outtype, llama_cpp: hf_tiny.convert(d, out, outtype, llama_cpp, raw_config=True))


if __name__ == "__main__":
    main()
