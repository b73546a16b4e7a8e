"""granite: IBM Granite 3.x dense models (llama.cpp src/models/granite.cpp).

llama's block (pre-norm RMSNorm, NORM rope with convert_hf_to_gguf.py's q/k row order,
SwiGLU) with Granite's four multipliers, from the file's keys:
    x      = embd(tokens) * embedding_scale                 (absent: 1)
    x_mid  = x + residual_scale * attn(...)                  (attention's q.k scale:
    x_out  = x_mid + residual_scale * ffn(...)                attention.scale, else 1/sqrt(head_dim))
    logits = head(x_out) / logit_scale                       (logit_scale is required, as llama.cpp)
`rope.scaling.finetuned` false turns rope off on every layer (llama.cpp reads it as
granite's rope switch; absent: rope on). The head is `output`, or token_embd when absent
(Granite ties them). Not here: granite's optional attn_output / feed-forward biases (no
released dense Granite has them) and the granitemoe / granitehybrid / granite_swa families.
"""
from ..arch import NORM, Arch


def read_hparams(read) -> dict:
    values = dict(logit_scale=read.number("logit_scale"))
    for key, field in (("residual_scale", "residual_scale"), ("embedding_scale", "embd_multiplier"),
                       ("attention.scale", "attn_scale")):
        if read.raw(key):
            values[field] = read.number(key)
    if read.raw("rope.scaling.finetuned", True) is False:
        values["nope_step"] = 1                  # no layer rotates
    return values


def hparams_metadata(cfg) -> dict:
    a = cfg.arch
    md = {f"{a}.logit_scale": cfg.logit_scale or 1.0}
    for key, value in (("residual_scale", cfg.residual_scale), ("embedding_scale", cfg.embd_multiplier),
                       ("attention.scale", cfg.attn_scale)):
        if value:
            md[f"{a}.{key}"] = value
    if cfg.nope_step == 1:
        md[f"{a}.rope.scaling.finetuned"] = False
    return md


ARCH = Arch(name="granite", rope_mode=NORM, peft_permute_qk=True, read_hparams=read_hparams,
            hparams_metadata=hparams_metadata, defaults=(("logit_scale", 1.0),))
