"""gemma2: Gemma 2 (llama.cpp src/models/gemma2.cpp, load_arch_hparams there).

gemma's block (sqrt(n_embd) embedding scale, GeGLU, tied head, NEOX rope) plus:
  - sandwich norms: `post_attention_norm` and `post_ffw_norm`, an RMSNorm of the
    attention and feed-forward outputs before their residual add;
  - attention scores soft-capped, cap * tanh(s / cap), cap `attn_logit_softcapping`
    (default 50), and the final logits too, `final_logit_softcapping` (default 30);
  - sliding-window attention (`attention.sliding_window`, default 4096) on the layers
    of llama.cpp's set_swa_pattern(2) (even layers; `attention.sliding_window_pattern`
    overrides the 2); their rope base is `rope.freq_base_swa` when given, else the
    model's;
  - attention scale 1/sqrt(key_length), except for the 46-layer (27B) model:
    1/sqrt(n_embd / n_head) (integer division, as llama.cpp).
"""
from ...errors import LlamatuneError
from ..arch import NEOX, Arch, block_layer

BIG_MODEL_LAYERS = 46       # llama.cpp's LLM_TYPE_27B for gemma2


def big_model_scale(read, big_layers: int) -> dict:
    """llama.cpp's f_attention_scale for gemma2/3: 1/sqrt(n_embd // n_head) for the 27B
    model (told by its layer count), else none (1/sqrt(head_dim))."""
    if read.count("block_count") != big_layers:
        return {}
    return {"attn_scale": 1.0 / (read.count("embedding_length") // read.count("attention.head_count")) ** 0.5}


def swa_pattern(read, default: int) -> int:
    """`attention.sliding_window_pattern` as an integer n (set_swa_pattern(n)); llama.cpp
    also accepts a per-layer array, which is refused here."""
    value = read.raw("attention.sliding_window_pattern")
    if isinstance(value, list):
        raise LlamatuneError(f"{read.source}: metadata key '{read.arch}.attention.sliding_window_pattern' is a "
                             "per-layer array, which is not supported (only an integer pattern)")
    return default if value is None else read.count("attention.sliding_window_pattern")


DEFAULTS = dict(attn_softcap=50.0, final_softcap=30.0, sliding_window=4096, swa_pattern=2)   # llama.cpp's


def read_hparams(read) -> dict:
    values = dict(attn_softcap=read.number("attn_logit_softcapping", DEFAULTS["attn_softcap"]),
                  final_softcap=read.number("final_logit_softcapping", DEFAULTS["final_softcap"]),
                  sliding_window=read.count("attention.sliding_window", DEFAULTS["sliding_window"]),
                  swa_pattern=swa_pattern(read, DEFAULTS["swa_pattern"]))
    if read.raw("rope.freq_base_swa") is not None:
        values["rope_freq_base_swa"] = read.number("rope.freq_base_swa")
    return values | big_model_scale(read, BIG_MODEL_LAYERS)


def hparams_metadata(cfg) -> dict:
    a = cfg.arch
    md = {f"{a}.attn_logit_softcapping": cfg.attn_softcap, f"{a}.final_logit_softcapping": cfg.final_softcap,
          f"{a}.attention.sliding_window": cfg.sliding_window}
    if cfg.swa_pattern != DEFAULTS["swa_pattern"]:
        md[f"{a}.attention.sliding_window_pattern"] = cfg.swa_pattern
    if cfg.rope_freq_base_swa:
        md[f"{a}.rope.freq_base_swa"] = cfg.rope_freq_base_swa
    return md


ARCH = Arch(name="gemma2", rope_mode=NEOX, layer=block_layer(post_norms=True), activation="gelu",
            embd_scale=True, tied=True, read_hparams=read_hparams, hparams_metadata=hparams_metadata,
            defaults=tuple(DEFAULTS.items()))
