"""Benchmark: first-run numba compile time (cold cache) and warm start time.

Runs the same short `finetune` twice in fresh processes with numba's on-disk cache
pointed at a new empty directory (NUMBA_CACHE_DIR): the first run compiles every
kernel it uses, the second loads them from that cache. Reported: the wall time of
each whole process (import, model load, kernel warm-up, the steps, the save), and
their difference, the compile time a new user pays once.

    python bench/startup.py [--model MODEL.gguf [--text TEXT]] [--ctx 64] [--batch 1] [--steps 1]

Without --model the byte-vocabulary bench model of bench/mpi_scaling.py (the bench
shape of bench/finetune_step.py in Q8_0) and its random-words text are built and used;
with --model the text defaults to the embedded Shakespeare sample.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpi_scaling import build  # bench/ is sys.path[0] when run as a script

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "llamatune" / "assets" / "shakespeare-sample.txt"


def timed_finetune(model: Path, text: Path, ctx: int, batch: int, steps: int, cache: Path, out: Path) -> float:
    """Wall seconds of one `finetune` process with numba's cache in `cache`."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    cmd = [sys.executable, "-m", "llamatune.cli.main", "finetune", "--model-base", str(model),
           "--train-data", str(text), "--ctx", str(ctx), "--batch", str(batch), "--adam-iter", str(steps),
           "--no-plot", "--lora-out", str(out / "a-ITERATION.gguf"), "--checkpoint-out", str(out / "c-ITERATION.gguf")]
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-bench"))
    a = ap.parse_args()
    model, text = a.model, a.text
    if model is None:
        a.workdir.mkdir(parents=True, exist_ok=True)
        model, text = build(a.workdir)
    with tempfile.TemporaryDirectory() as tmp:
        cache, out = Path(tmp) / "numba-cache", Path(tmp) / "out"
        cache.mkdir()
        out.mkdir()
        cold = timed_finetune(model, text, a.ctx, a.batch, a.steps, cache, out)
        warm = timed_finetune(model, text, a.ctx, a.batch, a.steps, cache, out)
    print(f"{model.name}: ctx {a.ctx}, batch {a.batch}, {a.steps} step(s); {os.cpu_count()} CPUs")
    print(f"cold cache (compiles every kernel): {cold:6.1f} s")
    print(f"warm cache (loads them):            {warm:6.1f} s")
    print(f"first-run compile time:             {cold - warm:6.1f} s")


if __name__ == "__main__":
    main()
