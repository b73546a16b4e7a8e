"""Cross-check llamatune's outputs against a local llama.cpp build (a script, not a test:
CI has no llama.cpp).

Proves that what llamatune writes loads in llama.cpp and changes llama.cpp's output
exactly as it changes llamatune's:

  0. an F32 copy of the base made by llama-quantize (llama.cpp's own dequantization):
     on F32 weights with an F32 KV cache and flash attention off, llama.cpp does no
     8-bit/F16 rounding, so the two tools must agree to float32 noise ("exact" rows);
  1. finetune two LoRA adapters on tiny-Q4_K_M (A1: rank 8 on q,k,v,o,gate,up,down;
     A2: A1 + output head rank 4 + token_embd rank 4, llama.cpp's flipped layout);
  2. perplexity, base / +adapter / +adapter at scale 0.5, llama-perplexity vs llamatune
     (base, adapted, and the change each tool sees), on Q4_K_M and exactly on F32;
  3. merged models: llamatune export-lora (quant types kept) and llama-export-lora
     (F16 merged tensors), scored by both tools, against base + runtime adapter;
     tensor-level comparison of the two tools' F16 and F32 merges;
  4. full logits of a 64-token window through the llama-cpp-python bindings
     (flash_attn off) and llamatune's Runner, with and without each adapter; the same
     with llama.cpp's Q8_K activation rounding emulated in llamatune; greedy generation
     with an adapter (llama-completion --lora vs llamatune generate --lora);
  5. train-from-scratch models (F32 and Q8_0): perplexity in both tools, llama-completion
     loads them and generates (greedy text compared with llamatune generate);
  6. checkpoint -> PEFT -> GGUF adapter round trip: tensors and llama-perplexity unchanged;
  7. norm adapters: llama.cpp loads them, ignores them at run time (as llamatune does),
     and llama-export-lora merges them exactly as llamatune's export-lora.

    python -m checks.llamacpp_crosscheck [LLAMA_BIN_DIR [BINDINGS_PYTHON]]
        [--workdir /tmp/llamatune-crosscheck] [--iters 30] [--scratch-iters 20]
        [--reuse] [--threads 2] [--nice 10]

Defaults: LLAMA_BIN_DIR llama.cpp/build/bin, BINDINGS_PYTHON
python3. --reuse keeps trained adapters / scratch models already
in the workdir (training is the slow part); everything else is recomputed. Heavy
commands run under `nice`, one at a time; every command's full output goes to
WORKDIR/logs/. Exit status: 0 all checks OK, 1 some check failed, 2 aborted.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHARED = Path(__file__).resolve().parents[2] / "shared"       # ../shared, beside the repository
BASE = SHARED / "models" / "tiny-Q4_K_M.gguf"
TRAIN = SHARED / "data" / "shakespeare.txt"
EVAL = SHARED / "data" / "shakespeare-eval.txt"
PROMPT = "ROMEO:"
PPL_RE = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
COMPLETION_DONE_RE = re.compile(r"common_perf_print: +total time =")
LORA_LOADED_RE = re.compile(r"loaded (\d+) tensors from lora file")
# llama.cpp without any 8-bit / F16 rounding of activations, K, V or attention scores
CPP_EXACT = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]

# Tolerances. On quantized weights llama.cpp's CPU matmuls round activations to 8 bits
# (Q8_K for K-quants, Q8_0 for Q8_0) and to F16 for F16 weights; with default settings it
# also keeps K and V in F16. llamatune computes in f32 on the dequantized weights.
TOL_PPL_REL = 5e-4          # same model file, two tools: |PPL_lt / PPL_cpp - 1|
TOL_DNLL = 5e-4             # change of mean NLL (= log PPL) caused by an adapter, two tools (nats)
TOL_EXACT_PPL_REL = 2e-5    # exact mode (F32 weights, F32 KV, no flash attention)
TOL_EXACT_DNLL = 2e-5
TOL_EXACT_LOGIT = 1e-3      # exact mode: max |logit difference|
TOL_EXACT_DELTA_REL = 1e-3  # exact mode: relative L2 difference of (logits_lora - logits_base)


@dataclass
class Cmd:
    label: str
    argv: list[str]
    seconds: float
    log: Path


@dataclass
class Row:
    step: str
    check: str
    llamatune: str
    llamacpp: str
    diff: str
    ok: bool | None          # None: informative only


@dataclass
class Ctx:
    bin: Path
    py: Path
    work: Path
    threads: int
    nice: int
    reuse: bool
    iters: int
    scratch_iters: int
    llamatune: list[str]
    cmds: list[Cmd] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    f32_base: Path | None = None
    last_stdout: str = ""
    loaded: dict[str, str] = field(default_factory=dict)
    log_shim: Path | None = None

    def run(self, label: str, argv: list, stdout_only: bool = False) -> str:
        argv = [str(a) for a in argv]
        full = ["nice", "-n", str(self.nice)] + argv if self.nice else argv
        log = self.work / "logs" / f"{len(self.cmds) + 1:02d}-{re.sub(r'[^A-Za-z0-9_.@-]+', '_', label)}.log"
        t0 = time.time()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.log_shim and Path(argv[0]).parent == self.bin:
            env["LD_PRELOAD"] = " ".join(x for x in (env.get("LD_PRELOAD", ""), str(self.log_shim)) if x)
        p = subprocess.run(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                           text=True, errors="replace", env=env, cwd=self.work)
        dt = time.time() - t0
        log.write_text(f"$ {' '.join(shlex.quote(a) for a in argv)}\nexit {p.returncode}, {dt:.1f} s\n"
                       f"\n---------- stdout ----------\n{p.stdout}\n---------- stderr ----------\n{p.stderr}")
        self.cmds.append(Cmd(label, argv, dt, log))
        self.last_stdout = p.stdout
        print(f"  [{dt:7.1f} s] {label}", flush=True)
        if p.returncode != 0:
            tail = "\n".join((p.stdout + p.stderr).splitlines()[-25:])
            raise RuntimeError(f"{label}: exit {p.returncode}\n$ {' '.join(argv)}\n{tail}")
        return p.stdout if stdout_only else p.stdout + "\n" + p.stderr

    def lt(self, label: str, *args, stdout_only: bool = False) -> str:
        return self.run(label, self.llamatune + list(args), stdout_only=stdout_only)

    def cpp(self, tool: str) -> Path:
        return self.bin / tool

    def add(self, *args) -> None:
        self.rows.append(Row(*args))


def ppl_of(text: str, label: str) -> float:
    m = PPL_RE.findall(text)
    if not m:
        raise RuntimeError(f"{label}: no 'Final estimate: PPL' line in the output")
    return float(m[-1][0])


def rel(a: float, b: float) -> float:
    return a / b - 1.0


def n_tensors(path: Path) -> int:
    from llamatune.formats.gguf_io import GGUFFile
    return len(GGUFFile(path).tensors)


def cpp_ppl(c: Ctx, label: str, model: Path, n_ctx: int, lora: list | None = None, n_lora: int | None = None,
            exact: bool = False) -> float:
    # -v only to get llama.cpp's "loaded N tensors from lora file" (INFO lines are filtered otherwise)
    args = [c.cpp("llama-perplexity"), "-m", model, "-f", EVAL, "-c", n_ctx, "-b", n_ctx, "-t", c.threads] + \
        (lora or []) + (CPP_EXACT if exact else []) + (["-v"] if n_lora is not None else [])
    out = run_cpp_complete(c, label, args, PPL_RE)
    if n_lora is not None:
        got = sum(int(x) for x in LORA_LOADED_RE.findall(out))
        if got != n_lora:
            raise RuntimeError(f"{label}: llama.cpp loaded {got} adapter tensors, the file holds {n_lora}")
        c.loaded[label] = f"loaded {got}/{n_lora} tensors"
    return ppl_of(out, label)


LOG_SHIM_C = r"""
/* llama.cpp's common logger is a deliberately leaked singleton written by a worker thread
   (common/log.cpp, common_log_main); llama-perplexity and llama-completion return from
   main without flushing it, so the last lines (the 'Final estimate', the generated text)
   are often lost when the process exits. Preloaded, this stops the logger (which drains
   its queue) when the process exits. */
