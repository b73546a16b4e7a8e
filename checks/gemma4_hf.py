"""A tiny Gemma 4 text model made by HF transformers, converted by llama.cpp's
convert_hf_to_gguf.py, and HF's float64 logits and gradients of it: the oracle of the
gemma4 tests.

    PY=<interpreter with torch and transformers>
    $PY -m checks.gemma4_hf build DIR [--steps 200]        # tokenizer, model, a short training
    $PY -m checks.gemma4_hf convert DIR OUT.gguf --outtype f32|q8_0
    $PY -m checks.gemma4_hf logits DIR TOKENS.npy OUT.npy  # float64 logits (B, T, V) of token rows
    $PY -m checks.gemma4_hf grads DIR BATCH.npz OUT.npz     # float64 loss and every Linear's weight gradient

Run from the repository root by the torch interpreter (it imports nothing of llamatune;
checks/hf_tiny.py holds what the HF oracles share).

The model (Gemma4ForCausalLM): 4 layers, layers 0-2 sliding-window (window 16), layer 3
full attention with the proportional rope (a quarter of its pairs turned), hidden 64, 4
query heads and 2 kv heads of 16 in both kinds of layer (global_head_dim = head_dim:
llamatune's dense core), GeGLU of 128, final soft-cap 30, tied head, no per-layer
embeddings, no KV sharing, no experts; each layer's layer_scalar set away from 1 (HF
keeps it as a buffer, which training leaves as it is) and the norms moved off their
initial values before `--steps` AdamW steps of 8 rows of 64 tokens. Its vocabulary is a
512-token BPE with byte fallback on "▁"-escaped text, Gemma's kind, which the
converter's gemma4 vocabulary reads. The converter reads config.json as saved (see
hf_tiny.convert: AutoConfig would drop global_head_dim).

`logits` and `grads` run HF's modules in float64: RMSNorm's `.float()` and the eager
softmax's float32 made float64 in HF's own source; the rotary tables stay HF's float32
ones, as llama.cpp's are float32.
"""
from __future__ import annotations

import json
from pathlib import Path

from checks import hf_tiny

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=16,
              layer_types=["sliding_attention"] * 3 + ["full_attention"], hidden_size_per_layer_input=0,
              vocab_size_per_layer_input=512, num_kv_shared_layers=0, final_logit_softcapping=30.0,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
              eos_token_id=1, bos_token_id=2)
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def _tokenizer(text: str, out: Path):
    """BPE with byte fallback on text whose spaces are "▁" (Gemma's vocabulary kind)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = list(SPECIALS) + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=specials,
                                                        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")
    fast.save_pretrained(out)
    return fast


def build(out: Path, steps: int, seed: int, text_path: Path, config: dict = CONFIG) -> None:
    """The tokenizer and the model of `config` (this module's CONFIG; gemma4_e4b_hf's), trained."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    text = text_path.read_text(encoding="utf-8")[:300_000]
    tok = _tokenizer(text, out)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**config)).float()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.15 * i)
    hf_tiny.perturb_norms(model, 0.2)
    hf_tiny.train(model, torch.tensor(tok(text)["input_ids"]), steps, seed=seed, label="gemma4")
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["global_head_dim"] = config["global_head_dim"]          # what the converter looks for
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")


def load64(src: Path):
    """The saved model in float64, HF's float32 casts made float64, eager attention."""
    import torch
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4 import modeling_gemma4 as m
    m.eager_attention_forward = hf_tiny.redo_float64(m, m.eager_attention_forward)
    m.Gemma4RMSNorm.forward = hf_tiny.redo_float64(m, m.Gemma4RMSNorm.forward)
    model = Gemma4ForCausalLM.from_pretrained(src, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    return model


def main() -> None:
    hf_tiny.cli(__doc__, build, load64,
                lambda d, out, outtype, llama_cpp: hf_tiny.convert(d, out, outtype, llama_cpp, raw_config=True))


if __name__ == "__main__":
    main()
