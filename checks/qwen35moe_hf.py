"""A tiny Qwen3.5-MoE text model made by HF transformers, converted by llama.cpp's
convert_hf_to_gguf.py, and HF's float64 logits and gradients of it: the oracle of the
qwen35moe tests.

    PY=<interpreter with torch and transformers>
    $PY -m checks.qwen35moe_hf build DIR [--steps 200]        # tokenizer, model, a short training
    $PY -m checks.qwen35moe_hf convert DIR OUT.gguf --outtype f32|q8_0
    $PY -m checks.qwen35moe_hf logits DIR TOKENS.npy OUT.npy  # float64 logits (B, T, V) of token rows
    $PY -m checks.qwen35moe_hf grads DIR BATCH.npz OUT.npz     # float64 loss and every weight's gradient

Run from the repository root by the torch interpreter (it imports nothing of llamatune:
checks/hf_tiny.py holds what the HF oracles share); the tests call it as a subprocess
and skip without that interpreter.

The model (Qwen3_5MoeForCausalLM): checks/qwen35_hf.py's Qwen3.5 shape (4 layers, layers
0-2 gated delta-net, layer 3 gated full attention, hidden 64, 4 query heads of 16 and 2
kv heads, half of each head rotated; delta-net 2 q/k heads, 4 value heads of 16) with,
in every layer, a mixture of 8 experts of 32 (2 per token, the top-k weights normalized
as HF's router always does) and the shared expert of 64 scaled by sigmoid of its gate
(`shared_expert_gate`, one output). Byte-level BPE of 512 tokens trained on the text;
`--steps` AdamW steps of 8 rows of 64 tokens, the norms moved off their initial values
first. The converter runs with --no-mtp (the model has no MTP layer).

`logits` and `grads` run HF's modules in float64 throughout: the norms' `.float()`, the
router's softmax, the delta rule's and the gated norm's float32 casts are made float64 by
executing HF's own source with those casts replaced; the rotary tables stay HF's float32
ones, as llama.cpp's are float32.
"""
from __future__ import annotations

from pathlib import Path

from checks import hf_tiny

CONFIG = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_conv_kernel_dim=4, full_attention_interval=4,
              moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
              router_aux_loss_coef=0.0, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True))


def build(out: Path, steps: int, seed: int, text_path: Path) -> None:
    """Tokenizer, model and a short training, saved in `out` (safetensors)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    text = text_path.read_text(encoding="utf-8")[:400_000]
    tok = hf_tiny.train_tokenizer(text, out)
    cfg = Qwen3_5MoeTextConfig(**CONFIG, eos_token_id=tok.convert_tokens_to_ids(hf_tiny.EOS))
    model = Qwen3_5MoeForCausalLM(cfg).float()
    hf_tiny.perturb_norms(model, 0.1)
    hf_tiny.train(model, torch.tensor(tok(text)["input_ids"]), steps, seed=seed, label="qwen35moe")
    model.save_pretrained(out)


def _float64_modules():
    """HF's qwen3_5_moe modules with their float32 casts made float64 (their own source)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    for fn in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule, m.eager_attention_forward):
        setattr(m, fn.__name__, hf_tiny.redo_float64(m, fn))
    for cls in (m.Qwen3_5MoeRMSNorm, m.Qwen3_5MoeRMSNormGated, m.Qwen3_5MoeGatedDeltaNet):
        cls.forward = hf_tiny.redo_float64(m, cls.forward)
    m.Qwen3_5MoeTopKRouter.forward = hf_tiny.redo_float64(m, m.Qwen3_5MoeTopKRouter.forward,
                                                          (("dtype=torch.float,", "dtype=torch.float64,"),))
    return m


def load64(src: Path):
    """The saved model in float64, HF's casts made float64, eager attention and experts."""
    import torch
    _float64_modules()
    from transformers import Qwen3_5MoeForCausalLM
    model = Qwen3_5MoeForCausalLM.from_pretrained(src, dtype=torch.float64, attn_implementation="eager",
                                                  experts_implementation="eager")
    model.eval()
    return model


def main() -> None:
    hf_tiny.cli(__doc__, build, load64,
                lambda d, out, outtype, llama_cpp: hf_tiny.convert(d, out, outtype, llama_cpp, extra=("--no-mtp",)))


if __name__ == "__main__":
    main()