#define _GNU_SOURCE
#include <dlfcn.h>
__attribute__((destructor)) static void flush_llama_log(void) {
    void *(*log_main)(void) = (void *(*)(void)) dlsym(RTLD_DEFAULT, "_Z15common_log_mainv");
    void (*log_pause)(void *) = (void (*)(void *)) dlsym(RTLD_DEFAULT, "_Z16common_log_pauseP10common_log");
    if (log_main && log_pause) log_pause(log_main());
}
"""


def build_log_shim(work: Path) -> tuple[Path | None, str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler: relying on re-runs when llama.cpp's output is cut short"
    src, so = work / "flush_llama_log.c", work / "flush_llama_log.so"
    src.write_text(LOG_SHIM_C)
    p = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(so), str(src), "-ldl"], capture_output=True, text=True)
    if p.returncode != 0:
        return None, f"could not build the log-flush shim ({p.stderr.strip()[:200]}): relying on re-runs"
    return so, f"{so} preloaded into llama.cpp tools (flushes llama.cpp's async logger at exit)"


def run_cpp_complete(c: Ctx, label: str, args: list, last_line: re.Pattern, stdout_only: bool = False) -> str:
    """Run a llama.cpp tool until its output holds `last_line`. llama.cpp writes its log
    through an asynchronous worker thread that is not flushed at exit, so a run can lose
    its last lines (llama-perplexity's 'Final estimate', llama-completion's text and
    timings); the preloaded shim (LOG_SHIM_C) prevents that, and without it such a run
    is repeated."""
    for attempt in range(4):
        out = c.run(label if attempt == 0 else f"{label} (again: output cut short)", args)
        if last_line.search(out):
            break
    else:
        raise RuntimeError(f"{label}: 4 runs, none printed a line matching {last_line.pattern!r}")
    if stdout_only:
        return c.last_stdout
    return out


def lt_ppl(c: Ctx, label: str, model: Path, n_ctx: int, lora: list | None = None) -> float:
    return ppl_of(c.lt(label, "perplexity", "-m", model, "-f", EVAL, "-c", n_ctx, "-b", n_ctx, *(lora or [])), label)


def lora_args(path: Path, scale: float) -> list:
    return ["--lora", path] if scale == 1.0 else ["--lora-scaled", f"{path}:{scale}"]


def dequant_f32(t) -> np.ndarray:
    from llamatune.kernels import dequant
    return dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).astype(np.float32).reshape(t.shape)


# ------------------------------------------------------------------------------------ steps

def step0_f32_base(c: Ctx) -> None:
    print("step 0: F32 copy of the base by llama-quantize (for the exact rows)", flush=True)
    from llamatune.formats.gguf_io import GGUFFile
    c.f32_base = c.work / "tiny-F32-from-Q4_K_M.gguf"
    c.f32_base.unlink(missing_ok=True)
    c.run("llama-quantize Q4_K_M -> F32", [c.cpp("llama-quantize"), "--allow-requantize", BASE, c.f32_base, "F32",
                                           c.threads])
    q, f = GGUFFile(BASE), GGUFFile(c.f32_base)
    worst = max(float(np.abs(dequant_f32(t) - dequant_f32(f.tensors[n])).max()) for n, t in q.tensors.items())
    c.add("0", "F32 base: llama.cpp's dequantization of every Q4_K/Q6_K tensor vs llamatune's", "", "",
          f"max abs diff {worst:.1e}", worst == 0.0)


def step1_train(c: Ctx) -> dict[str, Path]:
    print("step 1: finetune adapters", flush=True)
    from llamatune.formats.gguf_io import GGUFFile
    out = {}
    for name, extra in (("A1", []), ("A2", ["--rank-out", "4", "--rank-tok-embd", "4"])):
        d = c.work / name
        adapter = d / "adapter-LATEST.gguf"
        if not (c.reuse and adapter.exists() and (d / "chk-LATEST.gguf").exists()):
            if d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True)
            c.lt(f"finetune {name}", "finetune", "--model-base", BASE, "--lora-r", "8", *extra,
                 "--train-data", TRAIN, "--ctx", "128", "--batch", "8", "--adam-iter", c.iters,
                 "--warmup", "5", "--adam-alpha", "2e-3", "--save-every", "0", "--threads", c.threads,
                 "--checkpoint-out", d / "chk-ITERATION.gguf", "--lora-out", d / "adapter-ITERATION.gguf")
        else:
            print(f"  (reusing {adapter})")
        out[name] = adapter
        f = GGUFFile(adapter)
        stems = [n[:-len(".lora_a")] for n in f.tensors if n.endswith(".lora_a")]
        kinds = sorted({s.split(".")[2] if s.startswith("blk.") else s.split(".")[0] for s in stems})
        ranks = sorted({f.tensors[s + ".lora_b"].shape[-1] for s in stems})
        c.add("1", f"{name}: {adapter}", f"{len(f.tensors)} tensors, ranks {ranks}, alpha {f.get('adapter.lora.alpha')}",
              "", "on " + ", ".join(kinds), None)
    return out


def step2_perplexity(c: Ctx, adapters: dict[str, Path]) -> dict[str, tuple[float, float]]:
    print("step 2: perplexity with runtime adapters (c=256, b=256)", flush=True)
    res: dict[str, tuple[float, float]] = {}
    for mode, model in (("Q4_K_M", BASE), ("exact", c.f32_base)):
        exact = mode == "exact"
        tag0 = "F32 base, llama.cpp -fa off -ctk f32 -ctv f32" if exact else "Q4_K_M base, llama.cpp defaults"
        base_lt = lt_ppl(c, f"llamatune ppl base [{mode}]", model, 256)
        base_cpp = cpp_ppl(c, f"llama-perplexity base [{mode}]", model, 256, exact=exact)
        res[f"base/{mode}"] = (base_lt, base_cpp)
        tol_ppl, tol_dnll = (TOL_EXACT_PPL_REL, TOL_EXACT_DNLL) if exact else (TOL_PPL_REL, TOL_DNLL)
        c.add("2", f"PPL base ({tag0})", f"{base_lt:.4f}", f"{base_cpp:.4f}", f"{rel(base_lt, base_cpp):+.2e} rel",
              abs(rel(base_lt, base_cpp)) < tol_ppl)
        for name, path in adapters.items():
            for scale in ((1.0, 0.5) if not exact else (1.0,)):
                tag = name if scale == 1.0 else f"{name}@{scale}"
                p_lt = lt_ppl(c, f"llamatune ppl +{tag} [{mode}]", model, 256, lora_args(path, scale))
                label = f"llama-perplexity +{tag} [{mode}]"
                p_cpp = cpp_ppl(c, label, model, 256, lora_args(path, scale), n_lora=n_tensors(path), exact=exact)
                res[f"{tag}/{mode}"] = (p_lt, p_cpp)
                c.add("2", f"PPL base+{tag} [{mode}]", f"{p_lt:.4f}", f"{p_cpp:.4f} ({c.loaded[label]})",
                      f"{rel(p_lt, p_cpp):+.2e} rel", abs(rel(p_lt, p_cpp)) < tol_ppl)
                d_lt, d_cpp = p_lt - base_lt, p_cpp - base_cpp
                n_lt, n_cpp = math.log(p_lt / base_lt), math.log(p_cpp / base_cpp)
                c.add("2", f"  delta PPL (+{tag} - base) [{mode}]", f"{d_lt:+.4f}", f"{d_cpp:+.4f}",
                      f"{d_lt - d_cpp:+.4f} ({(d_lt - d_cpp) / d_cpp:+.2%} of delta); dNLL {n_lt - n_cpp:+.1e}",
                      abs(n_lt - n_cpp) < tol_dnll)
    return res


def compare_merged_tensors(a_path: Path, b_path: Path, stems: list[str],
                           base_path: Path | None = None) -> tuple[int, int, float, float, float]:
    """(values that differ, values, max abs diff, max diff in units of the last place of
    b's type (F16) or 0, max |merged - base| of b, i.e. the size of what was merged)."""
    from llamatune.formats.gguf_io import GGUFFile
    fa, fb = GGUFFile(a_path), GGUFFile(b_path)
    fbase = GGUFFile(base_path) if base_path else None
    n_diff = n_tot = 0
    worst_abs = worst_ulp = max_delta = 0.0
    for s in stems:
        tb = fb.tensors[s]
        x, y = dequant_f32(fa.tensors[s]), dequant_f32(tb)
        d = np.abs(x - y)
        n_diff += int((d > 0).sum())
        n_tot += d.size
        worst_abs = max(worst_abs, float(d.max()))
        if tb.qtype.name == "F16":
            ulp = np.spacing(np.abs(y).astype(np.float16)).astype(np.float32)
            worst_ulp = max(worst_ulp, float((d / ulp).max()))
        if fbase is not None:
            max_delta = max(max_delta, float(np.abs(y - dequant_f32(fbase.tensors[s])).max()))
    return n_diff, n_tot, worst_abs, worst_ulp, max_delta


def step3_merged(c: Ctx, adapters: dict[str, Path], ppl: dict[str, tuple[float, float]]) -> None:
    print("step 3: merged models", flush=True)
    from llamatune.formats.gguf_io import GGUFFile
    d = c.work / "merged"
    d.mkdir(exist_ok=True)
    for name, path in adapters.items():
        stems = sorted({n.rsplit(".", 1)[0] for n in GGUFFile(path).tensors})
        m_lt, m_lt16, m_cpp = d / f"{name}-llamatune-same.gguf", d / f"{name}-llamatune-f16.gguf", d / f"{name}-llamacpp.gguf"
        for p in (m_lt, m_lt16, m_cpp):
            p.unlink(missing_ok=True)
        c.lt(f"llamatune export-lora {name}", "export-lora", "-m", BASE, "--lora", path, "-o", m_lt)
        c.lt(f"llamatune export-lora {name} --outtype f16", "export-lora", "-m", BASE, "--lora", path,
             "-o", m_lt16, "--outtype", "f16")
        c.run(f"llama-export-lora {name}", [c.cpp("llama-export-lora"), "-m", BASE, "--lora", path,
                                             "-o", m_cpp, "-t", c.threads])
        fb, fl, fc = GGUFFile(BASE), GGUFFile(m_lt), GGUFFile(m_cpp)
        changed = sorted({f"{n}:{fl.tensors[n].qtype.name}" for n in fl.tensors if fb.tensors[n].qtype != fl.tensors[n].qtype})
        c.add("3", f"{name} merged: tensor types", "same as base" if not changed else f"changed: {changed}",
              "merged tensors " + "/".join(sorted({fc.tensors[s].qtype.name for s in stems})) + ", others kept",
              "", not changed)
        nd, nt, wa, wu, _ = compare_merged_tensors(m_lt16, m_cpp, stems)
        c.add("3", f"{name}: {len(stems)} merged tensors, llamatune --outtype f16 vs llama-export-lora (F16)", "", "",
              f"{nd}/{nt} values differ, max {wa:.1e} (= {wu:.0f} F16 ulp)", wu <= 1.0)
        rt_lt, rt_cpp = ppl[f"{name}/Q4_K_M"]
        for label, m in (("llamatune merge (Q4_K/Q6_K kept)", m_lt), ("llama-export-lora merge (F16)", m_cpp)):
            p_lt = lt_ppl(c, f"llamatune ppl {name} {label}", m, 256)
            p_cpp = cpp_ppl(c, f"llama-perplexity {name} {label}", m, 256)
            c.add("3", f"PPL {name} {label}", f"{p_lt:.4f}", f"{p_cpp:.4f}", f"{rel(p_lt, p_cpp):+.2e} rel",
                  abs(rel(p_lt, p_cpp)) < TOL_PPL_REL)
            requant = m is m_lt
            c.add("3", f"  merged vs base+{name} at run time (same tool)", f"{rel(p_lt, rt_lt):+.2e} rel",
                  f"{rel(p_cpp, rt_cpp):+.2e} rel",
                  "re-quantization of W+BA to Q4_K/Q6_K" if requant else "F16 storage / F16 activations",
                  None if requant else (abs(rel(p_lt, rt_lt)) < 2e-3 and abs(rel(p_cpp, rt_cpp)) < 2e-3))

    # exact: merge A2 (token_embd flipped + output head) into the F32 base with both tools
    name, path = "A2", adapters["A2"]
    stems = sorted({n.rsplit(".", 1)[0] for n in GGUFFile(path).tensors})
    e_lt, e_cpp = d / "A2-F32base-llamatune.gguf", d / "A2-F32base-llamacpp.gguf"
    for p in (e_lt, e_cpp):
        p.unlink(missing_ok=True)
    c.lt("llamatune export-lora A2 into F32 base", "export-lora", "-m", c.f32_base, "--lora", path, "-o", e_lt)
    c.run("llama-export-lora A2 into F32 base", [c.cpp("llama-export-lora"), "-m", c.f32_base, "--lora", path,
                                                  "-o", e_cpp, "-t", c.threads])
    nd, nt, wa, _, md = compare_merged_tensors(e_lt, e_cpp, stems, c.f32_base)
    c.add("3", f"A2 into F32 base: {len(stems)} merged tensors, llamatune vs llama-export-lora (both F32)", "", "",
          f"{nd}/{nt} values differ, max {wa:.1e} (merge changed weights by up to {md:.2f})", wa < 1e-6 * max(md, 1.0))
    rt = ppl["A2/exact"][1]
    for label, m in (("llamatune", e_lt), ("llama-export-lora", e_cpp)):
        p = cpp_ppl(c, f"llama-perplexity exact, A2 merged into F32 by {label}", m, 256, exact=True)
        c.add("3", f"llama-perplexity exact: F32 base + A2 merged by {label} vs runtime --lora", "",
              f"{p:.4f} vs {rt:.4f}", f"{rel(p, rt):+.2e} rel", abs(rel(p, rt)) < TOL_EXACT_PPL_REL)


BINDINGS_HELPER = """
import json, sys, numpy as np
from llama_cpp import Llama
cfg = json.load(open(sys.argv[1]))
for job in cfg["jobs"]:
    kw = dict(model_path=job["model"], logits_all=True, n_ctx=cfg["n"], n_batch=cfg["n"],
              n_threads=cfg["threads"], verbose=False, flash_attn=False)
    if job["f32_kv"]:
        kw.update(type_k=0, type_v=0)            # GGML_TYPE_F32 KV cache
    if job["lora"]:
        kw.update(lora_path=job["lora"], lora_scale=job["scale"])
    llm = Llama(**kw)
    if job["id"] == "q4/base":
        toks = llm.tokenize(cfg["text"].encode("utf-8"), add_bos=True)[:cfg["n"]]
        json.dump([int(t) for t in toks], open(cfg["out"] + "/bindings_tokens.json", "w"))
    llm.reset()
    llm.eval(cfg["tokens"])
    np.save(cfg["out"] + "/cpp_" + job["id"].replace("/", "_") + ".npy",
            np.array(llm.scores[:cfg["n"]], dtype=np.float32))
    del llm
"""


def q8k_round(x: np.ndarray) -> np.ndarray:
    """x rounded as llama.cpp's quantize_row_q8_K does before a K-quant matmul: blocks of
    256, scale -127/(signed value of largest magnitude), round half to even, min 127."""
    n, k = x.shape
    b = np.asarray(x, np.float32).reshape(n, k // 256, 256)
    mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, np.float32(-127.0) / mx, 0).astype(np.float32)
        d = np.where(iscale != 0, np.float32(1.0) / iscale, 0).astype(np.float32)
    q = np.minimum(np.rint(iscale * b), 127).astype(np.float32)
    return (q * d).reshape(n, k)


def emulating_runner(base_path: Path):
    """A llamatune Runner whose base matmuls see llama.cpp's Q8_K-rounded activations
    (adapters still see the f32 input, as in llama.cpp's build_lora_mm)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from llamatune.models.infer import Runner
    reader = gguf.GGUFReader(str(base_path))
    tensors = {t.name: t for t in reader.tensors}
    kquants = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    cache: dict[str, np.ndarray] = {}

    class EmulatingRunner(Runner):
        def linear(self, y, x, name):
            super().linear(y, x, name)                        # exact, adapters included
            t = tensors[name]
            if t.tensor_type in kquants:
                if name not in cache:
                    cache[name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
                x = np.asarray(x)
                y += (q8k_round(x) - x) @ cache[name].T
            return y
    return EmulatingRunner


def step4_logits(c: Ctx, adapters: dict[str, Path]) -> None:
    print("step 4: logits of a 64-token window (bindings, flash_attn off) and generation", flush=True)
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.models.infer import Runner
    from llamatune.models.model import Model
    n = 64
    d = c.work / "logits"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    text = EVAL.read_text(encoding="utf-8")
    models = {"q4": Model(BASE), "f32": Model(c.f32_base)}
    tokens = models["q4"].tokenizer.encode(text, add_special=True)[:n]
    variants = [("base", None, 1.0), ("A1", adapters["A1"], 1.0), ("A2", adapters["A2"], 1.0),
                ("A1@0.5", adapters["A1"], 0.5)]
    jobs = []
    for v, lora, s in variants:      # llama.cpp as the task asks: Q4_K_M, bindings' defaults (F16 KV)
        jobs.append(dict(id=f"q4/{v}", model=str(BASE), f32_kv=False, lora=str(lora) if lora else None, scale=s))
    for v, lora, s in variants[:2]:  # Q4_K_M with an F32 KV cache, for the Q8_K emulation
        jobs.append(dict(id=f"q4kv32/{v}", model=str(BASE), f32_kv=True, lora=str(lora) if lora else None, scale=s))
    for v, lora, s in variants:      # exact: F32 weights, F32 KV
        jobs.append(dict(id=f"f32/{v}", model=str(c.f32_base), f32_kv=True, lora=str(lora) if lora else None, scale=s))
    helper, cfgf = d / "bindings_logits.py", d / "jobs.json"
    helper.write_text(textwrap.dedent(BINDINGS_HELPER))
    cfgf.write_text(json.dumps(dict(n=n, threads=c.threads, jobs=jobs, out=str(d), tokens=[int(t) for t in tokens],
                                    text=text[:4000])))
    c.run(f"bindings: logits of {len(jobs)} configurations", [c.py, helper, cfgf])
    btoks = json.loads((d / "bindings_tokens.json").read_text())
    c.add("4", f"tokenization of the window ({n} tokens, BOS first)", "", "",
          "identical" if btoks == list(tokens) else "DIFFERENT", btoks == list(tokens))
    cpp = {j["id"]: np.load(d / f"cpp_{j['id'].replace('/', '_')}.npy") for j in jobs}

    t0 = time.time()
    lt: dict[str, np.ndarray] = {}
    toks = np.asarray(tokens, np.int64)[None]
    EmuRunner = emulating_runner(BASE)
    for key, model_key, cls, vs in (("q4", "q4", Runner, variants), ("q4kv32", "q4", EmuRunner, variants[:2]),
                                    ("f32", "f32", Runner, variants)):
        m = models[model_key]
        for v, lora, s in vs:
            runner = cls(m, load_runtime_adapters(m, [(str(lora), s)]) if lora else None)
            lt[f"{key}/{v}"] = np.asarray(runner.forward(toks))[0].astype(np.float32)
    print(f"  [{time.time() - t0:7.1f} s] llamatune Runner: logits of the same configurations", flush=True)

    def rms(x):
        return float(np.sqrt((x ** 2).mean()))

    # (a) as asked: Q4_K_M, llama.cpp's defaults
    noise = rms(lt["q4/base"] - cpp["q4/base"])
    for v, _, _ in variants:
        a, b = lt[f"q4/{v}"], cpp[f"q4/{v}"]
        top = float((a.argmax(-1) == b.argmax(-1)).mean())
        c.add("4", f"Q4_K_M logits {v}: |lt - cpp|, top-1 agreement", f"top-1 {top:.1%}", "",
              f"max abs {np.abs(a - b).max():.2e}, rms {rms(a - b):.2e} (logits {b.min():.1f}..{b.max():.1f})",
              top >= 0.95)
    for v, _, _ in variants[1:]:
        dl, dc = lt[f"q4/{v}"] - lt["q4/base"], cpp[f"q4/{v}"] - cpp["q4/base"]
        r = float(np.linalg.norm(dl - dc) / np.linalg.norm(dc))
        c.add("4", f"Q4_K_M adapter effect {v}: (lora - base), lt vs cpp",
              f"max {np.abs(dl).max():.3f}, rms {rms(dl):.4f}", f"max {np.abs(dc).max():.3f}, rms {rms(dc):.4f}",
              f"max abs diff {np.abs(dl - dc).max():.2e}, rel L2 {r:.2e}; rms diff {rms(dl - dc):.3f} = "
              f"{rms(dl - dc) / noise:.2f} x base noise", rms(dl - dc) < 2.0 * noise)
    # (b) the residual above is llama.cpp's Q8_K rounding of activations: emulate it
    for v, _, _ in variants[:2]:
        a, b = lt[f"q4kv32/{v}"], cpp[f"q4kv32/{v}"]
        per_pos = np.sqrt(((a - b) ** 2).mean(-1))
        first = int(np.argmax(per_pos > 1e-3)) if (per_pos > 1e-3).any() else n
        c.add("4", f"Q4_K_M {v}, F32 KV: llamatune + emulated Q8_K activation rounding vs llama.cpp",
              f"w/o emulation rms {rms(lt[f'q4/{v}'] - b):.2e}", "",
              f"rms {rms(a - b):.2e}; positions 0..{first - 1} agree to max {np.abs(a[:first] - b[:first]).max():.1e}",
              None)
    # (c) exact: F32 weights, F32 KV cache, no flash attention
    for v, _, _ in variants:
        a, b = lt[f"f32/{v}"], cpp[f"f32/{v}"]
        top = float((a.argmax(-1) == b.argmax(-1)).mean())
        c.add("4", f"exact (F32 base, F32 KV) logits {v}: |lt - cpp|, top-1", f"top-1 {top:.1%}", "",
              f"max abs {np.abs(a - b).max():.2e}, rms {rms(a - b):.2e}",
              np.abs(a - b).max() < TOL_EXACT_LOGIT and top == 1.0)
    for v, _, _ in variants[1:]:
        dl, dc = lt[f"f32/{v}"] - lt["f32/base"], cpp[f"f32/{v}"] - cpp["f32/base"]
        r = float(np.linalg.norm(dl - dc) / np.linalg.norm(dc))
        c.add("4", f"exact adapter effect {v}: (lora - base), lt vs cpp",
              f"max {np.abs(dl).max():.3f}, rms {rms(dl):.4f}", f"max {np.abs(dc).max():.3f}, rms {rms(dc):.4f}",
              f"max abs diff {np.abs(dl - dc).max():.2e}, rel L2 {r:.2e}", r < TOL_EXACT_DELTA_REL)

    # greedy generation with an adapter
    for mode, model, extra in (("Q4_K_M", BASE, []), ("exact", c.f32_base, CPP_EXACT)):
        for name in ("A1", "A2"):
            g_cpp = completion_text(run_cpp_complete(
                c, f"llama-completion --lora {name} [{mode}]",
                [c.cpp("llama-completion"), "-m", model, "--lora", adapters[name], "-p", PROMPT, "-n", 32, "--temp", 0,
                 "-no-cnv", "-t", c.threads, "--no-warmup", "-c", 256, *extra], COMPLETION_DONE_RE, stdout_only=True))
            g_lt = generate_text(c.lt(f"llamatune generate --lora {name} [{mode}]", "generate", "-m", model, "--lora",
                                      adapters[name], "-p", PROMPT, "-n", 32, "--temp", 0, "-c", 256, stdout_only=True))
            same = common_prefix(g_lt, g_cpp)
            c.add("4", f"greedy 32 tokens, {name} [{mode}]: text", repr(g_lt[:40]) + "...", repr(g_cpp[:40]) + "...",
                  "identical" if g_lt == g_cpp else f"first {same} of {max(len(g_lt), len(g_cpp))} chars identical",
                  (g_lt == g_cpp) if mode == "exact" else None)


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def completion_text(stdout: str) -> str:
    """llama-completion's stdout: prompt (with SentencePiece's leading space) + generated text
    [+ ' [end of text]\\n'] + '\\n\\n'."""
    s = stdout[:-2] if stdout.endswith("\n\n") else stdout
    s = s.replace(" [end of text]\n", "")
    return s[1:] if s.startswith(" ") else s


def generate_text(stdout: str) -> str:
    return stdout[:-1] if stdout.endswith("\n") else stdout


def step5_scratch(c: Ctx) -> None:
    print("step 5: train-from-scratch models", flush=True)
    import llamatune
    sample = Path(llamatune.__file__).parent / "assets" / "shakespeare-sample.txt"
    for outtype in ("f32", "q8_0"):
        d = c.work / f"scratch-{outtype}"
        model = d / "scratch-LATEST.gguf"
        if not (c.reuse and model.exists()):
            if d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True)
            c.lt(f"train-from-scratch {outtype}", "train-from-scratch", "--train-data", sample,
                 "--vocab-size", "1000", "--embd", "64", "--head", "4", "--layer", "2", "--ctx", "64",
                 "--batch", "8", "--adam-iter", c.scratch_iters, "--save-every", "0", "--threads", c.threads,
                 "--checkpoint-out", d / "chk-ITERATION.gguf",        # default: ./chk-ITERATION.gguf
                 "--model-out", d / "scratch-ITERATION.gguf", *([] if outtype == "f32" else ["--outtype", outtype]))
        else:
            print(f"  (reusing {model})")
        p_lt = lt_ppl(c, f"llamatune ppl scratch {outtype}", model, 64)
        p_cpp = cpp_ppl(c, f"llama-perplexity scratch {outtype}", model, 64)
        c.add("5", f"PPL scratch {outtype} (c=64, b=64, eval text)", f"{p_lt:.4f}", f"{p_cpp:.4f}",
              f"{rel(p_lt, p_cpp):+.2e} rel", abs(rel(p_lt, p_cpp)) < TOL_PPL_REL)
        if outtype == "f32":
            p_ex = cpp_ppl(c, f"llama-perplexity scratch {outtype} exact", model, 64, exact=True)
            c.add("5", f"PPL scratch {outtype}, llama.cpp exact (-fa off, F32 KV)", f"{p_lt:.4f}", f"{p_ex:.4f}",
                  f"{rel(p_lt, p_ex):+.2e} rel", abs(rel(p_lt, p_ex)) < TOL_EXACT_PPL_REL)
        out = run_cpp_complete(c, f"llama-completion scratch {outtype}",
                               [c.cpp("llama-completion"), "-m", model, "-p", PROMPT, "-n", 24, "--temp", 0, "-no-cnv",
                                "-t", c.threads, "--no-warmup", "-c", 64], COMPLETION_DONE_RE, stdout_only=True)
        g_cpp = completion_text(out)
        log = c.cmds[-1].log.read_text()
        m = re.search(r"eval time = .*?/\s+(\d+) runs", log)
        n_gen = int(m.group(1)) + 1 if m else -1          # the first token comes out of the prompt pass
        g_lt = generate_text(c.lt(f"llamatune generate scratch {outtype}", "generate", "-m", model, "-p", PROMPT,
                                  "-n", 24, "--temp", 0, stdout_only=True))
        c.add("5", f"scratch {outtype}: llama-completion loads it, greedy 24 tokens from {PROMPT!r}",
              repr(g_lt[:34]), repr(g_cpp[:34]), f"llama.cpp generated {n_gen} tokens; texts "
              + ("identical" if g_lt == g_cpp else f"differ after {common_prefix(g_lt, g_cpp)} chars"),
              n_gen == 24 and g_cpp.startswith(PROMPT))


def step6_peft(c: Ctx, adapters: dict[str, Path], ppl: dict[str, tuple[float, float]]) -> None:
    print("step 6: checkpoint -> PEFT -> GGUF adapter round trip", flush=True)
    from llamatune.formats.adapter import read_adapter
    from llamatune.formats.gguf_io import GGUFFile
    base = GGUFFile(BASE)
    for name, path in adapters.items():
        d = c.work / name
        peft, back = d / "peft", d / "adapter-roundtrip.gguf"
        if peft.exists():
            shutil.rmtree(peft)
        back.unlink(missing_ok=True)
        c.lt(f"convert {name} chk-LATEST -> peft", "convert-checkpoint", d / "chk-LATEST.gguf", "-o", peft,
             "--to", "peft", "--model-base", BASE)
        c.lt(f"convert {name} peft -> gguf-adapter", "convert-checkpoint", peft, "-o", back,
             "--to", "gguf-adapter", "--model-base", BASE)
        files = sorted(p.name for p in peft.iterdir())
        orig, rt = read_adapter(path, base), read_adapter(back, base)
        same_names = set(orig.pairs) == set(rt.pairs)
        worst = max((float(np.abs(orig.pairs[k][i] - rt.pairs[k][i]).max()) for k in orig.pairs if k in rt.pairs
                     for i in (0, 1)), default=float("nan"))
        scales_ok = all(abs(orig.scale(k) - rt.scale(k)) < 1e-7 for k in orig.pairs if k in rt.pairs)
        c.add("6", f"{name}: chk -> PEFT ({', '.join(files)}) -> GGUF adapter",
              f"{len(rt.pairs)}/{len(orig.pairs)} pairs", f"alpha {orig.alpha} -> {rt.alpha}",
              f"max |A,B diff| vs adapter-LATEST {worst:.1e}; scales {'equal' if scales_ok else 'DIFFER'}",
              same_names and worst == 0.0 and scales_ok)
        p_rt = cpp_ppl(c, f"llama-perplexity +{name} round-tripped", BASE, 256, ["--lora", back], n_lora=n_tensors(back))
        p_orig = ppl[f"{name}/Q4_K_M"][1]
        c.add("6", f"llama-perplexity +{name}: round-tripped vs original adapter", "", f"{p_rt:.4f} vs {p_orig:.4f}",
              f"{p_rt - p_orig:+.4f}", p_rt == p_orig)


def step7_norm_adapters(c: Ctx) -> None:
    """Adapters on the norms (--rank-att-norm / --rank-ffn-norm / --rank-out-norm): llama.cpp
    loads them (their names end in .lora_a/.lora_b, so its `_norm.weight` skip does not
    apply) but never applies them (only build_lora_mm and the token_embd lookup consult
    adapters); llama-export-lora merges them, as llamatune's export-lora does."""
    print("step 7: norm adapters", flush=True)
    from llamatune.formats.gguf_io import GGUFFile
    d = c.work / "A3"
    adapter = d / "adapter-LATEST.gguf"
    if not (c.reuse and adapter.exists()):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        c.lt("finetune A3 (norm adapters)", "finetune", "--model-base", BASE, "--lora-r", "8",
             "--rank-att-norm", "2", "--rank-ffn-norm", "2", "--rank-out-norm", "2", "--train-data", TRAIN,
             "--ctx", "128", "--batch", "8", "--adam-iter", max(5, c.iters // 3), "--warmup", "2",
             "--adam-alpha", "2e-3", "--save-every", "0", "--threads", c.threads,
             "--checkpoint-out", d / "chk-ITERATION.gguf", "--lora-out", d / "adapter-ITERATION.gguf")
    else:
        print(f"  (reusing {adapter})")
    f = GGUFFile(adapter)
    norm_stems = sorted({n.rsplit(".", 1)[0] for n in f.tensors if n.rsplit(".", 1)[0].endswith("norm.weight")})
    p_lt = lt_ppl(c, "llamatune ppl +A3 [exact]", c.f32_base, 256, ["--lora", adapter])
    label = "llama-perplexity +A3 [exact]"
    p_cpp = cpp_ppl(c, label, c.f32_base, 256, ["--lora", adapter], n_lora=len(f.tensors), exact=True)
    c.add("7", f"A3 ({len(norm_stems)} norm adapters + rank 8): runtime PPL, both skip the norm adapters",
          f"{p_lt:.4f}", f"{p_cpp:.4f} ({c.loaded[label]})", f"{rel(p_lt, p_cpp):+.2e} rel",
          abs(rel(p_lt, p_cpp)) < TOL_EXACT_PPL_REL)
    e_lt, e_cpp = c.work / "merged" / "A3-F32base-llamatune.gguf", c.work / "merged" / "A3-F32base-llamacpp.gguf"
    for p in (e_lt, e_cpp):
        p.unlink(missing_ok=True)
    c.lt("llamatune export-lora A3 into F32 base", "export-lora", "-m", c.f32_base, "--lora", adapter, "-o", e_lt)
    c.run("llama-export-lora A3 into F32 base", [c.cpp("llama-export-lora"), "-m", c.f32_base, "--lora", adapter,
                                                  "-o", e_cpp, "-t", c.threads])
    nd, nt, wa, _, md = compare_merged_tensors(e_lt, e_cpp, norm_stems, c.f32_base)
    c.add("7", f"A3: {len(norm_stems)} merged norm vectors, llamatune vs llama-export-lora", "", "",
          f"{nd}/{nt} values differ, max {wa:.1e} (merge changed norms by up to {md:.1e})",
          wa < 1e-6 * max(md, 1.0) and md > 0)


# ------------------------------------------------------------------------------------ main

def print_table(c: Ctx) -> None:
    cols = ("step", "check", "llamatune", "llama.cpp", "difference", "result")
    data = [(r.step, r.check, r.llamatune, r.llamacpp, r.diff, {True: "OK", False: "FAIL", None: "info"}[r.ok])
            for r in c.rows]
    w = [max(len(cols[i]), *(len(x[i]) for x in data)) if data else len(cols[i]) for i in range(len(cols))]
    line = "-+-".join("-" * x for x in w)
    print("\nRESULTS")
    print(" | ".join(cols[i].ljust(w[i]) for i in range(len(cols))))
    prev = None
    for x in data:
        if x[0] != prev:
            print(line)
        prev = x[0]
        print(" | ".join(x[i].ljust(w[i]) for i in range(len(cols))).rstrip())
    print(line)
    print(f"{sum(r.ok is True for r in c.rows)} checks OK, {sum(r.ok is False for r in c.rows)} failed, "
          f"{sum(r.ok is None for r in c.rows)} informative rows")


def print_commands(c: Ctx) -> None:
    short = [("$W", str(c.work)), ("$B", str(c.bin)), ("$S", str(SHARED)), ("$LT", c.llamatune[0])]
    print(f"\nCOMMANDS (wall time; full output in {c.work / 'logs'}/NN-*.log), with")
    print("  " + " ".join(f"{k[1:]}={shlex.quote(v)}" for k, v in short))

    def sh(a: str) -> str:
        for k, v in short:
            if a == v or a.startswith(v + "/"):
                return '"' + k + a[len(v):] + '"' if any(ch in a[len(v):] for ch in " ()") else k + a[len(v):]
        return shlex.quote(a)
    for i, cmd in enumerate(c.cmds, 1):
        pre = f"LD_PRELOAD={sh(str(c.log_shim))} " if c.log_shim and Path(cmd.argv[0]).parent == c.bin else ""
        print(f"{i:2d}. [{cmd.seconds:5.1f} s] {cmd.label}")
        print("      " + pre + " ".join(sh(a) for a in cmd.argv))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_bin", nargs="?", default="llama.cpp/build/bin", help="llama.cpp bin directory")
    ap.add_argument("llama_python", nargs="?", default="python3",
                    help="python with llama-cpp-python")
    ap.add_argument("--workdir", default="/tmp/llamatune-crosscheck")
    ap.add_argument("--iters", type=int, default=30, help="finetune steps per adapter")
    ap.add_argument("--scratch-iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--reuse", action="store_true", help="keep trained adapters / scratch models in the workdir")
    a = ap.parse_args()
    bin_dir, py = Path(a.llama_bin), Path(a.llama_python)
    for t in ("llama-perplexity", "llama-export-lora", "llama-completion", "llama-quantize"):
        if not (bin_dir / t).exists():
            ap.error(f"{bin_dir / t} not found")
    if not py.exists():
        ap.error(f"{py} not found")
    exe = Path(sys.executable).parent / "llamatune"
    lt_cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from llamatune.cli.main import app; app()"]
    work = Path(a.workdir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    for old in (work / "logs").glob("*.log"):
        old.unlink()
    c = Ctx(bin_dir, py, work, a.threads, a.nice, a.reuse, a.iters, a.scratch_iters, lt_cmd)
    c.log_shim, shim_note = build_log_shim(work)
    version = subprocess.run([str(bin_dir / "llama-perplexity"), "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True).stdout.strip().splitlines()
    bver = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout.strip()
    import llamatune
    print(f"llama.cpp: {bin_dir} ({'; '.join(version)})")
    print(f"bindings:  {py} (llama_cpp_python {bver})")
    print(f"llamatune: {Path(llamatune.__file__).parent} ({' '.join(lt_cmd)})")
    print(f"log shim:  {shim_note}")
    print(f"base model {BASE}, eval text {EVAL}; workdir {work}\n")
    t0 = time.time()
    error = None
    try:
        step0_f32_base(c)
        adapters = step1_train(c)
        ppl = step2_perplexity(c, adapters)
        step3_merged(c, adapters, ppl)
        step4_logits(c, adapters)
        step5_scratch(c)
        step6_peft(c, adapters, ppl)
        step7_norm_adapters(c)
    except Exception as e:          # report what ran so far, then the error
        error = e
    print_commands(c)
    return report(c, t0, error)


def report(c, t0: float, error: Exception | None) -> int:
    """Print the table of checks, the time taken and the error that stopped the run (if
    any); the exit code: 2 aborted, 1 a check failed, 0 all passed."""
    print_table(c)
    print(f"\ntotal {time.time() - t0:.0f} s")
    if error is not None:
        print(f"\nABORTED: {type(error).__name__}: {error}")
        return 2
    return 1 if any(r.ok is False for r in c.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
