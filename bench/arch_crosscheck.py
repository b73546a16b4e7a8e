"""Cross-check each architecture against a local llama.cpp build (a script, not a test:
CI has no llama.cpp); the figures go to tests/fixtures/arch_crosscheck.json.

Per architecture, one function builds a small model with some structure (so that
perplexity differences and greedy text mean something) and `check_arch` runs the
same comparisons on it:
  - perplexity, llamatune vs llama-perplexity, on a part of shakespeare-eval.txt: F32
    with llama.cpp's exact settings (-fa off, F32 KV: no activation rounding, the two
    must agree to the printed digits), Q8_0 and Q4_K (llama.cpp rounds activations to
    8 bits: within 0.5 %), each without and with an adapter finetuned by llamatune
    (llama-perplexity --lora; llama.cpp must load every adapter tensor);
  - export-lora: the merged Q8_0 model (types kept) scored by both tools;
  - greedy text (24 tokens) of llama-completion and llamatune generate, without and
    with the adapter.

    python bench/arch_crosscheck.py [--arch phi3 ...] [LLAMA_BIN_DIR]
        [--workdir /tmp/llamatune-arch-crosscheck] [--iters 40] [--scratch-iters 150]
        [--reuse] [--threads 2] [--nice 10]

Shares its runner, logging and parsers with bench/llamacpp_crosscheck.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_crosscheck import (  # noqa: E402
    COMPLETION_DONE_RE,
    CPP_EXACT,
    EVAL,
    PPL_RE,
    PROMPT,
    SHARED,
    TOL_EXACT_PPL_REL,
    TOL_PPL_REL,
    TRAIN,
    Ctx,
    build_log_shim,
    common_prefix,
    completion_text,
    generate_text,
    n_tensors,
    ppl_of,
    print_table,
    rel,
    run_cpp_complete,
)

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "tests" / "fixtures" / "arch_crosscheck.json"
EVAL_CHARS = 12000          # the first characters of shakespeare-eval.txt are scored
TOL_QUANT_PPL_REL = 5e-3    # quantized models: llama.cpp's 8-bit activation rounding (issue: 0.5 %)
QUANTS = ("q8_0", "q4_k")


# ------------------------------------------------------------------------------------ helpers

def requantize(src: Path, dst: Path, outtype: str) -> None:
    """`src` (F32) written again with every matrix in `outtype` by llamatune's writer."""
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.kernels import dequant
    from llamatune.models.config import ModelConfig
    from llamatune.models.modelfile import parse_outtype, vocab_kvs, write_model
    f = GGUFFile(src)
    cfg = ModelConfig.from_metadata(f.metadata, str(src))
    w = {n: dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).reshape(t.shape) for n, t in f.tensors.items()}
    write_model(dst, cfg, w, vocab_kvs(f), parse_outtype(outtype), name=f"crosscheck {outtype}")


def scratch_model(c: Ctx, arch: str, *options) -> Path:
    """A from-scratch model of `arch` trained briefly on shakespeare.txt (some structure)."""
    d = c.work / arch
    model = d / "scratch-LATEST.gguf"
    if c.reuse and model.exists():
        print(f"  (reusing {model})")
        return model
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    c.lt(f"train-from-scratch {arch}", "train-from-scratch", "--arch", arch, "--train-data", TRAIN,
         "--vocab-size", "1000", "--ctx", "64", "--batch", "8", "--adam-iter", c.scratch_iters, "--adam-alpha", "1e-3",
         "--save-every", "0", "--threads", c.threads, "--checkpoint-out", d / "chk-ITERATION.gguf",
         "--model-out", d / "scratch-ITERATION.gguf", *options)
    return model


# ------------------------------------------------------------------------------------ architectures

