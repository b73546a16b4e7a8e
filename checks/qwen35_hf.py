"""A tiny Qwen3.5 text model made by HF transformers, converted by llama.cpp's
convert_hf_to_gguf.py, and HF's float64 logits of it: the oracle of the qwen35 tests.

    PY=<interpreter with torch and transformers>
    $PY checks/qwen35_hf.py build DIR [--steps 120]       # tokenizer, model, a short training
    $PY checks/qwen35_hf.py convert DIR OUT.gguf --outtype f32|q8_0 --llama-cpp LLAMA_CPP_DIR
    $PY checks/qwen35_hf.py logits DIR TOKENS.npy OUT.npy  # float64 logits (B, T, V) of token rows
    $PY checks/qwen35_hf.py grads DIR BATCH.npz OUT.npz     # float64 loss and every Linear's weight gradient

Run by the torch interpreter as a script (it imports nothing of llamatune;
checks/hf_tiny.py holds what the HF oracles share); the tests call it as a subprocess
and skip without that interpreter.

The model (Qwen3_5ForCausalLM): 4 layers, full attention every 4th (layers 0-2 gated
delta-net, layer 3 gated full attention), hidden 64, 4 query heads of 16 (2 kv heads),
half of each head rotated (partial_rotary_factor 0.5, mrope_section [2, 1, 1]: for text
the three position rows are equal, so this is plain NEOX rope on 8 of 16 dimensions),
delta-net with 2 q/k heads and 4 value heads of 16 (so the converter's grouped -> tiled
value-head reorder is exercised), a byte-level BPE vocabulary of 512 trained on the
Shakespeare text with Qwen2's pre-tokenizer split. It trains `--steps` AdamW steps of 16
rows of 64 tokens so that no tensor keeps its initial value (norms included).

The converter checks a BPE vocabulary's pre-tokenizer by the hash of a test string's
tokens; a vocabulary trained here has no known hash, so `convert` runs the converter
with `get_vocab_base_pre` answering "qwen2" (the split the vocabulary was trained with).
Nothing else of the converter is changed.

`logits` runs HF's modules in float64 throughout: the layers' float32 casts (the norms'
`.float()`, the delta rule's and the gated norm's `torch.float32`) are made float64 by
executing HF's own source with those casts replaced (as checks/deltanet_hf.py does).
The rotary tables stay HF's float32 ones, as llama.cpp's are float32.
"""
from __future__ import annotations

from pathlib import Path

if __package__:
    from checks import hf_tiny
else:                                          # run as a script: checks/ is on the path
    import hf_tiny

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, full_attention_interval=4,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True))


def build(out: Path, steps: int, seed: int, text_path: Path) -> None:
    """Tokenizer, model and a short training, saved in `out` (safetensors). The training
    windows are 65 tokens, the labels the last 64 of them (which HF shifts once more):
    its own loop, not hf_tiny.train's, so that the model stays the one it has been."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(seed)
    text = text_path.read_text(encoding="utf-8")
    tok = hf_tiny.train_tokenizer(text[:500_000], out, CONFIG["vocab_size"])
    cfg = Qwen3_5TextConfig(**CONFIG, eos_token_id=tok.convert_tokens_to_ids(hf_tiny.EOS))
    model = Qwen3_5ForCausalLM(cfg).float()
    hf_tiny.perturb_norms(model, 0.1)         # every norm weight away from its initial value
    ids = torch.tensor(tok(text[:400_000])["input_ids"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=gen)
        rows = torch.stack([ids[s:s + 65] for s in starts])
        loss = model(input_ids=rows[:, :-1], labels=rows[:, 1:].clone()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out)


def _float64_modules():
    """HF's qwen3_5 modules with their float32 casts made float64 (their own source, replaced)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    for fn in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule):
        setattr(m, fn.__name__, hf_tiny.redo_float64(m, fn))
    for cls in (m.Qwen3_5RMSNorm, m.Qwen3_5RMSNormGated, m.Qwen3_5GatedDeltaNet):
        cls.forward = hf_tiny.redo_float64(m, cls.forward)
    return m


def load64(src: Path):
    """The saved model in float64, HF's casts made float64, eager attention."""
    import torch
    _float64_modules()
    from transformers import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM.from_pretrained(src, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    return model


def main() -> None:
    hf_tiny.cli(__doc__, build, load64,
                lambda d, out, outtype, llama_cpp: hf_tiny.convert(d, out, outtype, llama_cpp, extra=("--no-mtp",)),
                steps=120)


if __name__ == "__main__":
    main()
