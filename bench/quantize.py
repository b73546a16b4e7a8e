"""Benchmark: Mweights/s of the numba quantizers (llamatune.kernels.quantize and
quantize_weighted), per GGML type, without and with importance weights.

One (1536, 512) matrix of normal floats (the largest of the finetune bench shape),
quantized by `quantize` (the K-quants' numba ports; the legacy types go to gguf-py
there, so they are timed only weighted) and by `quantize_weighted` with an importance
vector of positive floats. Each thread count runs in a fresh process with numba's
thread count set before it loads; the time is the best of --repeat calls after one
warm-up (compilation excluded): the least disturbed by other processes on a shared machine.

    python bench/quantize.py [--threads 1,2] [--repeat 5] [--types Q4_K,Q6_K] [--json]
"""
from __future__ import annotations

import json

from children import best_seconds, per_type_main, per_type_parser

ROWS, COLS = 1536, 512
TYPES = "Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K"
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def child(args) -> None:
    import llamatune  # noqa: F401  (threading policy first)
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from llamatune.kernels.quantize import quantize
    from llamatune.kernels.quantize_weighted import quantize_weighted

    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    qw = rng.random(COLS).astype(np.float32) + np.float32(0.1)
    rows = []
    for name in args.types:
        qtype = T[name]
        runs = [("weighted", lambda: quantize_weighted(x, qtype, qw))]
        if name in K_TYPES:
            runs.insert(0, ("plain", lambda: quantize(x, qtype)))
        for kind, fn in runs:
            best = best_seconds(fn, args.repeat)
            rows.append(dict(threads=args.threads_child, type=name, kind=kind, ms=round(best * 1e3, 2),
                             mweights_per_s=round(ROWS * COLS / best / 1e6, 1)))
    print(json.dumps(rows))


def main() -> None:
    args = per_type_parser(__doc__, TYPES, threads="1", repeat=5).parse_args()
    args.types = args.types.split(",")
    per_type_main(__file__, args, child, f"quantize a ({ROWS}, {COLS}) matrix; best of {args.repeat}",
                  [("threads", "threads", 7), ("type", "type", 5), ("kind", "kind", 8), ("ms", "ms", 8),
                   ("mweights_per_s", "Mw/s", 7)])


if __name__ == "__main__":
    main()
