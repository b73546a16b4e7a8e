"""Benchmark: perplexity and generation speed, llamatune f32 and bf16 against llama.cpp,
on the same GGUF, two threads, alternating runs.

Each llamatune run is a fresh process timed as a whole; the start-up (load, kernel cache)
is taken out by running two sizes and dividing the difference in tokens by the
difference in seconds: perplexity over the first `--small` and `--large` windows of the
held-out text. Generation: `--n-large` greedy tokens after the same prompt, timed in the
process after a warm-up, the prompt's forward left out (tokens after the first / s),
with the decode steps on the quantized blocks (`gen f32`/`gen bf16`: the runner's default,
kernels/qdot.py) and, as before them, on dequantized float32 weights (`gen deq f32`);
`gen x8` decodes 8 copies of the prompt together (tokens of all 8 per second).
llama-perplexity is timed the same way (two sizes, whole processes); llama-completion's
figure is its own `eval` tokens per second. --gen-only skips the perplexity runs,
--f32-only the bf16 and dequantized-weights generation runs.

    python bench/infer_speed.py --model qwen2.5-coder-0.5b-instruct.gguf \
        --llama-bin llama.cpp/build/bin [--ctx 512] [--rounds 2]
"""
from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "data" / "shakespeare-eval.txt"
PROMPT = "Once upon a time, in a small village by the sea,"


