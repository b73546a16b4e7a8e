"""Benchmark: the output head's cost per token for several token-chunk sizes.

The training step computes the head chunk by chunk of tokens (graph.head_chunk): per
chunk, the quantized head W (V, C) is expanded `head_rows` rows at a time twice, once
for the logits (chunk x V) and once, in reverse, for the gradient to the chunk's
input, exactly as StepExecutor._head does. Small chunks expand W more often and multiply it
in thinner products. This times those expansions and products (random activations;
the cross-entropy between them is left out) for each --chunks size and reports
seconds per 512 tokens, the best of --repeat runs.

    python bench/head_chunks.py --model M.gguf [--chunks 55,74,128,256,512] [--repeat 3]
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF model (its output head, or tied embedding)")
    ap.add_argument("--chunks", default="55,74,128,256,512", help="comma-separated tokens per chunk")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    import numpy as np

    import llamatune  # noqa: F401  (threading policy first)
    from llamatune.models.model import Model
    model = Model(a.model)
    d, W = model.dequantizer, model.weights.output
    V, C, R = W.n_rows, W.n_cols, d.head_rows
    blocks = [(lo, min(V, lo + R)) for lo in range(0, V, R)]
    print(f"head {W.name} {W.qtype.name} ({V}, {C}), expanded {R} rows at a time")
    print(f"{'chunk':>6} {'logits MB':>10} {'s / 512 tokens':>15} {'GFLOP/s':>8}")
    rng = np.random.default_rng(0)
    for n in (int(c) for c in a.chunks.split(",")):
        x = rng.standard_normal((n, C), np.float32)
        logits = np.empty((n, V), np.float32)
        dx, tmp = np.empty((n, C), np.float32), np.empty((n, C), np.float32)

        def head(dx=dx):
            for lo, hi in blocks:
                np.matmul(x, d.block(W, lo, hi).T, out=logits[:, lo:hi])
            for j, (lo, hi) in enumerate(reversed(blocks)):
                if j == 0:
                    np.matmul(logits[:, lo:hi], d.block(W, lo, hi), out=dx)
                else:
                    dx += np.matmul(logits[:, lo:hi], d.block(W, lo, hi), out=tmp)
        head()
        best = float("inf")
        for _ in range(a.repeat):
            t = time.perf_counter()
            head()
            best = min(best, time.perf_counter() - t)
        print(f"{n:6d} {n * V * 4 / 2**20:10.0f} {best * 512 / n:15.3f} {4 * n * C * V / best / 1e9:8.1f}")


if __name__ == "__main__":
    main()
