"""smollm3: SmolLM3 (llama.cpp src/models/smollm3.cpp).

llama's block (pre-norm RMSNorm, NORM rope with convert_hf_to_gguf.py's q/k row order,
SwiGLU) with no rope at all on every fourth layer ("NoPE"): layer i rotates q and k
unless (i + 1) % 4 == 0. The step is llama.cpp's n_no_rope_layer_step, which it sets to
4 for this architecture whatever the file holds (the converter writes no key for it; HF's
`no_rope_layers` of SmolLM3-3B is this pattern, and a HF model with another pattern runs
in llama.cpp, and here, with this one). The head is `output`, or token_embd when absent
(SmolLM3-3B ties them).
"""
from ..arch import NORM, Arch

NOPE_STEP = 4      # llama.cpp's hparams.n_no_rope_layer_step for smollm3


def read_hparams(read) -> dict:
    return {"nope_step": NOPE_STEP}


ARCH = Arch(name="smollm3", rope_mode=NORM, peft_permute_qk=True, read_hparams=read_hparams,
            defaults=(("nope_step", NOPE_STEP),))
