"""Benchmark: inference forward throughput (tokens/s) of a GGUF model, batched as
perplexity runs it (windows of --ctx tokens, --batch tokens per forward).

    python bench/forward.py ../shared/models/tiny-Q8_0.gguf [--ctx 256] [--batch 2048] [--reps 3]
"""
from __future__ import annotations

import argparse
import time

import llamatune  # noqa: F401  (first: threading policy before numpy loads)
import numpy as np

from llamatune.models.infer import Runner
from llamatune.models.model import Model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model = Model(a.model)
    runner = Runner(model)
    B = max(1, a.batch // a.ctx)
    tokens = np.random.default_rng(0).integers(0, model.config.n_vocab, (B, a.ctx))
    runner.forward(tokens)                                   # warm-up: numba cache load / compile
    times = []
    for _ in range(a.reps):
        t = time.perf_counter()
        runner.forward(tokens)
        times.append(time.perf_counter() - t)
    best = min(times)
    print(f"{a.model}: {B} x {a.ctx} tokens per forward, best of {a.reps}: {best * 1e3:.0f} ms "
          f"= {B * a.ctx / best:,.0f} tokens/s (median {B * a.ctx / float(np.median(times)):,.0f})")


if __name__ == "__main__":
    main()
