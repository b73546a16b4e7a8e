"""Benchmark: perplexity and generation speed, llamatune f32 and bf16 against llama.cpp,
on the same GGUF, two threads, alternating runs.

Each llamatune run is a fresh process timed as a whole; the start-up (load, kernel cache)
is taken out by running two sizes and dividing the difference in tokens by the
difference in seconds: perplexity over the first `--small` and `--large` windows of the
held-out text. Generation: `--n-large` greedy tokens after the same prompt, timed in the
process after a warm-up, the prompt's forward left out (tokens after the first / s). llama-perplexity is timed the same way (two sizes, whole processes);
llama-completion's figure is its own `eval` tokens per second.

    python bench/infer_speed.py --model /work/models/qwen2.5-coder-0.5b-instruct.gguf \
        --llama-bin /work/llamacpp/build-avx512/bin [--ctx 512] [--rounds 2]
"""
from __future__ import annotations

import argparse
import re
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


def ours_gen(a, dtype: str, n: int) -> float:
    """Seconds of `n` greedy decode steps after the prompt, in a fresh process (no stop at
    EOS, as llama-completion --ignore-eos); the prompt's own forward is timed apart and
    left out, as llama.cpp's `eval time` leaves out its prompt."""
    code = ("import time, llamatune\n"
            "from llamatune.models.runner import make_runner\n"
            "from llamatune.models.sampling import generate_ids\n"
            f"r = make_runner({str(a.model)!r}, compute_dtype={dtype!r})\n"
            f"ids = r.model.tokenizer.encode({PROMPT!r}, add_special=True)\n"
            "list(generate_ids(r, ids, 2, 0.0, 40, 0.95, 1, None, set()))\n"   # warm-up: kernels loaded
            "t = time.perf_counter(); list(generate_ids(r, ids, 1, 0.0, 40, 0.95, 1, None, set())); p = time.perf_counter() - t\n"
            f"t = time.perf_counter(); out = list(generate_ids(r, ids, {n}, 0.0, 40, 0.95, 1, None, set()))\n"
            f"assert len(out) == {n}, len(out)\n"
            "print(time.perf_counter() - t - p)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"generation failed:\n{r.stderr[-2000:]}")
    return float(r.stdout.strip().splitlines()[-1])


def llama_ppl(a, text: Path) -> float:
    s, _ = timed([str(a.llama_bin / "llama-perplexity"), "-m", str(a.model), "-f", str(text), "-c", str(a.ctx),
                  "-b", str(a.ctx), "-t", "2"])
    return s


def llama_gen(a) -> float:
    _, out = timed([str(a.llama_bin / "llama-completion"), "-m", str(a.model), "-p", PROMPT, "-n", str(a.n_large),
                    "--temp", "0", "-t", "2", "-no-cnv", "--ignore-eos"])
    return float(re.findall(r"\beval time =.*?([0-9.]+) tokens per second", out)[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--llama-bin", type=Path, default=Path("/work/llamacpp/build-avx512/bin"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--small", type=int, default=2, help="windows of the short perplexity run")
    ap.add_argument("--large", type=int, default=8, help="windows of the long perplexity run")
    ap.add_argument("--n-small", type=int, default=8)
    ap.add_argument("--n-large", type=int, default=72)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/llamatune-infer"))
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    small, large = a.work / "small.txt", a.work / "large.txt"
    n_small, n_large = text_of(a.model, a.small, a.ctx, small), text_of(a.model, a.large, a.ctx, large)
    res: dict[str, list[float]] = {k: [] for k in ("ppl f32", "ppl bf16", "ppl llama.cpp",
                                                   "gen f32", "gen bf16", "gen llama.cpp")}
    for r in range(a.rounds):
        for dtype in ("f32", "bf16"):
            res[f"ppl {dtype}"].append((n_large - n_small) / (ours_ppl(a, dtype, large) - ours_ppl(a, dtype, small)))
            res[f"gen {dtype}"].append((a.n_large - 1) / ours_gen(a, dtype, a.n_large))
        res["ppl llama.cpp"].append((n_large - n_small) / (llama_ppl(a, large) - llama_ppl(a, small)))
        res["gen llama.cpp"].append(llama_gen(a))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()), flush=True)
    print(f"\n{a.model.name}, ctx {a.ctx}, 2 threads, tokens/s (median of {a.rounds} rounds; min-max)")
    for k, v in res.items():
        print(f"{k:14} {statistics.median(v):8.1f}  ({min(v):.1f}-{max(v):.1f})")
    for what in ("ppl", "gen"):
        ll = statistics.median(res[f"{what} llama.cpp"])
        print(f"{what}: f32 / llama.cpp {statistics.median(res[f'{what} f32']) / ll:.2f}x, "
              f"bf16 / llama.cpp {statistics.median(res[f'{what} bf16']) / ll:.2f}x")


if __name__ == "__main__":
    main()
