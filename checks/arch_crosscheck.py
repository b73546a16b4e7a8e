"""Cross-check the architectures beyond llama against a local llama.cpp build (a script,
not a test: CI has no llama.cpp). One function per architecture family; phi3 (fused
projections, longrope rope factors at a short and a long context, Q4_K too) has its own
pair, phi3_record and phi3_structured, at the end.

Two parts, per architecture:

  A. recorded figures (`--record`): tiny seeded random-weight models rebuilt by
     tests/test_arch_llamacpp.py (the recipe is `checks/arch_reference.py:llamacpp_models`),
     F32 and Q8_0, each alone and with a seeded random adapter; llama-perplexity on the
     test text (-c 32) is written to tests/fixtures/arch_llamacpp.json, so the test
     compares llamatune's perplexity with llama.cpp's without llama.cpp;
  B. a model with some structure: a random model (vocabulary: SentencePiece trained on
     shakespeare.txt) is finetuned by llamatune (LoRA, every matrix, high rate) and the
     adapter merged in (export-lora): that is the base. A second adapter is trained on it.
     Perplexity of the first EVAL_CHARS of shakespeare-eval.txt (-c 128) in both tools,
     F32 exactly (no activation rounding: -fa off, F32 KV cache) and Q8_0 (llama.cpp
     rounds activations to 8 bits), with and without the adapter (llama-perplexity
     --lora), and the greedy text of both tools for one prompt.

    python -m checks.arch_crosscheck [--arch qwen3,gemma,gemma2,gemma3] [--record]
        [--llama-bin llama.cpp/build/bin] [--workdir /tmp/llamatune-arch-crosscheck]
        [--iters 120] [--threads 2]

Exit status: 0 every check within tolerance, 1 some check failed, 2 aborted.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from checks import llamacpp_crosscheck as lc   # Ctx, the llama.cpp runners and parsers

HERE = Path(__file__).resolve().parent

RECORD = HERE.parent / "tests" / "fixtures" / "arch_llamacpp.json"
PROMPT = "ROMEO:"
TOL_EXACT = 2e-4          # F32, no activation rounding (ggml's CPU gelu is a float16 table: see kernels/geglu.py)
TOL_Q8 = 5e-3             # Q8_0: llama.cpp rounds activations to 8 bits
EVAL_CHARS = 12000        # part B scores the first characters of shakespeare-eval.txt

# the structured models of part B: small, but every option of the family in use
SHAPE = dict(n_vocab=1000, n_ctx_train=256, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, head_dim=32, n_rot=32,
             n_layer=4, norm_eps=1e-6)
FAMILIES = {
    "qwen3": dict(SHAPE, head_dim=48, n_rot=48, rope_freq_base=1e6),          # key_length != n_embd / n_head
    "qwen3moe": dict(SHAPE, head_dim=48, n_rot=48, rope_freq_base=1e6, n_expert=8, n_expert_used=2, n_ff_exp=64),
    "gemma": dict(SHAPE),
    "gemma2": dict(SHAPE, attn_softcap=50.0, final_softcap=30.0, sliding_window=32, swa_pattern=2),
    "gemma3": dict(SHAPE, n_layer=6, sliding_window=32, swa_pattern=6, rope_freq_base=1e6,
                   rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0),
}


def cpp_completion(c: lc.Ctx, label: str, model: Path, lora: list, exact: bool) -> str:
    out = lc.run_cpp_complete(c, label, [c.cpp("llama-completion"), "-m", model, *lora, "-p", PROMPT, "-n", 24,
                                         "--temp", 0, "-no-cnv", "-t", c.threads, "--no-warmup", "-c", 128,
                                         *(lc.CPP_EXACT if exact else [])], lc.COMPLETION_DONE_RE, stdout_only=True)
    return lc.completion_text(out)


def lt_generate(c: lc.Ctx, label: str, model: Path, lora: list) -> str:
    return lc.generate_text(c.lt(label, "generate", "-m", model, *lora, "-p", PROMPT, "-n", 24, "--temp", 0,
                                 "-c", 128, stdout_only=True))


# --------------------------------------------------------------------------- part A: recorded figures
def table_gelu_ppl(case, text: Path) -> float:
    """llamatune's perplexity with ggml's CPU gelu emulated (GGML_GELU_FP16: the gate rounded
    to float16, gelu looked up as float16, x <= -10 -> 0, x >= 10 -> x; ggml-cpu vec.h
    ggml_vec_geglu_f32): what is left against llama.cpp's F32 figure is float32 noise."""
    import llamatune.kernels.geglu as geglu
    from llamatune.commands.perplexity import perplexity
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model

    def table_geglu(h, g, u):
        t = g.astype(np.float16).astype(np.float32)
        y = geglu._gelu_ref(t)[0].astype(np.float32).astype(np.float16).astype(np.float32)
        h[...] = np.where(g <= -10, 0, np.where(g >= 10, g, y)).astype(np.float32) * u
    exact, geglu.geglu_forward = geglu.geglu_forward, table_geglu
    try:
        model = Model(case.model)
        adapters = load_runtime_adapters(model, [(str(case.adapter), 1.0)]) if case.adapter else None
        return perplexity(Runner(model, adapters), text.read_text(), 32, 32).ppl
    finally:
        geglu.geglu_forward = exact


