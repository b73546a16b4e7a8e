"""gpt-oss: OpenAI's gpt-oss-20b and -120b (llama.cpp LLM_ARCH_OPENAI_MOE,
src/models/openai-moe.cpp; HF GptOssForCausalLM).

Each layer is attention with sinks, then a mixture of experts (models/parts.py's
"attention_sinks" and "moe_post"):
  - attention: attn_norm, q/k/v and attn_output with biases, YaRN rope (NEOX; the file's
    rope.scaling.type yarn: models/rope.py), scale 1/sqrt(head_dim), and a learned logit
    per head in every softmax's denominator (`attn_sinks`, kernels/attention_sinks.py).
    Layers alternate a sliding window (`attention.sliding_window`) and full attention:
    llama.cpp's load_swa_pattern(2) (layer i slides iff i is even; an
    `attention.sliding_window_pattern` count in the file overrides the 2), HF's
    layer_types; the sliding layers' rope base is `rope.freq_base_swa` where present;
  - mixture of experts: `post_attention_norm` is its input norm; the router
    `ffn_gate_inp` has a bias and its weights are the softmax of the top k logits
    (build_moe_ffn's SOFTMAX_WEIGHT gating, the normalized top-k probabilities:
    kernels/moe.py); each expert's gate, up and down have biases (`ffn_*_exps.bias`,
    (E, n_out), frozen) and its gate is the clamped SwiGLU (kernels/swiglu_oai.py).
The head is `output` (never tied).
"""
from ..arch import NEOX, Arch

LAYER = ("attn_norm", "attn_q", "attn_q.bias", "attn_k", "attn_k.bias", "attn_v", "attn_v.bias",
         "attn_output", "attn_output.bias", "attn_sinks.weight", "post_attention_norm",
         "ffn_gate_inp", "ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
VECTORS = ("attn_sinks.weight", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")
SWA_PATTERN = 2


def _read(read) -> dict:
    values = dict(n_expert=read.count("expert_count"), n_expert_used=read.count("expert_used_count"),
                  n_ff_exp=read.count("expert_feed_forward_length"),
                  sliding_window=read.count("attention.sliding_window"),
                  swa_pattern=read.count("attention.sliding_window_pattern", SWA_PATTERN),
                  rope_attn_factor=read.number("rope.scaling.attn_factor", 1.0))
    if read.raw("rope.freq_base_swa") is not None:            # (absent: the sliding layers' is freq_base)
        values["rope_freq_base_swa"] = read.number("rope.freq_base_swa")
    return values


def _metadata(cfg) -> dict:
    a = cfg.arch
    md = {f"{a}.expert_count": cfg.n_expert, f"{a}.expert_used_count": cfg.n_expert_used,
          f"{a}.expert_feed_forward_length": cfg.n_ff_exp, f"{a}.attention.sliding_window": cfg.sliding_window}
    if cfg.swa_pattern != SWA_PATTERN:
        md[f"{a}.attention.sliding_window_pattern"] = cfg.swa_pattern
    if cfg.rope_freq_base_swa:
        md[f"{a}.rope.freq_base_swa"] = float(cfg.rope_freq_base_swa)
    if cfg.rope_attn_factor != 1.0:
        md[f"{a}.rope.scaling.attn_factor"] = float(cfg.rope_attn_factor)
    return md


def _shapes(cfg) -> dict:
    E, Fe, C = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
    return {"attn_sinks.weight": (cfg.n_head,), "ffn_gate_exps.bias": (E, Fe), "ffn_up_exps.bias": (E, Fe),
            "ffn_down_exps.bias": (E, C)}


ARCH = Arch(name="gpt-oss", rope_mode=NEOX, layer=LAYER, experts=EXPERTS, vectors=VECTORS, shapes=_shapes,
            mixer="attention_sinks", ffn="moe_post", activation="swiglu_oai", read_hparams=_read,
            hparams_metadata=_metadata, scratch=False,
            peft_modules=(("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                          ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                          ("ffn_gate_inp", "mlp.router")),
            peft_experts=((("ffn_gate_exps", "ffn_up_exps"), "mlp.experts.gate_up_proj", "interleaved"),
                          (("ffn_down_exps",), "mlp.experts.down_proj", "stacked")))
