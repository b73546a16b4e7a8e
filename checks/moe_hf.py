"""A tiny Qwen3-MoE made by Hugging Face transformers, its GGUF files made by llama.cpp's
own converter, and HF's float64 logits (and autograd gradients) on given ids: the
oracle of the qwen3moe tests and checks.

    python -m checks.moe_hf make DIR --torch-python PATH [--llama-cpp DIR] [--steps 300]
    python -m checks.moe_hf logits DIR IDS.npy OUT.npz --torch-python PATH

`make` writes into DIR: `hf/` (the model and its tokenizer), `qwen3moe-f32.gguf` and
`qwen3moe-q8_0.gguf`. The model: Qwen3MoeForCausalLM, 2 layers, hidden 64, 4 query
heads and 2 kv heads of 16, 8 experts of 32 with 2 active, norm_topk_prob as
Qwen3-30B-A3B has it, untied head; trained `--steps` AdamW steps on shakespeare.txt
(ctx 64, batch 8) so that routers and experts are not random. Its tokenizer is a
byte-level BPE of 512 tokens trained on the same text with Qwen2's pre-tokenizer
(regex split, then bytes). llama.cpp's converter names a BPE pre-tokenizer by the hash
of a known tokenizer's ids, which a tokenizer trained here cannot have: the converter
runs with that lookup answering "qwen2" (the regex the tokenizer was built with) and is
otherwise untouched.

`logits` runs the saved model in float64 on ids (B, T) int64 and writes `logits`
(B, T, V). HF computes the router's and the attention's softmax, RMSNorm and the rope
tables in float32 even in a float64 model; the check runs those lines with the casts made float64.

PATH is a Python with torch and transformers (>= 5, whose Qwen3-MoE experts are 3-D
tensors); this repository's environment needs neither: the torch side is this file
run under PATH with `--hf-side`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

if __package__:
    from . import hf_tiny
else:                                          # run as a script under the torch Python
    import hf_tiny

LLAMA_CPP, TRAIN_TEXT = hf_tiny.LLAMA_CPP, hf_tiny.TRAIN_TEXT

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
              mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=256,
              rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, rms_norm_eps=1e-6,
              router_aux_loss_coef=0.0, bos_token_id=None, eos_token_id=0, pad_token_id=None)


# --------------------------------------------------------------------------- the torch side
def _make_hf(out: Path, steps: int) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    torch.set_num_threads(1)                  # tiny products: threads would only wait on each other
    text = TRAIN_TEXT.read_text(encoding="utf-8")
    tok = hf_tiny.train_tokenizer(text, out, CONFIG["vocab_size"])
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    hf_tiny.perturb_norms(model, 0.2)         # norms off 1 so that every weight matters
    hf_tiny.train(model, ids, steps, seed=None, label="qwen3moe")   # windows from the seeded global generator
    model.save_pretrained(out)


def _float64_throughout():
    """HF's Qwen3-MoE with the float32 steps of its float64 run made float64: the router's
    softmax (`dtype=torch.float`), RMSNorm (`.to(torch.float32)`), the rope tables
    (float32 inverse frequencies and angles) and the attention's softmax (its source with
    the cast removed); their own lines otherwise."""
    import inspect

    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    def norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rope(self, x, position_ids):
        dim = self.inv_freq.shape[0] * 2
        base = self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(router_logits, dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value, router_indices
    m.Qwen3MoeTopKRouter.forward = forward
    m.Qwen3MoeRMSNorm.forward = norm
    m.Qwen3MoeRotaryEmbedding.forward = rope
    src = inspect.getsource(m.eager_attention_forward)        # its softmax: dtype=torch.float32
    assert src.count(", dtype=torch.float32)") == 1
    exec(src.replace(", dtype=torch.float32)", ")"), m.__dict__)


def _load(model_dir: Path):
    import torch
    from transformers import Qwen3MoeForCausalLM
    torch.set_num_threads(1)
    _float64_throughout()
    return Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager",
                                               experts_implementation="eager")


def save_logits(model, ids_path: Path, out: Path) -> None:
    """The model's logits (B, T, V) on the ids (B, T) in `ids_path` (.npy), saved as `logits` in `out`."""
    import torch
    ids = torch.from_numpy(np.load(ids_path))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    np.savez(out, logits=logits.numpy())