def record(c: lc.Ctx, archs: list[str], no_repack: bool = False) -> None:
    from checks.arch_reference import llamacpp_models
    from conftest import TEXT
    text = c.work / "text.txt"
    text.write_text(TEXT)
    figures = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for case in llamacpp_models(c.work / "recorded", archs):
        out = lc.run_cpp_complete(c, f"llama-perplexity {case.name}", [
            c.cpp("llama-perplexity"), "-m", case.model, "-f", text, "-c", 32, "-b", 32, "-t", c.threads,
            *(["--lora", case.adapter] if case.adapter else []), *(lc.CPP_EXACT if case.exact else []),
            *(["-nr"] if no_repack else [])], lc.PPL_RE)
        cpp = lc.ppl_of(out, case.name)
        lt = lc.ppl_of(c.lt(f"llamatune perplexity {case.name}", "perplexity", "-m", case.model, "-f", text,
                            "-c", 32, "-b", 32, *(["--lora", case.adapter] if case.adapter else [])), case.name)
        figures[case.name] = cpp
        tol = TOL_EXACT if case.exact else TOL_Q8
        c.add("A", case.name, f"{lt:.4f}", f"{cpp:.4f}", f"{lc.rel(lt, cpp):+.2e}", abs(lc.rel(lt, cpp)) < tol)
        if case.exact and case.name.startswith("gemma"):
            emu = table_gelu_ppl(case, text)
            c.add("A", case.name + " (ggml gelu table)", f"{emu:.4f}", f"{cpp:.4f}", f"{lc.rel(emu, cpp):+.2e}", None)
    RECORD.write_text(json.dumps(dict(sorted(figures.items())), indent=1) + "\n")
    print(f"  recorded {RECORD}")


