"""Benchmark: `llamatune finetune` with --compute-dtype f32 against bf16 on one model,
the two runs alternating, each a fresh process under /usr/bin/time -v (peak RSS).

For each run: the steady tokens/s (metrics.jsonl, the steps after the first), the loss
after --steps steps, the last validation loss (with --val-data), the peak RSS. Then the
ratios bf16 / f32 and, per round, how far bf16's loss is from f32's.

    python bench/compute_dtype.py --model qwen2.5-coder-0.5b-instruct.gguf \
        [--data shakespeare.txt] [--val-data FILE] [--ctx 256] [--batch 2] [--steps 8] \
        [--rounds 2] [--lr 1e-4] [--mode auto] [--extra=--pack] [--work /tmp/llamatune-dtype]

The 50-step chat comparison of issue #29:
    python bench/compute_dtype.py --model QWEN.gguf --data bench/chat_demo/pirate-train.jsonl \
        --val-data bench/chat_demo/pirate-val.jsonl --ctx 256 --batch 2 --steps 50 --lr 1e-3 --extra=--pack
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(a, dtype: str, work: Path, tag: str) -> dict:
    d = work / tag
    d.mkdir(parents=True, exist_ok=True)
    metrics = d / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "llamatune.cli.main", "finetune", "--model-base", str(a.model),
           "--train-data", str(a.data), "--ctx", str(a.ctx), "--batch", str(a.batch), "--lora-r", "8",
           "--adam-iter", str(a.steps), "--adam-alpha", str(a.lr), "--warmup", "2", "--cos-decay-steps", str(a.steps),
           "--threads", "2", "--checkpointing", a.mode, "--save-every", "0", "--no-plot", "--seed", "1",
           "--compute-dtype", dtype, "--checkpoint-out", str(d / "chk-ITERATION.gguf"),
           "--lora-out", str(d / "adapter-ITERATION.gguf"), "--metrics-out", str(metrics)]
    if a.val_data:
        cmd += ["--val-data", str(a.val_data), "--eval-every", str(a.eval_every)]
    cmd += shlex.split(a.extra)
    log = d / "run.log"
    with open(log, "w") as f:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=d).returncode
    text = log.read_text(errors="replace")
    if rc:
        sys.exit(f"finetune --compute-dtype {dtype} failed ({rc}); see {log}:\n{text[-2000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    rates = [r["tokens_per_s"] for r in steps[1:]] or [steps[0]["tokens_per_s"]]
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) * 1024
    compute = re.search(r"^compute: (.*)$", text, re.M)
    return {"dtype": dtype, "compute": compute.group(1) if compute else "?",
            "tokens_per_s": statistics.median(rates), "loss": steps[-1]["loss"],
            "losses": [r["loss"] for r in steps], "val_loss": vals[-1] if vals else None,
            "peak_rss_gib": rss / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "shakespeare.txt")
    ap.add_argument("--val-data", type=Path)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--mode", default="auto", help="--checkpointing")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--extra", default="", help="more finetune flags, one string")
    ap.add_argument("--work", type=Path, default=Path("/tmp/llamatune-dtype"))
    a = ap.parse_args()
    a.model, a.data = a.model.resolve(), a.data.resolve()              # the runs' working folder is their own
    a.val_data = a.val_data and a.val_data.resolve()
    res: dict[str, list[dict]] = {"f32": [], "bf16": []}
    for r in range(a.rounds):
        for dtype in ("f32", "bf16"):
            out = run(a, dtype, a.work, f"{dtype}-{r}")
            res[dtype].append(out)
            print(json.dumps({k: v for k, v in out.items() if k != "losses"}), flush=True)
    f, b = res["f32"], res["bf16"]
    print(f"\n{a.model.name}, ctx {a.ctx}, batch {a.batch}, {a.steps} steps, --checkpointing {a.mode} "
          f"{a.extra}; {a.rounds} alternating rounds")
    print(f"bf16: {b[0]['compute']}")
    for name, key in (("tokens/s", "tokens_per_s"), ("peak RSS GiB", "peak_rss_gib")):
        fv, bv = [x[key] for x in f], [x[key] for x in b]
        print(f"{name:14} f32 {min(fv):.2f}-{max(fv):.2f}  bf16 {min(bv):.2f}-{max(bv):.2f}  "
              f"ratio {min(bv) / max(fv):.2f}-{max(bv) / min(fv):.2f}x")
    for i, (x, y) in enumerate(zip(f, b)):
        line = (f"round {i}: loss after {a.steps} steps f32 {x['loss']:.4f} bf16 {y['loss']:.4f} "
                f"({(y['loss'] - x['loss']) / x['loss']:+.2%})")
        if x["val_loss"] is not None:
            line += (f"; validation loss f32 {x['val_loss']:.4f} bf16 {y['val_loss']:.4f} "
                     f"({(y['val_loss'] - x['val_loss']) / x['val_loss']:+.2%})")
        print(line)
    print("f32 losses  " + " ".join(f"{v:.4f}" for v in f[0]["losses"]))
    print("bf16 losses " + " ".join(f"{v:.4f}" for v in b[0]["losses"]))


if __name__ == "__main__":
    main()