def timed(cmd: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd[:6])} ... failed ({r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    return time.perf_counter() - t, r.stdout + r.stderr


def text_of(model: Path, windows: int, ctx: int, out: Path) -> int:
    """The start of the held-out text with `windows` full windows of ctx tokens; its tokens."""
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(model))
    text = TEXT.read_text()
    ids = tok.encode(text)
    n = windows * ctx
    cut = len(tok.decode(ids[:n + 1]))
    out.write_text(text[:cut])
    return len(tok.encode(out.read_text()))


def ours_ppl(a, dtype: str, text: Path) -> float:
    s, out = timed([sys.executable, "-m", "llamatune.cli.main", "perplexity", "-m", str(a.model), "-f", str(text),
                    "-c", str(a.ctx), "--compute-dtype", dtype])
    return s


def ours_gen(a, dtype: str, n: int, quantized: bool = True) -> float:
    """Seconds of `n` greedy decode steps after the prompt, in a fresh process (no stop at
    EOS, as llama-completion --ignore-eos); the prompt's own forward is timed apart and
    left out, as llama.cpp's `eval time` leaves out its prompt. quantized=False: the decode
    steps on dequantized float32 weights (Runner.quantized_decode off)."""
    code = ("import time, llamatune\n"
            f"clock = time.{a.clock}\n"
            "from llamatune.models.runner import make_runner\n"
            "from llamatune.models.sampling import generate_ids\n"
            f"r = make_runner({str(a.model)!r}, compute_dtype={dtype!r})\n"
            f"r.quantized_decode = {quantized!r}\n"
            f"ids = r.model.tokenizer.encode({PROMPT!r}, add_special=True)\n"
            "list(generate_ids(r, ids, 2, 0.0, 40, 0.95, 1, None, set()))\n"   # warm-up: kernels loaded
            "t = clock(); list(generate_ids(r, ids, 1, 0.0, 40, 0.95, 1, None, set())); p = clock() - t\n"
            f"t = clock(); out = list(generate_ids(r, ids, {n}, 0.0, 40, 0.95, 1, None, set()))\n"
            f"assert len(out) == {n}, len(out)\n"
            "print(clock() - t - p)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"generation failed:\n{r.stderr[-2000:]}")
    return float(r.stdout.strip().splitlines()[-1])


def ours_gen_batched(a, rows: int, n: int) -> float:
    """Tokens per second of `rows` copies of the prompt decoded together for `n` greedy
    steps (each row its own argmax), in a fresh process, the prompt's forward left out."""
    code = ("import time, llamatune, numpy as np\n"
            f"clock = time.{a.clock}\n"
            "from llamatune.models.infer import KVCache\n"
            "from llamatune.models.runner import make_runner\n"
            f"r = make_runner({str(a.model)!r})\n"
            f"ids = r.model.tokenizer.encode({PROMPT!r}, add_special=True)\n"
            "def run(steps):\n"
            f"    c = KVCache.empty(r.model, {rows}, len(ids) + steps, context=4096)\n"
            f"    nxt = r.forward(np.tile(np.asarray(ids), ({rows}, 1)), c)[:, -1].argmax(-1)\n"
            "    t = clock()\n"
            "    for _ in range(steps):\n"
            "        nxt = r.forward(nxt[:, None], c)[:, -1].argmax(-1)\n"
            "    return clock() - t\n"
            "run(2)\n"
            f"print({rows} * {n} / run({n}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"batched generation failed:\n{r.stderr[-2000:]}")
    return float(r.stdout.strip().splitlines()[-1])


def llama_ppl(a, text: Path) -> float:
    s, _ = timed([str(a.llama_bin / "llama-perplexity"), "-m", str(a.model), "-f", str(text), "-c", str(a.ctx),
                  "-b", str(a.ctx), "-t", str(a.threads), *a.llama_arg])
    return s


def llama_gen(a) -> float:
    cmd = [str(a.llama_bin / "llama-completion"), "-m", str(a.model), "-p", PROMPT, "--temp", "0",
           "-t", str(a.threads), "-no-cnv", "--ignore-eos", *a.llama_arg]
    if a.clock == "process_time":                 # CPU seconds: two lengths, whole processes
        used = []
        for n in (a.n_small, a.n_large):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            timed(cmd + ["-n", str(n)])
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            used.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        return (a.n_large - a.n_small) / (used[1] - used[0])
    _, out = timed(cmd + ["-n", str(a.n_large)])
    return float(re.findall(r"\beval time =.*?([0-9.]+) tokens per second", out)[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--llama-bin", type=Path, default=Path("llama.cpp/build/bin"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--small", type=int, default=2, help="windows of the short perplexity run")
    ap.add_argument("--large", type=int, default=8, help="windows of the long perplexity run")
    ap.add_argument("--n-small", type=int, default=8)
    ap.add_argument("--n-large", type=int, default=72)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/llamatune-infer"))
    ap.add_argument("--gen-only", action="store_true", help="skip the perplexity runs")
    ap.add_argument("--f32-only", action="store_true",
                    help="skip the bf16 and dequantized-weights generation runs (decode figures only: gen f32, x8)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="generation per CPU second (process time; llama.cpp: its CPU time over two lengths), "
                         "not per wall second: figures a shared machine's load does not swamp")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (set ours with NUMBA_NUM_THREADS)")
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="an argument added to llama.cpp's commands (repeatable), e.g. --llama-arg=-nr where "
                         "the CPU lists AMX but the kernel does not grant it (ggml's AMX kernels then fault)")
    a = ap.parse_args()
    a.clock = "process_time" if a.cpu_time else "perf_counter"
    a.work.mkdir(parents=True, exist_ok=True)
    small, large = a.work / "small.txt", a.work / "large.txt"
    if not a.gen_only:
        n_small, n_large = text_of(a.model, a.small, a.ctx, small), text_of(a.model, a.large, a.ctx, large)
    keys = ("gen f32", "gen x8", "gen llama.cpp") if a.f32_only else ("gen deq f32", "gen f32", "gen bf16", "gen x8",
                                                                       "gen llama.cpp")
    res: dict[str, list[float]] = {k: [] for k in (() if a.gen_only else ("ppl f32", "ppl bf16", "ppl llama.cpp"))
                                   + keys}
    for r in range(a.rounds):
        for dtype in ("f32",) if a.f32_only else ("f32", "bf16"):
            if not a.gen_only:
                res[f"ppl {dtype}"].append((n_large - n_small)
                                           / (ours_ppl(a, dtype, large) - ours_ppl(a, dtype, small)))
            res[f"gen {dtype}"].append((a.n_large - 1) / ours_gen(a, dtype, a.n_large))
        if not a.f32_only:
            res["gen deq f32"].append((a.n_large - 1) / ours_gen(a, "f32", a.n_large, quantized=False))
        res["gen x8"].append(ours_gen_batched(a, 8, a.n_large // 2))
        if not a.gen_only:
            res["ppl llama.cpp"].append((n_large - n_small) / (llama_ppl(a, large) - llama_ppl(a, small)))
        res["gen llama.cpp"].append(llama_gen(a))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()), flush=True)
    per = "CPU second" if a.cpu_time else "s"
    print(f"\n{a.model.name}, ctx {a.ctx}, {a.threads} threads, tokens/{per} (median of {a.rounds} rounds; min-max)")
    for k, v in res.items():
        print(f"{k:14} {statistics.median(v):8.1f}  ({min(v):.1f}-{max(v):.1f})")
    for what in ("gen",) if a.gen_only else ("ppl", "gen"):
        ll = statistics.median(res[f"{what} llama.cpp"])
        print(f"{what}: f32 / llama.cpp {statistics.median(res[f'{what} f32']) / ll:.2f}x"
              + ("" if a.f32_only else f", bf16 / llama.cpp {statistics.median(res[f'{what} bf16']) / ll:.2f}x"))
    one = statistics.median(res["gen f32"])
    if not a.f32_only:
        print(f"gen: quantized blocks / dequantized f32 {one / statistics.median(res['gen deq f32']):.2f}x")
    print(f"gen: 8 sequences together / one {statistics.median(res['gen x8']) / one:.2f}x")


if __name__ == "__main__":
    main()
