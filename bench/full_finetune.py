"""Benchmark: full finetuning (`finetune --fine-tune-type full`) against llama.cpp's
`llama-finetune`, on the same F32 model and text, one epoch at ctx 256.

llama-finetune cuts its text into windows of ctx tokens every ctx/2 tokens
(common_opt_dataset_init) and trains one window a step, AdamW at a constant learning
rate (-lr), no weight decay, no clipping. llamatune runs as many steps of one window
(--batch 1 --ctx 256) on the same text, with the same constant rate (--warmup 0
--cos-decay-steps 0), no decay and no clipping. Each run is a fresh process under
`/usr/bin/time -v` (peak RSS); the two tools run alternately, `--rounds` times, and the
spreads are reported. Then llama.cpp's llama-perplexity scores each trained model (and
the base) on held-out text, and llamatune runs once more with SGD (the memory saved).
Last, what the memory estimate gives for a Qwen2.5-1.5B-shaped full finetune with
--checkpointing layer, AdamW and SGD (train/full.state_bytes + buffers.buffer_plan).

    python bench/full_finetune.py --model /tmp/qwen-f32.gguf --llama-bin llama.cpp/build/bin \
        [--windows 23] [--ctx 256] [--lr 1e-5] [--rounds 1] [--work /tmp/full-bench]
The F32 model: llama-quantize --allow-requantize qwen2.5-coder-0.5b-instruct.gguf OUT F32.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def timed(cmd: list[str], log: Path) -> dict:
    """Run cmd under /usr/bin/time -v; its output to `log`; wall seconds and peak RSS."""
    t = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text(errors="replace")
    if rc:
        sys.exit(f"{cmd[0]} failed ({rc}); see {log}:\n{text[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) * 1024
    return {"wall_s": time.perf_counter() - t, "peak_rss_gib": rss / 2**30, "log": str(log)}


def training_text(model: Path, windows: int, ctx: int, out: Path) -> int:
    """The start of shakespeare.txt that llama-finetune cuts into `windows` windows:
    (n_tokens - ctx - 1) // (ctx / 2) == windows. Returns its token count."""
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(model))
    text = (SHARED / "shakespeare.txt").read_text()
    want = windows * (ctx // 2) + ctx + 1 + ctx // 4         # inside the range that gives `windows`
    lo, hi = 0, len(text)
    while lo < hi:                                            # the shortest prefix with `want` tokens
        mid = (lo + hi) // 2
        if len(tok.encode(text[:mid])) < want:
            lo = mid + 1
        else:
            hi = mid
    out.write_text(text[:lo])
    n = len(tok.encode(text[:lo]))
    assert (n - ctx - 1) // (ctx // 2) == windows, n
    return n


def llama_finetune(a, text: Path, out: Path, log: Path) -> dict:
    r = timed([str(a.llama_bin / "llama-finetune"), "-m", str(a.model), "-f", str(text), "-c", str(a.ctx),
               "-b", str(a.ctx), "-ub", str(a.ctx), "-t", "2", "-lr", str(a.lr), "-epochs", "1",
               "-val-split", "0", "-opt", "adamw", "-o", str(out)], log)
    times = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in
             re.findall(r"train: .*?data=\d+/\d+ .*?t=(\d+):(\d+):(\d+)", log.read_text(errors="replace"))]
    steps = len(times)
    r |= {"steps": steps, "train_s": times[-1],
          "tokens_per_s": steps * a.ctx / max(times[-1], 1),
          "steady_tokens_per_s": (steps - 1) * a.ctx / max(times[-1] - times[0], 1)}
    return r


def llamatune(a, text: Path, steps: int, optimizer: str, work: Path, log: Path) -> dict:
    r = timed([sys.executable, "-m", "llamatune.cli.main", "finetune", "--fine-tune-type", "full",
               "--model-base", str(a.model), "--train-data", str(text), "--ctx", str(a.ctx), "--batch", "1",
               "--adam-iter", str(steps), "--adam-alpha", str(a.lr), "--warmup", "0", "--cos-decay-steps", "0",
               "--adam-decay", "0", "--adam-gclip", "0", "--optimizer", optimizer, "--threads", "2",
               "--checkpointing", a.checkpointing, "--save-every", "0", "--no-plot",
               "--checkpoint-out", str(work / f"chk-{optimizer}.gguf"),
               "--model-out", str(work / f"model-{optimizer}.gguf"), "--out-type", "f32",
               "--metrics-out", str(work / f"metrics-{optimizer}.jsonl")]
              + (["--adam-moments", a.adam_moments] if optimizer == "adamw" else []), log)
    text_out = log.read_text(errors="replace")
    m = re.search(r"finetune: (\d+) steps in ([\d.]+) s \(([\d.]+) tokens/s, ([\d.]+) after the first step\)",
                  text_out)
    est = re.search(r"memory estimate: ([\d.]+) GiB", text_out)
    runtime = re.search(r"runtime ([\d.]+) GiB measured", text_out)
    r |= {"steps": int(m.group(1)), "train_s": float(m.group(2)), "tokens_per_s": float(m.group(3)),
          "steady_tokens_per_s": float(m.group(4)), "estimate_gib": float(est.group(1)),
          "runtime_gib": float(runtime.group(1))}
    return r