# --------------------------------------------------------------------------- part B: structured models
def structured(c: lc.Ctx, arch: str, vocab: list) -> None:
    from gguf import GGMLQuantizationType as QType
    from checks.arch_reference import random_model_weights
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import vocab_kvs, write_model
    d = c.work / arch
    d.mkdir(exist_ok=True)
    n_vocab = len(next(k.value for k in vocab if k.key == "tokenizer.ggml.tokens"))
    cfg = ModelConfig(arch=arch, **(FAMILIES[arch] | dict(n_vocab=n_vocab)))
    init, base = d / "init-f32.gguf", d / "base-f32.gguf"
    train = ["--train-data", lc.TRAIN, "--ctx", 64, "--batch", 8, "--warmup", 4, "--save-every", 0, "--seed", 1]
    if not (c.reuse and base.exists()):
        write_model(init, cfg, random_model_weights(cfg, seed=7, std=0.05), vocab, QType.F32)
        c.lt(f"{arch}: structure (finetune)", "finetune", "--model-base", init, *train, "--lora-r", 32,
             "--adam-iter", c.iters, "--adam-alpha", 1e-2, "--rank-att-norm", 4, "--rank-ffn-norm", 4,
             "--checkpoint-out", d / "s-chk-ITERATION.gguf", "--lora-out", d / "s-adapter-ITERATION.gguf")
        c.lt(f"{arch}: merge structure", "export-lora", "-m", init, "--lora", d / "s-adapter-LATEST.gguf", "-o", base)
    adapter = d / "adapter-LATEST.gguf"
    if not (c.reuse and adapter.exists()):
        c.lt(f"{arch}: adapter (finetune)", "finetune", "--model-base", base, *train, "--lora-r", 8,
             "--adam-iter", max(1, c.iters // 4), "--adam-alpha", 3e-3,
             "--checkpoint-out", d / "chk-ITERATION.gguf", "--lora-out", d / "adapter-ITERATION.gguf")
    q8 = d / "base-q8_0.gguf"
    f = GGUFFile(base)
    tensors = {n: np.array(t.data, np.float32).reshape(t.shape) for n, t in f.tensors.items()}   # F32 base
    write_model(q8, ModelConfig.from_metadata(f.metadata, str(base)), tensors, vocab_kvs(f), QType.Q8_0)

    text = d / "eval-part.txt"
    text.write_text(lc.EVAL.read_text(encoding="utf-8")[:EVAL_CHARS], encoding="utf-8")
    for label, model, exact in (("F32 exact", base, True), ("Q8_0", q8, False)):
        for with_lora in (False, True):
            lora = ["--lora", adapter] if with_lora else []
            name = f"{arch} {label}" + (" +adapter" if with_lora else "")
            cpp = lc.ppl_of(lc.run_cpp_complete(c, f"llama-perplexity {name}", [
                c.cpp("llama-perplexity"), "-m", model, "-f", text, "-c", 128, "-b", 128, "-t", c.threads, *lora,
                *(lc.CPP_EXACT if exact else [])], lc.PPL_RE), name)
            lt = lc.ppl_of(c.lt(f"llamatune perplexity {name}", "perplexity", "-m", model, "-f", text, "-c", 128,
                                "-b", 128, *lora), name)
            tol = TOL_EXACT if exact else TOL_Q8
            c.add("B", f"ppl {name}", f"{lt:.4f}", f"{cpp:.4f}", f"{lc.rel(lt, cpp):+.2e}", abs(lc.rel(lt, cpp)) < tol)
    for with_lora in (False, True):
        lora = ["--lora", adapter] if with_lora else []
        name = f"{arch} greedy F32" + (" +adapter" if with_lora else "")
        a, b = lt_generate(c, f"llamatune generate {name}", base, lora), cpp_completion(c, f"llama-completion {name}",
                                                                                       base, lora, exact=True)
        n = lc.common_prefix(a, b)
        c.add("B", name, repr(a), repr(b), f"same {n}/{max(len(a), len(b))} chars", a == b)


# --------------------------------------------------------------------------- phi3 (fused projections, longrope)
PHI3_RECORD = HERE.parent / "tests" / "fixtures" / "arch_llamacpp_phi3.json"
PHI3_SCRATCH_ITERS = 150     # train-from-scratch steps that give the phi3 its structure
QUANTS = ("q8_0", "q4_k")    # phi3's rows are 256 wide: Q4_K blocks fit


def requantize(src: Path, dst: Path, outtype: str) -> None:
    """`src` (F32) written again with every matrix in `outtype` by llamatune's writer."""
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.kernels import dequant
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import parse_outtype, vocab_kvs, write_model
    f = GGUFFile(src)
    cfg = ModelConfig.from_metadata(f.metadata, str(src))
    w = {n: dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).reshape(t.shape) for n, t in f.tensors.items()}
    write_model(dst, cfg, w, vocab_kvs(f), parse_outtype(outtype), name=f"crosscheck {outtype}")


def phi3_record(c: lc.Ctx) -> None:
    """Part A for phi3: the seeded model of checks/arch_reference.py:seeded_phi3, F32 exactly,
    at a context with the short and one with the long rope factors, without and with its
    adapter; figures to tests/fixtures/arch_llamacpp_phi3.json."""
    from checks.arch_reference import PHI3_CONTEXTS, PHI3_SEEDED_CHARS, seeded_phi3
    d = c.work / "phi3" / "seeded"
    model, adapter = seeded_phi3(d, lc.SHARED / "vocab" / "ggml-vocab-phi-3.gguf")
    text = d / "eval-seeded.txt"
    text.write_text(lc.EVAL.read_text(encoding="utf-8")[:PHI3_SEEDED_CHARS], encoding="utf-8")
    figures = []
    for n_ctx in PHI3_CONTEXTS:
        for with_lora in (False, True):
            name = f"phi3 seeded F32 c={n_ctx}" + (" +adapter" if with_lora else "")
            lora = ["--lora", adapter] if with_lora else []
            lt = lc.ppl_of(c.lt(f"llamatune perplexity {name}", "perplexity", "-m", model, "-f", text, "-c", n_ctx,
                                "-b", n_ctx, *lora), name)
            cpp = lc.ppl_of(lc.run_cpp_complete(c, f"llama-perplexity {name}", [
                c.cpp("llama-perplexity"), "-m", model, "-f", text, "-c", n_ctx, "-b", n_ctx, "-t", c.threads,
                *lora, *lc.CPP_EXACT], lc.PPL_RE), name)
            c.add("A", name, f"{lt:.4f}", f"{cpp:.4f}", f"{lc.rel(lt, cpp):+.2e}", abs(lc.rel(lt, cpp)) < 2e-5)
            figures.append({"n_ctx": n_ctx, "lora": with_lora, "llama_cpp": cpp})
    PHI3_RECORD.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"  recorded {PHI3_RECORD}")


