"""A tiny Qwen3.5 text model made by HF transformers, converted by llama.cpp's
convert_hf_to_gguf.py, and HF's float64 logits of it: the oracle of the qwen35 tests.

    PY=<interpreter with torch and transformers>
    $PY checks/qwen35_hf.py build DIR [--steps 120]       # tokenizer, model, a short training
    $PY checks/qwen35_hf.py convert DIR OUT.gguf --outtype f32|q8_0 --llama-cpp LLAMA_CPP_DIR
    $PY checks/qwen35_hf.py logits DIR TOKENS.npy OUT.npy  # float64 logits (B, T, V) of token rows
    $PY checks/qwen35_hf.py grads DIR BATCH.npz OUT.npz     # float64 loss and every Linear's weight gradient

Run by the torch interpreter as a script (it imports nothing of llamatune); the tests
call it as a subprocess and skip without that interpreter.

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

import argparse
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SHAKESPEARE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "shakespeare.txt"
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, full_attention_interval=4,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True))
EOS = "<|endoftext|>"


def _tokenizer(text: str, out: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(out)
    return fast


def build(out: Path, steps: int, seed: int, text_path: Path) -> None:
    """Tokenizer, model and a short training, saved in `out` (safetensors)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(seed)
    text = text_path.read_text(encoding="utf-8")
    tok = _tokenizer(text[:500_000], out)
    cfg = Qwen3_5TextConfig(**CONFIG, eos_token_id=tok.convert_tokens_to_ids(EOS))
    model = Qwen3_5ForCausalLM(cfg).float()
    with torch.no_grad():                     # every norm weight away from its initial value
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.tensor(tok(text[:400_000])["input_ids"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=gen)
        rows = torch.stack([ids[s:s + 65] for s in starts])
        loss = model(input_ids=rows[:, :-1], labels=rows[:, 1:].clone()).loss   # HF shifts labels itself
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out)


# run by the converter's interpreter: its own script, the pre-tokenizer check answered
CONVERT = """import runpy, sys
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
script = sys.argv[1]
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def convert(src: Path, out: Path, outtype: str, llama_cpp: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `src`, the tiny vocabulary's pre-tokenizer named qwen2."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama_cpp / "gguf-py"), str(llama_cpp)]))
    subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp / "convert_hf_to_gguf.py"), str(src),
                    "--outfile", str(out), "--outtype", outtype, "--no-mtp"], env=env, check=True)


def _float64_modules():
    """HF's qwen3_5 modules with their float32 casts made float64 (their own source, replaced)."""
    import torch  # noqa: F401
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    ns = dict(vars(m))

    def redo(obj):
        src = inspect.getsource(inspect.unwrap(obj))
        lines = src.splitlines()
        indent = len(lines[0]) - len(lines[0].lstrip())
        src = "\n".join(ln[indent:] for ln in lines if not ln.lstrip().startswith("@"))
        exec(src.replace("torch.float32", "torch.float64").replace(".float()", ".double()"), ns)  # noqa: S102
        return ns[obj.__name__]
    for fn in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule):
        setattr(m, fn.__name__, redo(fn))
    for cls in (m.Qwen3_5RMSNorm, m.Qwen3_5RMSNormGated):
        cls.forward = redo(cls.forward)
    m.Qwen3_5GatedDeltaNet.forward = redo(m.Qwen3_5GatedDeltaNet.forward)
    return m


def load64(src: Path):
    """The saved model in float64, HF's casts made float64, eager attention."""
    import torch
    _float64_modules()
    from transformers import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM.from_pretrained(src, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    return model


def logits(src: Path, tokens: Path, out: Path) -> None:
    import torch
    model = load64(src)
    ids = torch.tensor(np.load(tokens), dtype=torch.long)
    with torch.no_grad():
        z = model(input_ids=ids).logits
    np.save(out, z.numpy())


def grads(src: Path, inp: Path, out: Path) -> None:
    """The loss sum(w * CE(logits, targets)) of the batch in `inp` (npz: inputs, targets,
    weights) and its gradient with respect to every Linear weight, HF names, float64."""
    import torch
    model = load64(src)
    a = np.load(inp)
    logits = model(input_ids=torch.tensor(a["inputs"], dtype=torch.long)).logits
    targets = torch.tensor(a["targets"], dtype=torch.long)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).clamp(min=0),
                                           reduction="none")
    loss = (ce * torch.tensor(a["weights"]).reshape(-1)).sum()
    loss.backward()
    res = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None and p.ndim == 2}
    np.savez(out, loss=loss.detach().numpy(), **res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--steps", type=int, default=120)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--text", type=Path, default=SHAKESPEARE)
    c = sub.add_parser("convert")
    c.add_argument("dir", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--outtype", default="f32")
    c.add_argument("--llama-cpp", type=Path, required=True)
    gr = sub.add_parser("grads")
    gr.add_argument("dir", type=Path)
    gr.add_argument("batch", type=Path)
    gr.add_argument("out", type=Path)
    lg = sub.add_parser("logits")
    lg.add_argument("dir", type=Path)
    lg.add_argument("tokens", type=Path)
    lg.add_argument("out", type=Path)
    a = ap.parse_args()
    if a.cmd == "build":
        a.dir.mkdir(parents=True, exist_ok=True)
        build(a.dir, a.steps, a.seed, a.text)
        (a.dir / "oracle.json").write_text(json.dumps(dict(steps=a.steps, seed=a.seed)) + "\n")
    elif a.cmd == "convert":
        convert(a.dir, a.out, a.outtype, a.llama_cpp)
    elif a.cmd == "grads":
        grads(a.dir, a.batch, a.out)
    else:
        logits(a.dir, a.tokens, a.out)


if __name__ == "__main__":
    main()