def perplexity(a, model: Path, log: Path) -> float:
    timed([str(a.llama_bin / "llama-perplexity"), "-m", str(model), "-f", str(a.heldout), "-c", str(a.ctx),
           "-b", str(a.ctx), "-t", "2", "--chunks", str(a.chunks)], log)
    return float(re.search(r"Final estimate: PPL = ([\d.]+)", log.read_text(errors="replace")).group(1))


def estimate_1_5b(runtime_gib: float) -> dict:
    """Memory a Qwen2.5-1.5B-shaped F32 full finetune needs at ctx 256, batch 1, with
    --checkpointing layer: the trained values (full.state_bytes), the graph's buffers and
    the process runtime measured on the 0.5B run (the estimate's) less its trained values."""
    import numpy as np

    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import tensor_names
    from llamatune.train.full import state_bytes
    from llamatune.train.buffers import buffer_plan, plan_bytes
    cfg = ModelConfig.new("qwen2", n_vocab=151936, n_ctx_train=32768, n_embd=1536, n_layer=28, n_ff=8960,
                          n_head=12, n_head_kv=2, head_dim=128, n_rot=128, norm_eps=1e-6, rope_freq_base=1e6)
    n = sum(int(np.prod(s)) for s in tensor_names(cfg, tied=True).values())
    head_rows = max(s[0] * s[1] for k, s in tensor_names(cfg, tied=True).items()
                    if k.startswith("blk.") and len(s) == 2) // cfg.n_embd
    graph = plan_bytes(buffer_plan(cfg, [], 1, 256, "layer", head_rows, True))
    out = {"parameters": n, "graph_gib": graph / 2**30}
    for opt, moments in (("adamw", "f32"), ("adamw", "bf16"), ("sgd", "f32")):
        state = sum(state_bytes(n, opt, moments).values())
        key = opt + (" bf16 moments" if moments == "bf16" else "")
        out[key] = {"state_gib": state / 2**30, "total_gib": (state + graph) / 2**30 + runtime_gib}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="F32 GGUF (llama-quantize ... F32)")
    ap.add_argument("--llama-bin", type=Path, default=Path("llama.cpp/build/bin"))
    ap.add_argument("--windows", type=int, default=23)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--sgd-steps", type=int, default=2, help="steps of the SGD run (its memory)")
    ap.add_argument("--checkpointing", default="auto")
    ap.add_argument("--adam-moments", default="f32", help="llamatune's AdamW moments: f32 or bf16")
    ap.add_argument("--heldout", type=Path, default=SHARED / "shakespeare-eval.txt")
    ap.add_argument("--chunks", type=int, default=16, help="llama-perplexity windows of held-out text")
    ap.add_argument("--work", type=Path, default=Path("/tmp/full-bench"))
    ap.add_argument("--skip", default="", help="comma-separated: llama, llamatune, sgd, ppl")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    a.work.mkdir(parents=True, exist_ok=True)
    text = a.work / "train.txt"
    n_tokens = training_text(a.model, a.windows, a.ctx, text)
    res: dict = {"tokens": n_tokens, "windows": a.windows, "llama": [], "llamatune": []}
    for r in range(a.rounds):                                 # alternately, on the same machine
        if "llama" not in skip:
            res["llama"].append(llama_finetune(a, text, a.work / "llama-out.gguf", a.work / f"llama-{r}.log"))
            print(json.dumps({"llama-finetune": res["llama"][-1]}), flush=True)
        if "llamatune" not in skip:
            res["llamatune"].append(llamatune(a, text, a.windows, "adamw", a.work, a.work / f"llamatune-{r}.log"))
            print(json.dumps({"llamatune": res["llamatune"][-1]}), flush=True)
    if "sgd" not in skip:
        res["llamatune_sgd"] = llamatune(a, text, a.sgd_steps, "sgd", a.work, a.work / "llamatune-sgd.log")
        print(json.dumps({"llamatune sgd": res["llamatune_sgd"]}), flush=True)
    if "ppl" not in skip:
        res["ppl"] = {"base": perplexity(a, a.model, a.work / "ppl-base.log"),
                      "llamatune": perplexity(a, a.work / "model-adamw.gguf", a.work / "ppl-llamatune.log")}
        if "llama" not in skip:
            res["ppl"]["llama-finetune"] = perplexity(a, a.work / "llama-out.gguf", a.work / "ppl-llama.log")
        print(json.dumps({"perplexity": res["ppl"]}), flush=True)
    from llamatune.train.full import state_bytes
    from llamatune.formats.gguf_io import GGUFFile
    n = sum(int(t.data.size) for t in GGUFFile(a.model).tensors.values())
    state = sum(state_bytes(n, "adamw", a.adam_moments).values()) / 2**30
    if res["llamatune"]:
        runtime = res["llamatune"][-1]["runtime_gib"] - state       # the 0.5B run's runtime less its trained values
        res["estimate_1.5b"] = estimate_1_5b(runtime)
    for who in ("llama", "llamatune"):
        runs = res[who]
        if runs:
            res[f"{who}_summary"] = {k: (min(x[k] for x in runs), statistics.median(x[k] for x in runs),
                                         max(x[k] for x in runs))
                                     for k in ("tokens_per_s", "steady_tokens_per_s", "peak_rss_gib")}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