def _logits(model_dir: Path, ids_path: Path, out: Path) -> None:
    save_logits(_load(model_dir), ids_path, out)


HF_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}


def save_lora_grads(model, inp: Path, out: Path, other_pair=None) -> None:
    """Loss (mean cross-entropy of ids[:, 1:] after ids[:, :-1]) and the autograd gradients
    of the LoRA pairs whose values are given (scaling alpha / r, no dropout), saved in `out`:
    inp holds ids, alpha, r and `blk.I.KIND.lora_a` / `.lora_b` arrays in llama.cpp's layout
    (A (r, n_in), B (n_out, r): PEFT's lora_A / lora_B weights). Attention's pairs are
    PEFT's on `model`; other_pair(peft_model, layer, kind, A, B, alpha / r) puts any other
    kind's pair in place and returns its (A, B) tensors (gpt-oss's experts)."""
    import torch
    from peft import LoraConfig, get_peft_model
    d = dict(np.load(inp))
    r, alpha = int(d.pop("r")), float(d.pop("alpha"))
    ids = torch.from_numpy(d.pop("ids"))
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                             target_modules=sorted({m.split(".")[-1] for m in HF_MODULES.values()})))
    params = dict(model.named_parameters())
    ours = {}
    for name in sorted({n.rsplit(".", 1)[0] for n in d}):                 # blk.I.KIND
        _, i, kind = name.split(".")
        if kind not in HF_MODULES:
            pair = other_pair(model, int(i), kind, d[f"{name}.lora_a"], d[f"{name}.lora_b"], alpha / r)
            ours |= {f"{name}.lora_a": pair[0], f"{name}.lora_b": pair[1]}
            continue
        hf = f"base_model.model.model.layers.{i}.{HF_MODULES[kind]}"
        for side, key in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            p = params[f"{hf}.{key}.default.weight"]
            with torch.no_grad():
                p.copy_(torch.from_numpy(d[f"{name}.{side}"]))
            ours[f"{name}.{side}"] = p
    logits = model(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    np.savez(out, loss=loss.item(), **{n: p.grad.numpy() for n, p in ours.items()})


def _grads(model_dir: Path, inp: Path, out: Path) -> None:
    """save_lora_grads of LoRA pairs on attention."""
    save_lora_grads(_load(model_dir), inp, out)


def hf_side(argv: list[str], make_hf, logits, grads) -> None:
    """The torch side's commands: make DIR STEPS (make_hf), convert DIR OUT OUTTYPE,
    logits DIR IDS OUT [EXTRA...], grads DIR IN OUT."""
    what, *args = argv
    if what == "make":
        make_hf(Path(args[0]), int(args[1]))
    elif what == "convert":
        hf_tiny.convert(Path(args[0]), Path(args[1]), args[2])
    elif what == "logits":
        logits(Path(args[0]), Path(args[1]), Path(args[2]), *args[3:])
    elif what == "grads":
        grads(Path(args[0]), Path(args[1]), Path(args[2]))
    else:
        raise SystemExit(f"unknown hf-side command {what}")


# --------------------------------------------------------------------------- this side
def hf_run(torch_python: str, *args, script: str = __file__) -> None:
    """`script` (this file, or a sibling check's) under the torch Python (`--hf-side`), with
    llama.cpp's converter and gguf-py importable; raises with its output on failure."""
    cmd = [torch_python, str(Path(script).resolve()), "--hf-side", *map(str, args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(LLAMA_CPP), str(LLAMA_CPP / "gguf-py")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def make(work: Path, torch_python: str, steps: int = 300, arch: str = "qwen3moe",
         script: str = __file__) -> dict[str, Path]:
    """The HF model (work/hf) of `script`'s oracle and its GGUF files by llama.cpp's converter
    (F32, Q8_0: work/ARCH-f32.gguf, ...); reused where they exist. Returns {"hf", "f32",
    "q8_0"} paths."""
    work.mkdir(parents=True, exist_ok=True)
    paths = {"hf": work / "hf", "f32": work / f"{arch}-f32.gguf", "q8_0": work / f"{arch}-q8_0.gguf"}
    if not (paths["hf"] / "config.json").exists():
        hf_run(torch_python, "make", paths["hf"], steps, script=script)
    for outtype in ("f32", "q8_0"):
        if not paths[outtype].exists():
            hf_run(torch_python, "convert", paths["hf"], paths[outtype], outtype, script=script)
    return paths


def hf_logits(torch_python: str, model_dir: Path, ids: np.ndarray, work: Path, peft_dir: Path | None = None,
              script: str = __file__) -> np.ndarray:
    """HF's float64 logits (B, T, V) on ids (B, T), with the PEFT adapter `peft_dir` where
    given (gpt-oss's oracle)."""
    np.save(work / "ids.npy", np.asarray(ids, np.int64))
    hf_run(torch_python, "logits", model_dir, work / "ids.npy", work / "logits.npz", *([peft_dir] if peft_dir else []),
           script=script)
    return np.load(work / "logits.npz")["logits"]


def hf_lora_grads(torch_python: str, model_dir: Path, ids: np.ndarray, lora: dict[str, np.ndarray], r: int,
                  alpha: float, work: Path, script: str = __file__) -> dict[str, np.ndarray]:
    """HF's float64 loss ("loss") and the gradients of the LoRA pairs `lora` (names
    `blk.I.KIND.weight.lora_a` / `.lora_b`: attention kinds, and the experts' with gpt-oss's
    oracle) on ids (B, T + 1)."""
    np.savez(work / "grads-in.npz", ids=np.asarray(ids, np.int64), r=r, alpha=alpha,
             **{n.replace(".weight.", "."): a for n, a in lora.items()})
    hf_run(torch_python, "grads", model_dir, work / "grads-in.npz", work / "grads.npz", script=script)
    out = dict(np.load(work / "grads.npz"))
    return {"loss": float(out.pop("loss"))} | {n.replace(".lora_", ".weight.lora_"): a for n, a in out.items()}


def command_line(argv, doc: str, side, make, hf_logits, llama_bin: bool = False) -> int:
    """An oracle's command line: `--hf-side COMMAND ...` (under the torch Python: side's
    commands), `make DIR` (its paths printed as JSON) or `logits DIR IDS.npy OUT.npz`,
    with --torch-python, --steps and, where `llama_bin`, --llama-bin (make's 4th argument)."""
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--hf-side":
        side(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("what", choices=["make", "logits"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--torch-python", required=True)
    ap.add_argument("--steps", type=int, default=300)
    if llama_bin:
        ap.add_argument("--llama-bin", type=Path, default=LLAMA_CPP / "build" / "bin")
    a = ap.parse_args(argv)
    if a.what == "make":
        paths = make(Path(a.paths[0]), a.torch_python, a.steps, *([a.llama_bin] if llama_bin else []))
        print(json.dumps({k: str(v) for k, v in paths.items()}))
    else:
        d, ids, out = map(Path, a.paths)
        np.savez(out, logits=hf_logits(a.torch_python, d / "hf", np.load(ids), out.parent))
    return 0


def main(argv=None) -> int:
    return command_line(argv, __doc__, lambda argv: hf_side(argv, _make_hf, _logits, _grads), make, hf_logits)


if __name__ == "__main__":
    sys.exit(main())
