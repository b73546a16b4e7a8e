"""gemma: Gemma 1 (llama.cpp src/models/gemma.cpp).

llama's block with:
  - token embeddings scaled by sqrt(n_embd) in f32 (`ggml_scale(inpL, sqrtf(n_embd))`);
  - a GeGLU feed-forward, gelu (tanh approximation) of the gate times up;
  - norm weights used as stored: llama.cpp's converter already adds Gemma's 1 to them;
  - rope on the halves of each head (NEOX), attention scale 1/sqrt(head_dim);
  - the head tied to token_embd (llama.cpp reads no `output` tensor).
"""
from ..arch import NEOX, Arch

ARCH = Arch(name="gemma", rope_mode=NEOX, activation="gelu", embd_scale=True, tied=True)
