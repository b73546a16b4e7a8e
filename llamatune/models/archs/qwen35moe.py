"""qwen35moe: Qwen3.5 / Qwen3.6 mixture-of-experts models, Qwen3.5-35B-A3B and up
(llama.cpp src/models/qwen35moe.cpp).

qwen35's two kinds of layer (gated delta-net, gated full attention; models/archs/qwen35.py)
with, in place of the dense SwiGLU, llama.cpp's build_layer_ffn of qwen35moe: on the
post_attention_norm-normed input xn,

    out = moe(xn) + sigmoid(xn . ffn_gate_inp_shexp) * SwiGLU_shexp(xn)

where moe is qwen3moe's mixture of experts (the softmax router `ffn_gate_inp`, top
`expert_used_count`, the weights normalized to sum 1 as HF's router always does; the
3-D `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`) and the shared expert a dense
SwiGLU `ffn_gate_shexp`, `ffn_up_shexp` (F_sh, C), `ffn_down_shexp` (C, F_sh) scaled by
the sigmoid of one output, `ffn_gate_inp_shexp` (1, C) (the models/parts.py part
"moe_shared_post"). F_sh is `expert_shared_feed_forward_length` (llama.cpp's n_ff_shexp,
default feed_forward_length), held as the config's n_ff: the family has no other dense
feed-forward. The multi-token-prediction layers files carry at the end of block_count
(`nextn_predict_layers`) are not read, as qwen35's (llama.cpp runs them only as a draft
model).
"""
from __future__ import annotations

from ..arch import NEOX, Arch
from . import qwen35

SHARED = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _without_ffn(kinds: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(k for k in kinds if k not in qwen35.FFN + ("post_attention_norm",)) + SHARED \
        + ("post_attention_norm",)


RECURRENT, ATTENTION = _without_ffn(qwen35.RECURRENT), _without_ffn(qwen35.ATTENTION)


def layer_kinds(cfg, i: int) -> tuple[str, ...]:
    return RECURRENT if cfg.is_recurrent(i) else ATTENTION


def parts(cfg, i: int) -> tuple[str, str]:
    return qwen35.parts(cfg, i)[0], "moe_shared_post"


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    C, F = cfg.n_embd, cfg.n_ff
    return qwen35.shapes(cfg) | {"ffn_gate_inp_shexp": (1, C), "ffn_gate_shexp": (F, C), "ffn_up_shexp": (F, C),
                                 "ffn_down_shexp": (C, F)}


def read_hparams(read) -> dict:
    n_used = read.count("expert_used_count")
    n_ff = read.count("expert_shared_feed_forward_length", read.raw("feed_forward_length"))
    return qwen35.read_hparams(read) | dict(
        n_ff=n_ff, n_expert=read.count("expert_count"), n_expert_used=n_used,
        n_ff_exp=read.count("expert_feed_forward_length", max(1, int(read.raw("feed_forward_length", 0)) // n_used)))


def hparams_metadata(cfg) -> dict:
    a = cfg.arch
    return qwen35.hparams_metadata(cfg) | {
        f"{a}.expert_count": cfg.n_expert, f"{a}.expert_used_count": cfg.n_expert_used,
        f"{a}.expert_feed_forward_length": cfg.n_ff_exp, f"{a}.expert_shared_feed_forward_length": cfg.n_ff}


ARCH = Arch(name="qwen35moe", rope_mode=NEOX, layer=tuple(dict.fromkeys(RECURRENT + ATTENTION)), experts=EXPERTS,
            read_hparams=read_hparams, hparams_metadata=hparams_metadata, layer_kinds=layer_kinds, parts=parts,
            shapes=shapes, vectors=qwen35.VECTORS,
            # PEFT names as qwen35's (the delta-net value heads in the converter's order), the
            # shared expert and its gate, and the experts (Qwen3_5MoeExperts: gate | up stacked)
            peft_modules=tuple(m for m in qwen35.ARCH.peft_modules if not m[0].startswith("ffn_")) + (
                ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"), ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
                ("ffn_down_shexp", "mlp.shared_expert.down_proj"), ("ffn_gate_inp_shexp", "mlp.shared_expert_gate")),
            peft_orders=qwen35.peft_orders,
            peft_experts=((("ffn_gate_exps", "ffn_up_exps"), "mlp.experts.gate_up_proj", "stacked"),
                          (("ffn_down_exps",), "mlp.experts.down_proj", "stacked")),
            scratch=False)
