"""What the Hugging Face oracles of the newer families share: a byte-level BPE vocabulary
trained on the text, a short AdamW training of a tiny model so that no weight keeps its
initial value, llama.cpp's convert_hf_to_gguf.py with the trained vocabulary's
pre-tokenizer named, and HF's own source re-executed with its float32 casts made float64.

Imported by the torch side of the checks/*_hf.py oracles (run under a Python with torch
and transformers, never a dependency of the project); it imports nothing of llamatune.

The converter names a byte-level BPE by the hash of a fixed text's tokens; a vocabulary
trained here has no known hash, so the converter runs with that lookup answering the
split the vocabulary was trained with ("qwen2": Qwen2's regex, then bytes). Nothing else
of the conversion is changed.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
TRAIN_TEXT = SHARED / "data" / "shakespeare.txt"
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_DIR", "llama.cpp"))
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
EOS = "<|endoftext|>"


def train_tokenizer(text: str, out: Path, vocab_size: int = 512, specials: tuple[str, ...] = (EOS,), **named):
    """A byte-level BPE of `vocab_size` tokens with Qwen2's split, saved in `out`; `named`
    are the tokenizer's special-token roles (eos_token=..., bos_token=...)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **({"eos_token": EOS} | named))
    fast.save_pretrained(out)
    return fast


def train(model, ids, steps: int, ctx: int = 64, batch: int = 8, lr: float = 3e-3, seed: int | None = 0,
          label: str = "") -> None:
    """`steps` AdamW steps on `batch` random windows of `ids` (a 1-D token tensor), ctx
    tokens each, drawn by a generator seeded `seed` (None: torch's global generator, left
    where the model's initialisation left it)."""
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - ctx - 1, (batch,), generator=gen)
        rows = torch.stack([ids[s:s + ctx] for s in starts])
        loss = model(input_ids=rows, labels=rows.clone()).loss        # HF shifts the labels itself
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"{label} step {step}: loss {loss.item():.4f}", flush=True)


def perturb_norms(model, std: float = 0.2) -> None:
    """Every norm weight moved off its initial value, so that each one matters."""
    import torch
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(std * torch.randn_like(p))


CONVERT = """import json, pathlib, runpy, sys
sys.path[:0] = [{cpp!r}, {gguf_py!r}]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
if {raw_config!r}:
    base.ModelBase.load_hparams = staticmethod(lambda d, mistral: json.loads((pathlib.Path(d) / "config.json").read_text()))
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def convert(src: Path, out: Path, outtype: str, llama_cpp: Path = LLAMA_CPP, pre: str = "qwen2",
            extra: tuple[str, ...] = (), raw_config: bool = False) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `src` into `out` (f32, q8_0, ...), the trained
    vocabulary's pre-tokenizer named `pre`; raises with its output on failure. `raw_config`:
    the converter reads config.json as saved instead of through AutoConfig (whose to_dict
    drops what a family's config keeps only in its constructor: gemma4's global_head_dim)."""
    code = CONVERT.format(cpp=str(llama_cpp), gguf_py=str(llama_cpp / "gguf-py"), pre=pre, raw_config=raw_config,
                          script=str(llama_cpp / "convert_hf_to_gguf.py"))
    proc = subprocess.run([sys.executable, "-c", code, str(src), "--outfile", str(out), "--outtype", outtype,
                           *extra], capture_output=True, text=True, cwd=llama_cpp)
    if proc.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py {src} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def redo_float64(module, obj, replace: tuple[tuple[str, str], ...] = (("torch.float32", "torch.float64"),
                                                                      (".float()", ".double()"))):
    """`obj` (a function or method of HF's `module`) re-executed from its own source with
    the float32 casts made float64 (or the given replacements), in the module's namespace;
    returns the new function."""
    src = inspect.getsource(inspect.unwrap(obj))
    lines = src.splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    src = "\n".join(ln[indent:] for ln in lines if not ln.lstrip().startswith("@"))
    for old, new in replace:
        src = src.replace(old, new)
    ns = vars(module)
    exec(src, ns)  # noqa: S102
    return ns[obj.__name__]


def logits64(model, tokens: Path, out: Path) -> None:
    """The float64 model's logits (B, T, V) of the token rows in `tokens` (.npy), saved to `out`."""
    import numpy as np
    import torch
    torch.set_num_threads(1)
    with torch.no_grad():
        z = model(input_ids=torch.tensor(np.load(tokens), dtype=torch.long)).logits
    np.save(out, z.numpy())


def grads64(model, inp: Path, out: Path) -> None:
    """The loss sum(w * CE(logits, targets)) of the batch in `inp` (npz: inputs, targets,
    weights) and its gradient with respect to every weight matrix (2-D, and 3-D experts),
    HF names, float64."""
    import numpy as np
    import torch
    torch.set_num_threads(1)
    a = np.load(inp)
    z = model(input_ids=torch.tensor(a["inputs"], dtype=torch.long)).logits
    targets = torch.tensor(a["targets"], dtype=torch.long)
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1).clamp(min=0),
                                           reduction="none")
    loss = (ce * torch.tensor(a["weights"]).reshape(-1)).sum()
    loss.backward()
    res = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None and p.ndim >= 2}
    np.savez(out, loss=loss.detach().numpy(), **res)


def add_model_commands(sub, names: tuple[str, ...] = ("logits", "grads")) -> None:
    """The commands NAME DIR INP OUT of an oracle's command line (`sub`: its subparsers):
    a model folder, an input file, an output file."""
    for name in names:
        s = sub.add_parser(name)
        for arg in ("dir", "inp", "out"):
            s.add_argument(arg, type=Path)


def cli(doc: str, build, load64, convert, steps: int = 200) -> None:
    """An oracle's command line: build DIR [--steps (default `steps`) --seed --text],
    convert DIR OUT.gguf [--outtype --llama-cpp] (convert(dir, out, outtype, llama_cpp)),
    logits DIR TOKENS OUT, grads DIR BATCH OUT (of load64(DIR))."""
    import argparse
    import json
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--steps", type=int, default=steps)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--text", type=Path, default=TRAIN_TEXT)
    c = sub.add_parser("convert")
    c.add_argument("dir", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--outtype", default="f32")
    c.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP)
    add_model_commands(sub)
    a = ap.parse_args()
    if a.cmd == "build":
        a.dir.mkdir(parents=True, exist_ok=True)
        build(a.dir, a.steps, a.seed, a.text)
        (a.dir / "oracle.json").write_text(json.dumps(dict(steps=a.steps, seed=a.seed)) + "\n")
    elif a.cmd == "convert":
        convert(a.dir, a.out, a.outtype, a.llama_cpp)
    else:
        (logits64 if a.cmd == "logits" else grads64)(load64(a.dir), a.inp, a.out)