def phi3_model(c: lc.Ctx) -> Path:
    """phi3 from scratch (fused attn_qkv / ffn_up, NEOX) on shakespeare.txt, then given the
    longrope of checks/arch_reference.py:longrope (rope factors, attention factor, original
    context 256 of 512, 3/4 of each head rotated). The rope change comes after training:
    the adapter finetuned on it relearns some of what it breaks."""
    from checks.arch_reference import longrope
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.kernels import dequant
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import vocab_kvs, write_model
    d = c.work / "phi3"
    out, src = d / "phi3-longrope-f32.gguf", d / "scratch-LATEST.gguf"
    if c.reuse and out.exists():
        return out
    if not (c.reuse and src.exists()):
        d.mkdir(parents=True, exist_ok=True)
        c.lt("phi3: structure (train-from-scratch)", "train-from-scratch", "--arch", "phi3", "--train-data",
             lc.TRAIN, "--vocab-size", 1000, "--embd", 256, "--head", 8, "--head-kv", 4, "--layer", 2, "--ff", 512,
             "--ctx", 64, "--batch", 8, "--adam-iter", PHI3_SCRATCH_ITERS, "--adam-alpha", 1e-3, "--save-every", 0,
             "--threads", c.threads, "--checkpoint-out", d / "chk-ITERATION.gguf",
             "--model-out", d / "scratch-ITERATION.gguf")
    f = GGUFFile(src)
    cfg, factors = longrope(ModelConfig.from_metadata(f.metadata, str(src)))
    w = {n: dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).reshape(t.shape) for n, t in f.tensors.items()}
    # not "phi3" in general.name: llama.cpp then looks for Phi-3's chat tokens (llama-vocab.cpp)
    write_model(out, cfg, w | factors, vocab_kvs(f), name="longrope test model")
    return out