def longrope(cfg):
    """`cfg` given Phi-3.5's kind of rope (phi3_model), and its two factor vectors."""
    n_ctx_train, n_ctx_orig, n_rot = 512, 256, cfg.head_dim * 3 // 4
    cfg = dataclasses.replace(cfg, n_ctx_train=n_ctx_train, n_ctx_orig=n_ctx_orig, n_rot=n_rot,
                              rope_attn_factor=math.sqrt(1 + math.log(n_ctx_train / n_ctx_orig) / math.log(n_ctx_orig)))
    return cfg, {"rope_factors_long.weight": np.geomspace(1.0, 8.0, n_rot // 2).astype(np.float32),
                 "rope_factors_short.weight": np.linspace(1.0, 1.2, n_rot // 2).astype(np.float32)}


def seeded_phi3(d: Path, vocab: Path) -> tuple[Path, Path]:
    """A phi3 of seeded random weights with longrope (as phi3_model) and Phi-3's vocabulary,
    and a seeded random adapter on attn_qkv, attn_output, ffn_up and ffn_down: rebuilt
    bit for bit anywhere from numpy's seeded generator, so tests/test_arch_phi3.py checks
    llamatune against the llama.cpp figures recorded for it without llama.cpp."""
    from llamatune.formats.adapter import LoraAdapter, write_adapter
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.arch import tensor_shape
    from llamatune.models.config import ModelConfig
    from llamatune.models.modelfile import random_weights, vocab_kvs, write_model
    f = GGUFFile(vocab)
    cfg, factors = longrope(ModelConfig(arch="phi3", n_vocab=len(f.metadata["tokenizer.ggml.tokens"]),
                                        n_ctx_train=512, n_embd=64, n_layer=2, n_ff=128, n_head=4, n_head_kv=2,
                                        head_dim=16, n_rot=16, norm_eps=1e-5))
    model, adapter = d / "phi3-seeded-f32.gguf", d / "phi3-seeded-adapter.gguf"
    write_model(model, cfg, random_weights(cfg, seed=11, std=0.3) | factors, vocab_kvs(f), name="seeded test model")
    rng, lora = np.random.default_rng(12), LoraAdapter("phi3", 8.0)
    for i in range(cfg.n_layer):
        for kind in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"):
            n_out, n_in = tensor_shape(cfg, kind)
            lora.pairs[f"blk.{i}.{kind}.weight"] = (rng.normal(0, 0.2, (4, n_in)).astype(np.float32),
                                                    rng.normal(0, 0.2, (n_out, 4)).astype(np.float32))
    write_adapter(adapter, lora)
    return model, adapter


def phi3_model(c: Ctx) -> Path:
    """phi3 from scratch (fused attn_qkv / ffn_up, NEOX), then given Phi-3.5 / Phi-4-mini's
    rope: su/longrope factors (rope_factors_long / _short), attention factor
    sqrt(1 + ln(scale) / ln(n_ctx_orig)) as the converter computes it, an original context
    of 256 in a context length of 512 (llama.cpp pads -c to a multiple of 256, so -c 64
    rotates with the short factors and -c 320 with the long ones) and 3/4 of each head
    rotated. The rope change is applied after training: the adapter finetuned on it by
    check_arch relearns some of what it breaks."""
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.kernels import dequant
    from llamatune.models.config import ModelConfig
    from llamatune.models.modelfile import vocab_kvs, write_model
    out = c.work / "phi3" / "phi3-longrope-f32.gguf"
    if c.reuse and out.exists():
        return out
    src = scratch_model(c, "phi3", "--embd", "256", "--head", "8", "--head-kv", "4", "--layer", "2", "--ff", "512")
    f = GGUFFile(src)
    cfg = ModelConfig.from_metadata(f.metadata, str(src))
    w = {n: dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).reshape(t.shape) for n, t in f.tensors.items()}
    cfg, factors = longrope(cfg)
    write_model(out, cfg, w | factors, vocab_kvs(f), name="longrope test model")   # a "phi3" name makes llama.cpp
    #                                      look for Phi-3 chat tokens (llama-vocab.cpp) this vocabulary lacks
    return out


# name -> (model builder, contexts to score, seeded model builder or None)
ARCHS = {"phi3": (phi3_model, (64, 320), lambda d: seeded_phi3(d, SHARED / "vocab" / "ggml-vocab-phi-3.gguf"))}
SEEDED_CHARS = 4000         # the seeded models' text: the first characters of shakespeare-eval.txt


# ------------------------------------------------------------------------------------ the checks

def check_arch(c: Ctx, arch: str, build, contexts) -> dict:
    print(f"{arch}: model", flush=True)
    f32 = build(c)
    d = f32.parent
    models = {"f32": f32}
    for q in QUANTS:
        models[q] = d / f"{arch}-{q}.gguf"
        if not (c.reuse and models[q].exists()):
            requantize(f32, models[q], q)
    text = d / "eval-part.txt"
    text.write_text(EVAL.read_text(encoding="utf-8")[:EVAL_CHARS], encoding="utf-8")

    print(f"{arch}: adapter", flush=True)
    adapter = d / "adapter-LATEST.gguf"
    if not (c.reuse and adapter.exists()):
        c.lt(f"finetune {arch}", "finetune", "--model-base", f32, "--train-data", TRAIN, "-c", "64", "-b", "8",
             "--lora-r", "8", "--adam-iter", c.iters, "--adam-alpha", "2e-3", "--save-every", "0",
             "--threads", c.threads, "--checkpoint-out", d / "chk-lora-ITERATION.gguf",
             "--lora-out", d / "adapter-ITERATION.gguf")
    n_lora = n_tensors(adapter)
    merged = d / f"{arch}-q8_0-merged.gguf"
    c.lt(f"export-lora {arch}", "export-lora", "-m", models["q8_0"], "--lora", adapter, "-o", merged)

    figures = {"eval_chars": EVAL_CHARS, "adapter_tensors": n_lora, "ppl": [], "greedy": []}
    print(f"{arch}: perplexity", flush=True)
    cases = [(name, path, lora) for name, path in models.items() for lora in (False, True)]
    cases.append(("q8_0 merged", merged, False))
    for n_ctx in contexts:
        for name, path, lora in cases:
            label = f"{arch} {name}{' +lora' if lora else ''} c={n_ctx}"
            extra = ["--lora", adapter] if lora else []
            p_lt = ppl_of(c.lt(f"llamatune ppl {label}", "perplexity", "-m", path, "-f", text, "-c", n_ctx,
                               "-b", n_ctx, *extra), label)
            args = [c.cpp("llama-perplexity"), "-m", path, "-f", text, "-c", n_ctx, "-b", n_ctx,
                    "-t", c.threads, *extra, *(CPP_EXACT if name == "f32" else [])]
            out = run_cpp_complete(c, f"llama-perplexity {label}", args + (["-v"] if lora else []), PPL_RE)
            if lora and f"loaded {n_lora} tensors from lora file" not in out:
                raise RuntimeError(f"{label}: llama.cpp did not load the adapter's {n_lora} tensors")
            p_cpp = ppl_of(out, label)
            tol = TOL_EXACT_PPL_REL if name == "f32" else TOL_QUANT_PPL_REL
            c.add(arch, f"PPL {label}" + (" (llama.cpp exact)" if name == "f32" else ""), f"{p_lt:.4f}",
                  f"{p_cpp:.4f}", f"{rel(p_lt, p_cpp):+.2e} rel", abs(rel(p_lt, p_cpp)) < tol)
            figures["ppl"].append({"model": name, "lora": lora, "n_ctx": n_ctx, "llamatune": round(p_lt, 4),
                                   "llama_cpp": round(p_cpp, 4), "exact": name == "f32"})

    print(f"{arch}: greedy text", flush=True)
    for n_ctx in contexts:
        for lora in (False, True):
            label = f"{arch}{' +lora' if lora else ''} c={n_ctx}"
            extra = ["--lora", adapter] if lora else []
            out = run_cpp_complete(c, f"llama-completion {label}",
                                   [c.cpp("llama-completion"), "-m", f32, "-p", PROMPT, "-n", 24, "--temp", 0,
                                    "-no-cnv", "-t", c.threads, "--no-warmup", "-c", n_ctx, *extra, *CPP_EXACT],
                                   COMPLETION_DONE_RE, stdout_only=True)
            g_cpp = completion_text(out)
            g_lt = generate_text(c.lt(f"llamatune generate {label}", "generate", "-m", f32, "-p", PROMPT, "-n", 24,
                                      "--temp", 0, "-c", n_ctx, *extra, stdout_only=True))
            same = g_lt == g_cpp
            c.add(arch, f"greedy 24 tokens from {PROMPT!r}, {label}", repr(g_lt[:40]), repr(g_cpp[:40]),
                  "identical" if same else f"differ after {common_prefix(g_lt, g_cpp)} chars", same)
            figures["greedy"].append({"lora": lora, "n_ctx": n_ctx, "llamatune": g_lt, "llama_cpp": g_cpp})
    return figures


def check_seeded(c: Ctx, arch: str, build, contexts) -> list[dict]:
    """F32 perplexity of the seeded model (exact settings), without and with its adapter."""
    d = c.work / arch / "seeded"
    d.mkdir(parents=True, exist_ok=True)
    model, adapter = build(d)
    text = d / "eval-seeded.txt"
    text.write_text(EVAL.read_text(encoding="utf-8")[:SEEDED_CHARS], encoding="utf-8")
    rows = []
    for n_ctx in contexts:
        for lora in (False, True):
            label = f"{arch} seeded{' +lora' if lora else ''} c={n_ctx}"
            extra = ["--lora", adapter] if lora else []
            p_lt = ppl_of(c.lt(f"llamatune ppl {label}", "perplexity", "-m", model, "-f", text, "-c", n_ctx,
                               "-b", n_ctx, *extra), label)
            p_cpp = ppl_of(run_cpp_complete(c, f"llama-perplexity {label}", [
                c.cpp("llama-perplexity"), "-m", model, "-f", text, "-c", n_ctx, "-b", n_ctx, "-t", c.threads,
                *extra, *CPP_EXACT], PPL_RE), label)
            c.add(arch, f"PPL {label} (llama.cpp exact)", f"{p_lt:.4f}", f"{p_cpp:.4f}",
                  f"{rel(p_lt, p_cpp):+.2e} rel", abs(rel(p_lt, p_cpp)) < TOL_EXACT_PPL_REL)
            rows.append({"lora": lora, "n_ctx": n_ctx, "llamatune": round(p_lt, 4), "llama_cpp": round(p_cpp, 4)})
    return rows


def record(arch: str, figures: dict) -> None:
    """Write one architecture's figures into the shared fixture, keeping the others'."""
    data = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    data[arch] = figures
    FIGURES.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bin", nargs="?", default="/work/llamacpp/build/bin")
    ap.add_argument("--arch", action="append", choices=sorted(ARCHS), help="default: every one")
    ap.add_argument("--workdir", default="/tmp/llamatune-arch-crosscheck")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--scratch-iters", type=int, default=150)
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nice", type=int, default=10)
    a = ap.parse_args()
    work = Path(a.workdir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    c = Ctx(Path(a.bin), Path(sys.executable), work, a.threads, a.nice, a.reuse, a.iters, a.scratch_iters,
            [sys.executable, "-m", "llamatune.cli.main"])
    c.log_shim, note = build_log_shim(work)
    print(note)
    for arch in a.arch or sorted(ARCHS):
        build, contexts, seeded = ARCHS[arch]
        figures = {"seeded": check_seeded(c, arch, seeded, contexts)} if seeded else {}
        record(arch, figures | check_arch(c, arch, build, contexts))
    print_table(c)
    return 0 if all(r.ok is not False for r in c.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
