"""gemma3: Gemma 3 text models (llama.cpp src/models/gemma3.cpp, load_arch_hparams there).

gemma2's block (sqrt(n_embd) embedding scale, GeGLU, sandwich norms, NEOX rope) with
the per-head q/k RMSNorm of qwen3 and no attention soft-capping:
  - sliding-window layers (when `attention.sliding_window` > 0) in a 5:1 pattern,
    set_swa_pattern(6): layer i slides unless i % 6 == 5;
  - per-layer rope: the sliding-window layers use `rope.freq_base_swa` (default
    10000) and no scaling, the global ones `rope.freq_base` and the model's linear
    rope scaling (`rope.scaling.factor`, as Gemma 3 4B+ carry); other scaling types
    are refused by config.py;
  - final-logit soft-capping only when the file has `final_logit_softcapping`;
  - attention scale 1/sqrt(key_length), except the 62-layer (27B) model:
    1/sqrt(n_embd / n_head);
  - the head is `output`, or token_embd when absent.
"""
from ..arch import NEOX, Arch, block_layer
from .gemma2 import big_model_scale, swa_pattern

BIG_MODEL_LAYERS = 62       # llama.cpp's LLM_TYPE_27B for gemma3
LOCAL_ROPE_BASE = 10000.0   # llama.cpp's rope_freq_base_train_swa default
PATTERN = 6                 # llama.cpp's load_swa_pattern(ml, 6)
# a new gemma3 (train-from-scratch): Gemma 3 1B's window and global rope base
DEFAULTS = dict(sliding_window=512, swa_pattern=PATTERN, rope_freq_base=1e6,
                rope_freq_base_swa=LOCAL_ROPE_BASE, rope_freq_scale_swa=1.0)


def read_hparams(read) -> dict:
    values = big_model_scale(read, BIG_MODEL_LAYERS)
    if read.raw("final_logit_softcapping"):
        values["final_softcap"] = read.number("final_logit_softcapping")
    if read.raw("attention.sliding_window"):
        values |= dict(sliding_window=read.count("attention.sliding_window"),
                       swa_pattern=swa_pattern(read, PATTERN),
                       rope_freq_base_swa=read.number("rope.freq_base_swa", LOCAL_ROPE_BASE),
                       rope_freq_scale_swa=1.0)
    return values


def hparams_metadata(cfg) -> dict:
    a, md = cfg.arch, {}
    if cfg.final_softcap:
        md[f"{a}.final_logit_softcapping"] = cfg.final_softcap
    if cfg.sliding_window:
        md[f"{a}.attention.sliding_window"] = cfg.sliding_window
        if cfg.swa_pattern != PATTERN:
            md[f"{a}.attention.sliding_window_pattern"] = cfg.swa_pattern
        if cfg.rope_freq_base_swa != LOCAL_ROPE_BASE:
            md[f"{a}.rope.freq_base_swa"] = cfg.rope_freq_base_swa
    return md


ARCH = Arch(name="gemma3", rope_mode=NEOX, layer=block_layer(qk_norm=True, post_norms=True), activation="gelu",
            embd_scale=True, read_hparams=read_hparams, hparams_metadata=hparams_metadata,
            defaults=tuple(DEFAULTS.items()))