def phi3_structured(c: lc.Ctx) -> None:
    """Part B for phi3: perplexity F32 exactly, Q8_0 and Q4_K, each without and with an adapter
    finetuned by llamatune, and the Q8_0 model merged by export-lora (types kept), at -c 64
    (short rope factors) and -c 320 (long); the greedy text of both tools at both contexts."""
    from checks.arch_reference import PHI3_CONTEXTS
    f32 = phi3_model(c)
    d = f32.parent
    models = {"F32 exact": f32}
    for q in QUANTS:
        models[q.upper()] = d / f"phi3-{q}.gguf"
        if not (c.reuse and models[q.upper()].exists()):
            requantize(f32, models[q.upper()], q)
    adapter = d / "adapter-LATEST.gguf"
    if not (c.reuse and adapter.exists()):
        c.lt("phi3: adapter (finetune)", "finetune", "--model-base", f32, "--train-data", lc.TRAIN, "-c", 64,
             "-b", 8, "--lora-r", 8, "--adam-iter", c.iters, "--adam-alpha", 2e-3, "--save-every", 0,
             "--threads", c.threads, "--checkpoint-out", d / "chk-lora-ITERATION.gguf",
             "--lora-out", d / "adapter-ITERATION.gguf")
    n_lora = lc.n_tensors(adapter)
    merged = d / "phi3-q8_0-merged.gguf"
    c.lt("phi3: export-lora", "export-lora", "-m", models["Q8_0"], "--lora", adapter, "-o", merged)
    text = d / "eval-part.txt"
    text.write_text(lc.EVAL.read_text(encoding="utf-8")[:EVAL_CHARS], encoding="utf-8")
    cases = [(label, model, with_lora) for label, model in models.items() for with_lora in (False, True)]
    for n_ctx in PHI3_CONTEXTS:
        for label, model, with_lora in cases + [("Q8_0 merged", merged, False)]:
            lora = ["--lora", adapter, "-v"] if with_lora else []
            name = f"phi3 {label} c={n_ctx}" + (" +adapter" if with_lora else "")
            out = lc.run_cpp_complete(c, f"llama-perplexity {name}", [
                c.cpp("llama-perplexity"), "-m", model, "-f", text, "-c", n_ctx, "-b", n_ctx, "-t", c.threads,
                *lora, *(lc.CPP_EXACT if label == "F32 exact" else [])], lc.PPL_RE)
            if with_lora and f"loaded {n_lora} tensors from lora file" not in out:
                raise RuntimeError(f"{name}: llama.cpp did not load the adapter's {n_lora} tensors")
            cpp = lc.ppl_of(out, name)
            lt = lc.ppl_of(c.lt(f"llamatune perplexity {name}", "perplexity", "-m", model, "-f", text, "-c", n_ctx,
                                "-b", n_ctx, *lora[:2]), name)
            tol = 2e-5 if label == "F32 exact" else TOL_Q8
            c.add("B", f"ppl {name}", f"{lt:.4f}", f"{cpp:.4f}", f"{lc.rel(lt, cpp):+.2e}", abs(lc.rel(lt, cpp)) < tol)
        for with_lora in (False, True):
            lora = ["--lora", adapter] if with_lora else []
            name = f"phi3 greedy F32 c={n_ctx}" + (" +adapter" if with_lora else "")
            a = lc.generate_text(c.lt(f"llamatune generate {name}", "generate", "-m", f32, *lora, "-p", PROMPT,
                                      "-n", 24, "--temp", 0, "-c", n_ctx, stdout_only=True))
            b = lc.completion_text(lc.run_cpp_complete(c, f"llama-completion {name}", [
                c.cpp("llama-completion"), "-m", f32, *lora, "-p", PROMPT, "-n", 24, "--temp", 0, "-no-cnv",
                "-t", c.threads, "--no-warmup", "-c", n_ctx, *lc.CPP_EXACT], lc.COMPLETION_DONE_RE, stdout_only=True))
            n = lc.common_prefix(a, b)
            c.add("B", name, repr(a), repr(b), f"same {n}/{max(len(a), len(b))} chars", a == b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=",".join([*FAMILIES, "phi3"]))
    ap.add_argument("--record", action="store_true", help="part A: rewrite tests/fixtures/arch_llamacpp.json")
    ap.add_argument("--no-structured", action="store_true", help="skip part B")
    ap.add_argument("--llama-bin", default="llama.cpp/build/bin")
    ap.add_argument("--workdir", default="/tmp/llamatune-arch-crosscheck")
    ap.add_argument("--iters", type=int, default=120, help="finetune steps that give the base its structure")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--reuse", action="store_true", help="keep the trained models and adapters in the workdir")
    ap.add_argument("--no-repack", action="store_true",
                    help="part A: llama-perplexity -nr (CPUs where llama.cpp's weight repacking crashes)")
    a = ap.parse_args()
    archs = a.arch.split(",")
    work = Path(a.workdir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    lt_cmd = [sys.executable, "-c", "from llamatune.cli.main import app; app()"]
    c = lc.Ctx(Path(a.llama_bin), Path(sys.executable), work, a.threads, a.nice, a.reuse, a.iters, 0, lt_cmd)
    c.log_shim, note = lc.build_log_shim(work)
    print(f"llama.cpp {a.llama_bin}; {note}; workdir {work}\n")
    t0, error = time.time(), None
    try:
        families = [a for a in archs if a in FAMILIES]
        if a.record:
            if families:
                record(c, families, a.no_repack)
            if "phi3" in archs:
                phi3_record(c)
        if not a.no_structured:
            if families:
                from llamatune.models.writer import train_spm_vocab
                vocab = train_spm_vocab(lc.TRAIN.read_text(encoding="utf-8"), FAMILIES["gemma"]["n_vocab"],
                                        str(lc.TRAIN))
            for arch in families:
                structured(c, arch, vocab)
            if "phi3" in archs:
                phi3_structured(c)
    except Exception as e:          # report what ran so far, then the error
        error = e
    return lc.report(c, t0, error)


if __name__ == "__main__":
    sys.exit(main())
