"""Hugging Face's side of the olmo2 / smollm3 / granite checks: tiny models made by HF
transformers, trained a little, converted by llama.cpp's own convert_hf_to_gguf.py, and
HF's logits, losses and LoRA gradients in float64 for the same tokens and adapters.

This file runs under a Python with torch, transformers and peft (`--torch-python`, never
a dependency of the project); tests/test_arch_families_hf.py runs it as a subprocess:

    PATH -m checks.families_hf build FAMILY OUT_DIR --data TEXT [--steps 300]
    PATH -m checks.families_hf logits HF_DIR IN.npz OUT.npz
    PATH -m checks.families_hf grads HF_DIR IN.npz OUT.npz

`build` writes OUT_DIR/hf (the HF model, float32, and its byte-level BPE tokenizer of
512 tokens trained on TEXT) after STEPS AdamW steps on TEXT, then OUT_DIR/FAMILY-F32.gguf
and FAMILY-Q8_0.gguf by llama.cpp's converter (`--llama-cpp`, or $LLAMA_CPP_DIR). The
converter names a byte-level BPE by the hash of its tokens for a fixed text; a tokenizer
trained here has no known hash, so the converter is run with its pre-tokenizer check
answering "gpt-2", which is what the tokenizer is (tokenizers' ByteLevel, GPT-2's regex);
nothing else of the conversion is touched.

`logits` (IN: tokens (B, T)) writes HF's logits in float64. `grads` (IN: tokens, targets
(-1: none), weights (B, T), lora_r, lora_alpha, and per HF module `A:<module>` (r, n_in),
`B:<module>` (n_out, r) in HF's row order) writes loss = sum(weights * cross-entropy)
and `dA:<module>`, `dB:<module>` by torch.autograd. Float64 throughout: the RMSNorms'
and softmax's casts to float32 in HF's code are lifted (the same formula in float64); the
rotary tables stay HF's float32 ones.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from checks import hf_tiny

FAMILIES = ("olmo2", "smollm3", "granite")
VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
# Granite 3's multipliers at this width: embedding 12, attention 1/head_dim (not 1/sqrt), residual, logits 8
GRANITE = dict(embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.375,
               logits_scaling=8.0)
TRAIN_CHARS = 1_000_000      # the tokenizer and the steps see the first characters of the text
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hf_config(family: str):
    import transformers as tf
    if family == "olmo2":
        return tf.Olmo2Config(**SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "smollm3":     # NoPE on layer 3 (every 4th), as SmolLM3-3B; tied head
        return tf.SmolLM3Config(**SHAPE, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "granite":
        return tf.GraniteConfig(**SHAPE, **GRANITE, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                                pad_token_id=0)
    raise SystemExit(f"unknown family {family!r} (one of {', '.join(FAMILIES)})")


def train_tokenizer(text: str, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def build(family: str, out: Path, data: Path, steps: int, llama_cpp: Path) -> None:
    import torch
    import transformers as tf
    torch.manual_seed(0)
    hf = out / "hf"
    torch.set_num_threads(1)                  # no OpenMP spinning on a shared machine
    text = data.read_text(encoding="utf-8")[:TRAIN_CHARS]
    tok = train_tokenizer(text, hf)
    ids = torch.tensor(tok.backend_tokenizer.encode(text).ids)
    print(f"{family}: {len(ids)} training tokens", flush=True)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    hf_tiny.train(model, ids, steps, batch=16, seed=1, label=family)
    model.save_pretrained(hf)
    for outtype in ("f32", "q8_0"):     # the tokenizer is GPT-2's kind (see the module's docstring)
        hf_tiny.convert(hf, out / f"{family}-{outtype.upper()}.gguf", outtype, llama_cpp, pre="gpt-2")


def float64_model(hf: Path):
    """The saved HF model in float64, HF's float32 casts in RMSNorm and softmax lifted."""
    import torch
    import transformers as tf
    from transformers.models.granite import modeling_granite
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.smollm3 import modeling_smollm3

    def rmsnorm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    for cls in (modeling_olmo2.Olmo2RMSNorm, modeling_smollm3.SmolLM3RMSNorm, modeling_granite.GraniteRMSNorm):
        cls.forward = rmsnorm
    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)
    torch.nn.functional.softmax = softmax64
    model = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64, attn_implementation="eager")
    return model.eval()


def logits(hf: Path, inp: Path, out: Path) -> None:
    import numpy as np
    import torch
    model = float64_model(hf)
    tokens = torch.tensor(np.load(inp)["tokens"])
    with torch.no_grad():
        z = torch.cat([model(input_ids=tokens[i:i + 8]).logits for i in range(0, len(tokens), 8)])
    np.savez(out, logits=z.numpy())


def grads(hf: Path, inp: Path, out: Path) -> None:
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    a = np.load(inp)
    model = float64_model(hf)
    model = get_peft_model(model, LoraConfig(r=int(a["lora_r"]), lora_alpha=float(a["lora_alpha"]),
                                             target_modules=list(LORA_MODULES), lora_dropout=0.0))
    params = dict(model.named_parameters())
    lora = {}
    for key in a.files:
        if key.startswith(("A:", "B:")):
            name = f"base_model.model.{key[2:]}.lora_{key[0]}.default.weight"
            with torch.no_grad():
                params[name].copy_(torch.tensor(a[key]))
            lora[key] = params[name]
    z = model(input_ids=torch.tensor(a["tokens"])).logits
    targets, w = torch.tensor(a["targets"]), torch.tensor(a["weights"])
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1).clamp(min=0),
                                           reduction="none")
    loss = (w.reshape(-1) * ce * (targets.reshape(-1) >= 0)).sum()
    loss.backward()
    res = {"loss": loss.detach().numpy(), "losses": ce.detach().numpy()}
    res |= {"d" + k: p.grad.numpy() for k, p in lora.items()}
    np.savez(out, **res)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build")
    b.add_argument("family", choices=FAMILIES)
    b.add_argument("out", type=Path)
    b.add_argument("--data", type=Path, required=True)
    b.add_argument("--steps", type=int, default=300)
    b.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_DIR", ".")))
    hf_tiny.add_model_commands(sub)
    args = p.parse_args()
    if args.what == "build":
        args.out.mkdir(parents=True, exist_ok=True)
        build(args.family, args.out, args.data, args.steps, args.llama_cpp.resolve())
    elif args.what == "logits":
        logits(args.dir, args.inp, args.out)
    else:
        grads(args.dir, args.inp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
